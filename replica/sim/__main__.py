"""``python -m replica.sim --port P``: a vLLM-compatible simulated replica (OpenAI API, vLLM
metrics, vLLM KV events). Ready when ``GET /health`` answers 200."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from .costmodel import profile
from .engine import AsyncEngine, EngineConfig, EngineCore
from .kv_events import Publisher
from .scheduler import SchedulerConfig
from .server import make_app, serve


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m replica.sim",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--port", type=int, default=8000, help="HTTP port (OpenAI API, /metrics, /health)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a container)")
    p.add_argument(
        "--model", default="meta-llama/Llama-3.1-8B-Instruct", help="model name served and reported"
    )
    p.add_argument(
        "--profile",
        default="h100-llama-3.1-8b",
        help="cost model: cpu-test, or <gpu>-<model>, e.g. a100-qwen3-32b",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="factor on every engine step time (0.1: ten times faster than the profile)",
    )
    p.add_argument("--block-size", type=int, default=16, help="KV block size, in tokens")
    p.add_argument(
        "--num-gpu-blocks",
        "--kv-blocks",
        type=int,
        default=0,
        help="KV cache size, in blocks (0: derived from the profile)",
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="token budget of one engine step, in tokens"
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    p.add_argument(
        "--cache-aware-admission",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="longest cached prefix first, within --aging-s (on, as the chart's vLLM replicas)",
    )
    p.add_argument(
        "--aging-s",
        type=float,
        default=2.0,
        help="seconds a request may wait before cache-aware admission takes it first-come-first-served",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="cap one request's prefill chunk, in tokens, as vLLM (0: no cap)",
    )
    p.add_argument(
        "--kv-events-port", type=int, default=0, help="publish vLLM KV events on tcp://HOST:PORT (0: off)"
    )
    p.add_argument("--kv-events-topic", default="kv", help="ZMQ topic of the KV events")
    p.add_argument(
        "--data-parallel-rank",
        type=int,
        default=0,
        help="as vLLM: this rank publishes (and replays) its KV events on the event ports + rank",
    )
    p.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=0,
        help="serve vLLM's KV-event replay (ROUTER) on tcp://HOST:PORT (0: off)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        help="adapters served besides --model: NAME or NAME=PATH (as vLLM)",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="max_lora reported in vllm:lora_requests_info (as vLLM's --max-loras)",
    )
    p.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="usage in every stream, final and per chunk, whatever stream_options says (as vLLM)",
    )
    p.add_argument(
        "--enable-fault-api",
        action="store_true",
        help="tests only: POST /admin/fault freezes the engine or fails /health",
    )
    return p


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        a.block_size,
        a.num_gpu_blocks,
        a.time_scale,
        SchedulerConfig(
            max_num_batched_tokens=a.max_num_batched_tokens,
            max_num_seqs=a.max_num_seqs,
            cache_aware=a.cache_aware_admission,
            aging_s=a.aging_s,
            long_prefill_token_threshold=a.long_prefill_token_threshold,
        ),
    )


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    loras = tuple(m.partition("=")[0] for m in a.lora_modules)
    prof = profile(a.profile)

    async def run() -> None:
        events = None
        if a.kv_events_port:
            lora_ids = {name: i + 1 for i, name in enumerate(loras)}
            rank = a.data_parallel_rank  # vLLM's ZmqEventPublisher.offset_endpoint_port
            replay_port = a.kv_events_replay_port + rank if a.kv_events_replay_port else 0
            replay = f"tcp://{a.host}:{replay_port}" if replay_port else None
            events = Publisher(
                f"tcp://{a.host}:{a.kv_events_port + rank}", a.block_size, a.kv_events_topic, lora_ids, replay
            )
        core = EngineCore(prof, engine_config(a), events.publish if events else None)
        engine = AsyncEngine(core)
        try:
            await serve(
                make_app(
                    engine, a.model, loras, a.max_loras, a.enable_force_include_usage, a.enable_fault_api
                ),
                engine,
                a.host,
                a.port,
            )
        finally:
            if events is not None:
                events.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

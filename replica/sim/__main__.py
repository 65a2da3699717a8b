"""``python -m replica.sim --port P``: a vLLM-compatible simulated replica (OpenAI API, vLLM metrics)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from .costmodel import profile
from .engine import Engine, EngineConfig
from .kv_events import Publisher
from .scheduler import SchedulerConfig
from .server import make_app, serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m replica.sim", description=__doc__)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument(
        "--profile", default="h100-llama-3.1-8b", help="cpu-test, or <gpu>-<model> e.g. a100-qwen3-32b"
    )
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply every step time (0.1 = 10x faster)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=0, help="KV blocks (0: derived from the profile)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--page-aligned-prefill", action="store_true", help="non-final prefill chunks are whole blocks"
    )
    p.add_argument(
        "--cache-aware-admission", action="store_true", help="longest cached prefix first, within --aging-s"
    )
    p.add_argument("--aging-s", type=float, default=2.0)
    p.add_argument(
        "--dedupe-shared-prefixes", action="store_true", help="defer requests waiting on an in-flight prefix"
    )
    p.add_argument(
        "--kv-events-port", type=int, default=0, help="publish vLLM KV events on tcp://HOST:PORT (0: off)"
    )
    p.add_argument("--lora-modules", nargs="*", default=[], help="adapter names served besides --model")
    a = p.parse_args(argv)
    cfg = EngineConfig(
        a.block_size,
        a.num_gpu_blocks,
        a.time_scale,
        SchedulerConfig(
            a.max_num_batched_tokens,
            a.max_num_seqs,
            a.page_aligned_prefill,
            a.cache_aware_admission,
            a.aging_s,
            a.dedupe_shared_prefixes,
        ),
    )

    async def run() -> None:
        events = Publisher(f"tcp://{a.host}:{a.kv_events_port}") if a.kv_events_port else None
        engine = Engine(profile(a.profile), cfg, events)
        await serve(make_app(engine, a.model, frozenset(a.lora_modules)), engine, a.host, a.port)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

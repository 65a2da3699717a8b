"""``python -m replica.vllm.pressure MODEL_DIR``: one real vLLM replica (our launcher) under KV
pressure, once per scheduler option set; prints hit rate and mean/p90 time to first token.

The workload: ``groups`` shared prefixes of ``prefix`` tokens, ``per_group`` requests each with
a ``tail``-token unique suffix, sent interleaved (A B C ... A B C ...) 10 ms apart, all
``max_tokens=1`` (so request latency is the time to first token). KV pressure comes from
``--num-gpu-blocks-override``: the pool holds about three prefixes, so FCFS evicts each prefix
before its next sibling comes round."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

CONFIGS: dict[str, dict[str, str]] = {
    "vllm (all off)": {},
    "page_aligned": {"KVPICK_PAGE_ALIGNED_PREFILL": "1"},
    "cache_aware": {"KVPICK_CACHE_AWARE_ADMISSION": "1"},
    "dedupe": {"KVPICK_DEDUPE_SHARED_PREFIXES": "1"},
    "all on": {
        "KVPICK_PAGE_ALIGNED_PREFILL": "1",
        "KVPICK_CACHE_AWARE_ADMISSION": "1",
        "KVPICK_DEDUPE_SHARED_PREFIXES": "1",
    },
}


@dataclass(frozen=True)
class Workload:
    groups: int = 8
    per_group: int = 6
    prefix: int = 384
    tail: int = 40
    seed: int = 0

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        heads = [[rng.randrange(2, 2000) for _ in range(self.prefix)] for _ in range(self.groups)]
        return [
            [*heads[g], *(rng.randrange(2, 2000) for _ in range(self.tail))]
            for _ in range(self.per_group)
            for g in range(self.groups)
        ]


def post(url: str, prompt: list[int]) -> tuple[float, int]:
    """(latency, cached tokens) of one ``max_tokens=1`` completion."""
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        doc = json.loads(resp.read())
    details = doc["usage"].get("prompt_tokens_details") or {}
    return time.perf_counter() - start, int(details.get("cached_tokens") or 0)


@contextlib.contextmanager
def replica(model: str, env: dict[str, str], port: int, blocks: int, log: str) -> Iterator[str]:
    """Our launcher on 127.0.0.1:port, killed (process group) on exit."""
    args = [sys.executable, "-m", "replica.vllm", "serve", model, "--kv-events-endpoint"]
    args += [f"ipc:///tmp/kvpick-pressure-{port}.sock", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--enforce-eager", "--block-size", "32", "--max-model-len", "1024", "--dtype", "float32"]
    args += [
        "--num-gpu-blocks-override",
        str(blocks),
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "512",
    ]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **env}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, f"replica not up, see {log}"
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def measure(url: str, prompts: list[list[int]]) -> dict[str, float]:
    post(url, [5] * 40)  # warm-up
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = []
        for prompt in prompts:
            futures.append(pool.submit(post, url, prompt))
            time.sleep(0.01)
        results = [f.result() for f in futures]
    lat = sorted(r[0] for r in results)
    return {
        "hit_rate": round(sum(r[1] for r in results) / sum(len(p) for p in prompts), 3),
        "ttft_mean_s": round(statistics.mean(lat), 3),
        "ttft_p90_s": round(lat[max(int(0.9 * len(lat)) - 1, 0)], 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m replica.vllm.pressure", description=__doc__)
    p.add_argument("model")
    p.add_argument("--port", type=int, default=18800)
    p.add_argument("--blocks", type=int, default=48, help="KV blocks of 32 tokens (the pressure)")
    p.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="run these configs only")
    a = p.parse_args(argv)
    prompts = Workload().prompts()
    for name in a.only or CONFIGS:
        log = f"/tmp/kvpick-pressure-{name.split()[0]}.log"
        with replica(a.model, CONFIGS[name], a.port, a.blocks, log) as url:
            print(json.dumps({"config": name, **measure(url, prompts)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m replica.vllm.pressure MODEL_DIR``: one real vLLM replica (our launcher) per
scheduler configuration, each measured ``--repeats`` times with the prefix cache reset between
runs; prints one JSON line per run (hit rate, TTFT p50/p90/p99, prompt tokens per second) and
then the median and spread of each figure per configuration.

Workloads (``--workload``), all ``max_tokens=1`` so a request's latency is its time to first
token, sent 2 ms apart (so they queue):

- ``pressure``: ``groups`` shared prefixes of ``prefix`` tokens, ``per_group`` requests each with
  a ``tail``-token unique suffix, interleaved (A B C ... A B C ...). The pool
  (``--num-gpu-blocks-override``) holds about three prefixes, so FCFS evicts each prefix before
  its next sibling comes round.
- ``shared70``: the prefix-aware seeds' shape: prefill-heavy, 70% of each prompt a prefix shared
  by its group (640 of 912 tokens), enough KV for every prefix.

``vllm`` is vLLM's own V1 ``Scheduler`` (``--scheduler-cls`` given to the launcher); every other
configuration is our plugin with the named options."""

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

PLAIN = ["--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler"]
CAP = ["--long-prefill-token-threshold", "128"]
CONFIGS: dict[str, tuple[dict[str, str], list[str]]] = {
    "vllm": ({}, PLAIN),
    "plugin, all off": ({}, []),
    "page_aligned": ({"KVPICK_PAGE_ALIGNED_PREFILL": "1"}, []),
    "cache_aware": ({"KVPICK_CACHE_AWARE_ADMISSION": "1"}, []),
    "page_aligned+cache_aware": (
        {"KVPICK_PAGE_ALIGNED_PREFILL": "1", "KVPICK_CACHE_AWARE_ADMISSION": "1"},
        [],
    ),
    "dedupe": ({"KVPICK_DEDUPE_SHARED_PREFIXES": "1"}, []),
    "vllm, cap 128": ({}, PLAIN + CAP),
    "dedupe, cap 128": ({"KVPICK_DEDUPE_SHARED_PREFIXES": "1"}, CAP),
}


@dataclass(frozen=True)
class Workload:
    """``groups`` × ``per_group`` prompts of a ``prefix`` shared per group and a unique ``tail``."""

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


WORKLOADS = {
    "pressure": (Workload(), 48),
    "shared70": (Workload(groups=4, per_group=12, prefix=640, tail=272), 400),
}
"""name -> (workload, KV blocks of 32 tokens)"""


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
def replica(
    model: str, env: dict[str, str], extra: Sequence[str], port: int, blocks: int, log: str
) -> Iterator[str]:
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
        *extra,
    ]
    full_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache between runs
        **env,
    }
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


def reset_prefix_cache(url: str) -> None:
    req = urllib.request.Request(url + "/reset_prefix_cache", b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200, f"prefix cache reset answered {resp.status}"


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[max(int(q * len(sorted_values) + 0.999999) - 1, 0)]


def measure(url: str, prompts: list[list[int]]) -> dict[str, float]:
    """One run from an empty prefix cache (after a warm-up request)."""
    post(url, [5] * 40)
    reset_prefix_cache(url)
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = []
        for prompt in prompts:
            futures.append(pool.submit(post, url, prompt))
            time.sleep(0.002)
        results = [f.result() for f in futures]
    wall = time.perf_counter() - start
    lat = sorted(r[0] for r in results)
    tokens = sum(len(p) for p in prompts)
    return {
        "hit_rate": round(sum(r[1] for r in results) / tokens, 3),
        "ttft_p50_s": round(nearest_rank(lat, 0.5), 3),
        "ttft_p90_s": round(nearest_rank(lat, 0.9), 3),
        "ttft_p99_s": round(nearest_rank(lat, 0.99), 3),
        "prompt_tokens_per_s": round(tokens / wall, 1),
    }


def summarize(runs: list[dict[str, float]]) -> dict[str, str]:
    """``median [min, max]`` of each figure over the runs."""
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = f"{statistics.median(values):g} [{min(values):g}, {max(values):g}]"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m replica.vllm.pressure", description=__doc__)
    p.add_argument("model")
    p.add_argument("--port", type=int, default=18800)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="pressure")
    p.add_argument("--blocks", type=int, default=0, help="KV blocks of 32 tokens (0: the workload's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="run these configs only")
    a = p.parse_args(argv)
    workload, blocks = WORKLOADS[a.workload]
    prompts = workload.prompts()
    summary = {}
    for name in a.only or CONFIGS:
        env, extra = CONFIGS[name]
        log = f"/tmp/kvpick-pressure-{name.replace(' ', '').replace(',', '_')}.log"
        with replica(a.model, env, extra, a.port, a.blocks or blocks, log) as url:
            runs = []
            for i in range(a.repeats):
                runs.append(measure(url, prompts))
                print(json.dumps({"config": name, "run": i, **runs[-1]}), flush=True)
        summary[name] = summarize(runs)
    for name, figures in summary.items():
        print(json.dumps({"config": name, "workload": a.workload, "median [min, max]": figures}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

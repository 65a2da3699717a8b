"""``python -m bench.vllm_pressure MODEL_DIR``: the scheduler configurations measured side by
side on one real vLLM replica (our launcher, the tiny model), interleaved: round ``i`` runs every
configuration once, starting one further along the list, ``--repeats`` rounds. Each run starts
from an empty prefix cache, after a pause that lets the engine's worker leave its busy-wait.
Prints one JSON line per run (hit rate, TTFT p50/p90/p99, prompt tokens per second, and what
the schedule did, read from the engine's schedule trace), then each figure's median and spread
per configuration.

The replica runs ``bench.vllm_trace.BenchScheduler`` (our scheduler, traced, options switched
between runs), so every configuration runs in the same engine process with the same CPU
placement. ``vllm`` is every option off, which is vLLM's V1 scheduler step for step
(``tests/vllm/test_prefix_aware_scheduler.py::test_all_options_off_equals_vllm``).

The engine's compute is bound to the first usable core (``replica.vllm.tiny.cpu_binding(0)``);
the API server and this client share the rest. vLLM's ``auto`` binding picks the same core on
this 2-core host (and reserves the other); it is named here so the figures do not depend on it.

Workloads (``--workload``), all ``max_tokens=1`` so a request's latency is its time to first
token, sent 2 ms apart (so they queue):

- ``pressure``: ``groups`` shared prefixes of ``prefix`` tokens, ``per_group`` requests each with
  a ``tail``-token unique suffix, interleaved (A B C ... A B C ...). The pool
  (``--num-gpu-blocks-override``) holds about three prefixes, so FCFS evicts each prefix before
  its next sibling comes round.
- ``shared70``: the prefix-aware seeds' shape: prefill-heavy, 70% of each prompt a prefix shared
  by its group (640 of 912 tokens), enough KV for every prefix."""

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

from replica.vllm.tiny import ENV, cpu_binding

CONFIGS: dict[str, dict[str, object]] = {
    "vllm": {},
    "cache_aware": {"cache_aware_admission": True},
    "vllm, cap 128": {"long_prefill_token_threshold": 128},
}
"""name -> ``bench.vllm_trace.BenchScheduler`` options (the rest off)"""
OPTION_FIELDS = ("cache_aware_admission",)


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


def prompt_key(tokens: Sequence[int]) -> str:
    """A short name for a prompt, the same here and in the engine's schedule trace
    (``bench.vllm_trace``; int tuples hash the same in every process)."""
    return format(hash(tuple(tokens)) & 0xFFFFFFFFFFFF, "x")


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
def replica(model: str, port: int, blocks: int, workdir: str) -> Iterator[str]:
    """Our launcher with ``BenchScheduler`` on 127.0.0.1:port, its log, trace and options file
    in ``workdir``; killed (process group) on exit."""
    log = os.path.join(workdir, "replica.log")
    args = [sys.executable, "-m", "replica.vllm", "serve", model, "--kv-events-endpoint"]
    args += [f"ipc:///tmp/kvpick-pressure-{port}.sock", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--enforce-eager", "--block-size", "32", "--max-model-len", "1024", "--dtype", "float32"]
    args += ["--num-gpu-blocks-override", str(blocks), "--max-num-seqs", "4"]
    args += ["--max-num-batched-tokens", "512", "--scheduler-cls", "bench.vllm_trace.BenchScheduler"]
    set_options(workdir, {})
    env = {
        **os.environ,
        **ENV,  # offline, 1 GiB of KV, POST /reset_prefix_cache between runs
        **cpu_binding(0),
        "KVPICK_SCHEDULE_TRACE": os.path.join(workdir, "schedule.jsonl"),
        "KVPICK_BENCH_OPTIONS": os.path.join(workdir, "options.json"),
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not _healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, f"replica not up, see {log}"
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


def set_options(workdir: str, options: dict[str, object]) -> None:
    """Write the options ``BenchScheduler`` applies at its next step (every field given)."""
    full: dict[str, object] = {field: bool(options.get(field, False)) for field in OPTION_FIELDS}
    full["long_prefill_token_threshold"] = options.get("long_prefill_token_threshold", 0)
    path = os.path.join(workdir, "options.json")
    with open(path + ".tmp", "w") as f:
        json.dump(full, f)
    os.replace(path + ".tmp", path)


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


def measure(url: str, prompts: list[list[int]]) -> tuple[dict[str, float], tuple[float, float]]:
    """One run from an empty prefix cache (after a warm-up request): its figures, and its
    window on the engine's clock (for the schedule trace)."""
    time.sleep(1.5)  # vLLM's worker busy-waits for 1 s after its last step
    post(url, [5] * 40)
    reset_prefix_cache(url)
    window_start = time.time()
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
    figures = {
        "hit_rate": round(sum(r[1] for r in results) / tokens, 3),
        "ttft_p50_s": round(nearest_rank(lat, 0.5), 3),
        "ttft_p90_s": round(nearest_rank(lat, 0.9), 3),
        "ttft_p99_s": round(nearest_rank(lat, 0.99), 3),
        "prompt_tokens_per_s": round(tokens / wall, 1),
    }
    return figures, (window_start, time.time())


@dataclass
class Scheduled:
    """One request's life in the engine, from the schedule trace."""

    index: int
    arrival: float = 0.0
    first: float = 0.0
    done: float = 0.0
    cached: int = 0
    computed: int = 0
    chunks: int = 0


def read_schedule(
    trace: str, window: tuple[float, float], prompts: list[list[int]]
) -> tuple[list[Scheduled], list[dict[str, object]]]:
    """The requests of one run (prompt order) and the steps of the trace inside ``window``."""
    index = {prompt_key(p): i for i, p in enumerate(prompts)}
    assert len(index) == len(prompts), "two prompts share a trace key"
    out = [Scheduled(i) for i in range(len(prompts))]
    steps = []
    with open(trace) as f:
        for line in f:
            step = json.loads(line)
            if not window[0] <= step["t"] <= window[1]:
                continue
            steps.append(step)
            for key, arrival in step["new"].items():
                if key in index:
                    out[index[key]].arrival = arrival
            for key, before, scheduled, cached in step["run"]:
                if key not in index:
                    continue
                r = out[index[key]]
                if not r.chunks:
                    r.first, r.cached = step["t"], cached
                r.chunks += 1
                r.computed += scheduled
                if before + scheduled >= len(prompts[r.index]):
                    r.done = step["t"]
    missing = [r.index for r in out if not r.done]
    assert not missing, f"requests {missing} never finished their prefill in the trace {trace}"
    return out, steps


def schedule_figures(
    requests: list[Scheduled], steps: list[dict[str, object]], groups: int
) -> dict[str, object]:
    """What the schedule did: prompt tokens computed, steps, engine-side queue wait and time to
    the end of prefill (p50/p90), and the order in which requests were admitted (``A3`` = the
    third request of group A, prompts being interleaved by group)."""
    waits = sorted(r.first - r.arrival for r in requests)
    ttft = sorted(r.done - r.arrival for r in requests)
    order = sorted(requests, key=lambda r: (r.first, r.index))
    return {
        "computed_tokens": sum(r.computed for r in requests),
        "steps": len(steps),
        "queue_wait_p50_s": round(nearest_rank(waits, 0.5), 3),
        "queue_wait_p90_s": round(nearest_rank(waits, 0.9), 3),
        "engine_ttft_p50_s": round(nearest_rank(ttft, 0.5), 3),
        "engine_ttft_p90_s": round(nearest_rank(ttft, 0.9), 3),
        "order": " ".join(f"{chr(65 + r.index % groups)}{r.index // groups + 1}:{r.cached}" for r in order),
    }


def summarize(runs: list[dict[str, float]]) -> dict[str, str]:
    """``median [min, max]`` of each figure over the runs."""
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = f"{statistics.median(values):g} [{min(values):g}, {max(values):g}]"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_pressure", description=__doc__)
    p.add_argument("model")
    p.add_argument("--port", type=int, default=18800)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="pressure")
    p.add_argument("--blocks", type=int, default=0, help="KV blocks of 32 tokens (0: the workload's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="run these configs only")
    p.add_argument("--workdir", default="/tmp/kvpick-pressure", help="the replica's log, trace, options")
    a = p.parse_args(argv)
    workload, blocks = WORKLOADS[a.workload]
    prompts = workload.prompts()
    names = list(a.only or CONFIGS)
    os.makedirs(a.workdir, exist_ok=True)
    trace = os.path.join(a.workdir, "schedule.jsonl")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with replica(a.model, a.port, a.blocks or blocks, a.workdir) as url:
        for i in range(a.repeats):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                set_options(a.workdir, CONFIGS[name])
                figures, window = measure(url, prompts)
                runs[name].append(figures)
                time.sleep(0.2)  # the last step's trace line
                requests, steps = read_schedule(trace, window, prompts)
                schedule = schedule_figures(requests, steps, workload.groups)
                print(json.dumps({"config": name, "run": i, **figures, "schedule": schedule}), flush=True)
    for name in names:
        print(
            json.dumps({"config": name, "workload": a.workload, "median [min, max]": summarize(runs[name])}),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

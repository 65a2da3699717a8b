"""Runners: routers side by side on one fleet, capacity calibration, and router overhead.

Side by side: for each router, start it, reset every replica's prefix cache, send the same
workload with the same arrival times, stop it. Hit rate comes from ``usage`` and is
cross-checked against the replicas' ``vllm:prefix_cache_hits_total / queries_total`` deltas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

from . import loadgen, stats
from .fleet import Fleet
from .routers import router
from .workloads import Workload, no_sharing


@dataclass
class RouterRun:
    router: str
    summary: stats.Summary
    server_hit_rate: float
    """From the replicas' prefix-cache counters over the run (queries include retries of none)."""
    ttfts: list[float]


def run_one(
    name: str, fleet: Fleet, w: Workload, cfg: loadgen.LoadConfig, run_dir: pathlib.Path
) -> RouterRun:
    with router(name, fleet, run_dir) as urls:
        fleet.reset()
        before = fleet.counters()
        outcomes, wall = asyncio.run(loadgen.run(urls, w, dataclasses.replace(cfg, label=f"{w.name}/{name}")))
        after = fleet.counters()
    q = after.queries - before.queries
    server_hit = (after.hits - before.hits) / q if q else 0.0
    return RouterRun(
        name, stats.summarize(outcomes, wall), server_hit, sorted(o.ttft for o in outcomes if o.ok)
    )


def compare(
    fleet: Fleet, w: Workload, routers: list[str], cfg: loadgen.LoadConfig, run_dir: pathlib.Path
) -> list[RouterRun]:
    return [run_one(name, fleet, w, cfg, run_dir) for name in routers]


def calibrate(
    fleet: Fleet,
    w: Workload,
    concurrency: int,
    max_requests: int,
    run_dir: pathlib.Path,
    progress: bool = True,
) -> float:
    """Capacity in requests/s: closed-loop throughput at ``concurrency``, replicas round-robined by
    the client (no router), on the first ``max_requests`` independent requests of ``w``."""
    head = tuple(dataclasses.replace(r, after=None) for r in w.requests[:max_requests])
    cfg = loadgen.LoadConfig(mode="closed", concurrency=concurrency, model=fleet.cfg.model, progress=progress)
    run = run_one("direct", fleet, Workload(f"{w.name}-calibration", head), cfg, run_dir)
    assert run.summary.errors == 0, f"calibration of {w.name} had {run.summary.errors} errors"
    return run.summary.throughput_rps


def overhead_workload(n: int, prompt_tokens: int = 256, output_tokens: int = 8) -> Workload:
    return no_sharing(n, prompt_tokens, output_tokens, seed=7, name="overhead")


def overhead(
    fleet: Fleet, paths: Sequence[str], n: int, rate: float, run_dir: pathlib.Path, progress: bool = True
) -> dict[str, object]:
    """Short requests (256 tokens in, 8 out) at a fixed Poisson ``rate``, straight to the replicas
    (client round-robin) and through each router in ``paths``; added latency = router's TTFT
    percentile minus the direct one."""
    w = overhead_workload(n)
    cfg = loadgen.LoadConfig(mode="poisson", rate=rate, model=fleet.cfg.model, progress=progress)
    runs = [run_one(p, fleet, w, cfg, run_dir) for p in ["direct", *paths]]
    base = runs[0].summary
    out: dict[str, dict[str, float | int]] = {}
    for r in runs:
        s = r.summary
        out[r.router] = {
            "ttft_p50": s.ttft_p50,
            "ttft_p99": s.ttft_p99,
            "added_p50": s.ttft_p50 - base.ttft_p50,
            "added_p99": s.ttft_p99 - base.ttft_p99,
            "errors": s.errors,
        }
    describe = f"{n} requests of 256 prompt tokens → 8 output tokens, Poisson {rate:g} req/s, TTFT measured at the client"
    return {"describe": describe, "paths": out}

"""Runners: capacity calibration, routers side by side on one fleet, and router overhead.

Side by side: each router is started once in front of the fleet and serves every workload in
turn; before each workload every replica's prefix cache is reset, and the workload is sent with
the same arrival times as for every other router. Workloads share no text, so what a router
remembers from an earlier workload cannot turn into a hit. Hit rate comes from ``usage`` and is
cross-checked against the replicas' ``vllm:prefix_cache_hits_total / queries_total`` deltas.

Overhead: short requests at a fixed Poisson rate straight to the replicas (client round-robin)
and through each router; added latency = the router's TTFT percentile minus the direct one.
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
    """Σ hits / Σ queries from the replicas' prefix-cache counters over the run."""
    ttfts: list[float]


@dataclass
class Job:
    """One workload with the load it is sent at; ``runs`` fills as routers serve it."""

    workload: Workload
    load: loadgen.LoadConfig
    routers: frozenset[str] | None = None
    """Routers that serve this job (None: all)."""
    runs: list[RouterRun] = dataclasses.field(default_factory=list)


def measure(name: str, urls: list[str], fleet: Fleet, w: Workload, cfg: loadgen.LoadConfig) -> RouterRun:
    fleet.reset()
    before = fleet.counters()
    outcomes, wall = asyncio.run(loadgen.run(urls, w, dataclasses.replace(cfg, label=f"{w.name}/{name}")))
    after = fleet.counters()
    q = after.queries - before.queries
    server_hit = (after.hits - before.hits) / q if q else 0.0
    ttfts = sorted(o.ttft for o in outcomes if o.ok)
    return RouterRun(name, stats.summarize(outcomes, wall), server_hit, ttfts)


def side_by_side(
    fleet: Fleet,
    routers: Sequence[str],
    jobs: Sequence[Job],
    run_dir: pathlib.Path,
    picker_config: str | None = None,
    log: bool = True,
) -> None:
    """Every router (``direct`` included, if named) serves every job that wants it, in order."""
    for name in routers:
        wanted = [j for j in jobs if j.routers is None or name in j.routers]
        if not wanted:
            continue
        with router(name, fleet, run_dir, picker_config) as urls:
            for job in wanted:
                run = measure(name, urls, fleet, job.workload, job.load)
                job.runs.append(run)
                if log:
                    s = run.summary
                    print(
                        f"[bench] {job.workload.name:<24} {name:<14} hit {s.hit_rate:.3f}  TTFT p50 "
                        f"{s.ttft_p50:.3f} p90 {s.ttft_p90:.3f}  {s.throughput_rps:.2f} req/s  errors {s.errors}",
                        flush=True,
                    )


def calibrate(
    fleet: Fleet,
    w: Workload,
    concurrency: int,
    max_requests: int,
    run_dir: pathlib.Path,
    progress: bool = True,
) -> float:
    """Capacity in requests/s: closed-loop throughput at ``concurrency``, replicas round-robined by
    the client (no router), on the first ``max_requests`` requests of ``w`` (sent independently)."""
    head = tuple(dataclasses.replace(r, after=None) for r in w.requests[:max_requests])
    cfg = loadgen.LoadConfig(mode="closed", concurrency=concurrency, model=fleet.cfg.model, progress=progress)
    run = measure("direct", fleet.urls, fleet, Workload(f"{w.name}-calibration", head), cfg)
    assert run.summary.errors == 0, f"calibration of {w.name} had {run.summary.errors} errors"
    return run.summary.throughput_rps


def overhead_job(
    n: int, rate: float, output_tokens: int, model: str, paths: Sequence[str], progress: bool = True
) -> Job:
    """256 prompt tokens → ``output_tokens`` streamed, at Poisson ``rate``, for ``direct`` and ``paths``.
    Every streamed chunk crosses the router, so long outputs measure the router under streaming load."""
    w = no_sharing(n, 256, output_tokens, seed=7, name=f"overhead-{output_tokens}")
    cfg = loadgen.LoadConfig(mode="poisson", rate=rate, model=model, progress=progress)
    return Job(w, cfg, frozenset(["direct", *paths]))


def overhead_table(job: Job) -> dict[str, object]:
    base = next(r.summary for r in job.runs if r.router == "direct")
    paths: dict[str, dict[str, float | int]] = {}
    for r in job.runs:
        s = r.summary
        paths[r.router] = {
            "ttft_p50": s.ttft_p50,
            "ttft_p99": s.ttft_p99,
            "added_p50": s.ttft_p50 - base.ttft_p50,
            "added_p99": s.ttft_p99 - base.ttft_p99,
            "errors": s.errors,
        }
    n, rate, out = len(job.workload.requests), job.load.rate, job.workload.requests[0].max_tokens
    describe = f"{n} requests, 256 prompt → {out} output tokens (streamed), Poisson {rate:g} req/s"
    return {"describe": describe, "paths": paths}

"""``python -m bench --suite quick|full``: routers side by side on simulated replicas.

    python -m bench --suite quick                     # make bench (< 10 minutes here)
    python -m bench --suite full --trace FILE         # issue defaults, longer trace slice

One fleet of ``replica.sim`` replicas (H100 + Llama-3.1-8B profile) serves every run. For each
workload: compute its hit-rate ceilings, calibrate capacity (closed loop, client round-robin),
then run each router at ``load_fraction`` of it, resetting the replicas' caches in between;
then measure router overhead. Writes ``results.json``, ``results.md`` and PNG plots to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time
from typing import Any

from replica.sim.stack import Children

from . import ideal, report, runner, suites, targets
from .fleet import Fleet, FleetConfig
from .loadgen import LoadConfig
from .workloads import Workload


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--suite", choices=sorted(suites.SUITES), default="quick")
    p.add_argument("--trace", default=str(suites.DEFAULT_TRACE), help="Mooncake-format trace (JSONL)")
    p.add_argument("--out", default=str(suites.ROOT / "bench" / "results"))
    p.add_argument("--run-dir", default=str(suites.ROOT / ".run" / "bench"), help="logs of every process")
    p.add_argument("--routers", default=None, help="comma-separated subset of the suite's routers")
    p.add_argument(
        "--workloads",
        default=None,
        help="comma-separated subset of the suite's workloads ('none': only the overhead runner)",
    )
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--no-overhead", action="store_true", help="skip the router-overhead runner")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def load_for(w: Workload, rate: float, turns: int, progress: bool) -> tuple[LoadConfig, str]:
    if w.name == "mooncake":
        times = [r.at or 0.0 for r in w.requests]
        span = max(times) - min(times)
        scale = len(times) / (span * rate) if span > 0 else 1.0
        return LoadConfig("trace", time_scale=scale, progress=progress), f"trace timestamps × {scale:.3f}"
    if w.name == "multi-turn":
        return LoadConfig(
            "poisson", rate=rate / turns, progress=progress
        ), f"sessions start Poisson {rate / turns:.2f}/s"
    return LoadConfig("poisson", rate=rate, progress=progress), f"Poisson {rate:.2f} req/s"


def run_workload(
    s: suites.Suite, fleet: Fleet, w: Workload, shape: tuple[int, int], a: argparse.Namespace
) -> report.WorkloadResult:
    block_size, capacity = shape
    ceil, lru = ideal.ceilings(w, block_size, capacity)
    conc = s.calib_per_replica * s.replicas
    run_dir = pathlib.Path(a.run_dir)
    cap = runner.calibrate(fleet, w, conc, 2 * conc, run_dir, progress=not a.no_progress)
    rate = s.load_fraction * cap
    cfg, how = load_for(w, rate, s.multi_turn[1], not a.no_progress)
    describe = f"{how} ≈ {s.load_fraction:.0%} of capacity {cap:.2f} req/s (closed loop, {s.calib_per_replica} per replica)"
    print(f"[bench] {w.name}: {len(w.requests)} requests, ideal {ceil:.3f}, {describe}", flush=True)
    res = report.WorkloadResult(
        w.name,
        ceil,
        lru,
        len(w.requests),
        {"capacity_rps": round(cap, 3), "rate_rps": round(rate, 3), "describe": describe},
    )
    for name in s.routers:
        run = runner.run_one(name, fleet, w, cfg, run_dir)
        sm = run.summary
        print(
            f"[bench]   {name:<14} hit {sm.hit_rate:.3f}  TTFT p50 {sm.ttft_p50:.3f} p90 {sm.ttft_p90:.3f}  {sm.throughput_rps:.2f} req/s  errors {sm.errors}",
            flush=True,
        )
        res.runs.append(run)
    return res


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    s = suites.SUITES[a.suite]
    if a.routers:
        s = dataclasses.replace(s, routers=tuple(a.routers.split(",")))
    if a.workloads:
        s = dataclasses.replace(s, workloads=tuple(w for w in a.workloads.split(",") if w != "none"))
    if a.replicas:
        s = dataclasses.replace(s, replicas=a.replicas)
    run_dir, out = pathlib.Path(a.run_dir), pathlib.Path(a.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    children = Children(run_dir)
    fleet = Fleet(FleetConfig(s.replicas, s.profile, s.time_scale), children)
    results: list[report.WorkloadResult] = []
    notes: list[str] = []
    overhead: dict[str, Any] | None = None
    try:
        fleet.start()
        shape = fleet.cache_shape()
        for name in s.workloads:
            trace = pathlib.Path(a.trace)
            if name == "mooncake" and not trace.exists():
                notes.append(f"mooncake skipped: no trace at {trace}")
                print(f"[bench] {notes[-1]}", file=sys.stderr)
                continue
            results.append(run_workload(s, fleet, suites.build(s, name, trace), shape, a))
        if not a.no_overhead:
            paths = [p for p in ("cost", "vllm-router", "sglang-router") if p in s.routers]
            overhead = runner.overhead(fleet, paths, *s.overhead, run_dir, progress=not a.no_progress)
    finally:
        children.stop()
    meta = {
        "suite": s.name,
        "replicas": f"{s.replicas} × `python -m replica.sim --profile {s.profile} --time-scale {s.time_scale:g}`",
        "cache": f"block size {shape[0]} tokens, {shape[1]} blocks over all replicas",
        "wall time": f"{time.monotonic() - t0:.0f} s",
        "command": f"python -m bench {' '.join(argv if argv is not None else sys.argv[1:])}".strip(),
        **({"notes": "; ".join(notes)} if notes else {}),
    }
    checks = targets.checks(results)
    md = report.markdown(results, overhead, meta) + targets.markdown(checks)
    doc = {
        "meta": meta,
        "workloads": {w.name: w.as_dict() for w in results},
        "overhead": overhead,
        "targets": [dataclasses.asdict(c) for c in checks],
    }
    report.write_json(out / "results.json", doc)
    (out / "results.md").write_text(md)
    pngs = report.plots(results, out) if results else []
    print(md)
    print(f"[bench] wrote {out / 'results.json'}, {out / 'results.md'}, " + ", ".join(str(p) for p in pngs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

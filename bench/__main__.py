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

from kvlaunch import Procs

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
    p.add_argument(
        "--picker-config",
        default=None,
        help="picker --config-file (e.g. to define extra policies to compare)",
    )
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
        sessions = len(w.requests) // turns
        how = (
            f"{sessions} sessions starting Poisson {rate / turns:.2f}/s, each turn sent when the previous "
            "one ends (so the offered load is bounded by the sessions)"
        )
        return LoadConfig("poisson", rate=rate / turns, progress=progress), how
    return LoadConfig("poisson", rate=rate, progress=progress), f"Poisson {rate:.2f} req/s"


def prepare(
    s: suites.Suite, fleet: Fleet, w: Workload, shape: tuple[int, int], a: argparse.Namespace
) -> tuple[report.WorkloadResult, runner.Job]:
    """Ceilings and calibrated load for ``w``; the job is then served by every router."""
    block_size, capacity = shape
    ceil, lru = ideal.ceilings(w, block_size, capacity)
    conc = s.calib_per_replica * s.replicas
    cap = runner.calibrate(
        fleet, w, conc, min(2 * conc, s.calib_max), pathlib.Path(a.run_dir), not a.no_progress
    )
    rate = s.load_fraction * cap
    cfg, how = load_for(w, rate, s.multi_turn[1], not a.no_progress)
    cfg = dataclasses.replace(cfg, model=fleet.cfg.model)
    describe = (
        f"{how}, for {s.load_fraction:.0%} of capacity {cap:.2f} req/s "
        f"(closed loop, {s.calib_per_replica} in flight per replica, no router)"
    )
    print(f"[bench] {w.name}: {len(w.requests)} requests, ideal hit rate {ceil:.3f}, {describe}", flush=True)
    load = {"capacity_rps": round(cap, 3), "rate_rps": round(rate, 3), "describe": describe}
    res = report.WorkloadResult(w.name, ceil, lru, len(w.requests), load)
    return res, runner.Job(w, cfg, frozenset(s.routers))


def execute(
    s: suites.Suite, a: argparse.Namespace, fleet: Fleet, notes: list[str]
) -> tuple[list[report.WorkloadResult], list[dict[str, Any]], tuple[int, int]]:
    fleet.start()
    shape = fleet.cache_shape()
    prepared: list[tuple[report.WorkloadResult, runner.Job]] = []
    for name in s.workloads:
        trace = pathlib.Path(a.trace)
        if name == "mooncake" and not trace.exists():
            notes.append(f"mooncake skipped: no trace at {trace}")
            print(f"[bench] {notes[-1]}", file=sys.stderr)
            continue
        prepared.append(prepare(s, fleet, suites.build(s, name, trace), shape, a))
    jobs = [j for _, j in prepared]
    over: list[runner.Job] = []
    if not a.no_overhead:
        paths = [p for p in ("cost", "vllm-router", "sglang-router") if p in s.routers]
        over = [runner.overhead_job(*o, fleet.cfg.model, paths, not a.no_progress) for o in s.overhead]
        jobs += over
    runner.side_by_side(fleet, ["direct", *s.routers], jobs, pathlib.Path(a.run_dir), a.picker_config)
    for res, job in prepared:
        res.runs = job.runs
    return [r for r, _ in prepared], [runner.overhead_table(j) for j in over], shape


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
    children = Procs(run_dir)
    fleet = Fleet(FleetConfig(s.replicas, s.profile, s.time_scale), children)
    notes: list[str] = []
    try:
        results, overhead, shape = execute(s, a, fleet, notes)
    finally:
        children.stop()
    meta = {
        "suite": s.name,
        "replicas": f"{s.replicas} × `python -m replica.sim --profile {s.profile} --time-scale {s.time_scale:g}`",
        "cache": f"block size {shape[0]} tokens, {shape[1]} blocks over all replicas",
        "latencies": "seconds of wall time on this machine, one run per router (expect run-to-run noise)",
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

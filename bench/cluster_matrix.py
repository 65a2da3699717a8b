"""``python -m bench.cluster_matrix``: many cluster-mode runs at once, over source trees and
seeds, on every core of a machine (the offline GPU node's 16: docs/benchmarks.md#on-the-offline-gpu-node).

    python -m bench.cluster_matrix --jobs JOBS [--trees name=DIR,...] [--procs N] [--budget S] --out OUT

Cluster mode runs in simulated time and is deterministic per seed, so its figures do not depend
on the machine or on what runs beside it: a 16-core machine runs the landing rule's matrix
(six hardware rows × five seeds, the shared-prefix shapes, the K-copy traces) for several trees
in the time one 2-core machine runs a few rows.

``JOBS`` has one job per line, ``NAME TREE ARGS...`` (blank lines and ``#`` comments skipped):
``NAME`` names the job's files (``OUT/NAME.json`` from ``bench.cluster --json``, ``OUT/NAME.log``),
``TREE`` is a name from ``--trees`` (``.`` is the checkout this module runs from), ``ARGS`` are
``bench.cluster``'s arguments (or ``-m MODULE ARGS``: another bench that takes ``--json``,
e.g. ``bench.flow``). A ``{trace:N}`` in ``ARGS`` names ``OUT/traces/`` (made by a
``@trace N ARGS...`` line before the jobs: ``bench.mktrace ARGS -o OUT/traces/N``, run once with
this checkout), and ``{root}`` this checkout's root, so that a job of any tree can read the
checkout's files (``--trace {root}/bench/data/mooncake_synthetic_trace.jsonl``). ``python -m
bench.hardware --jobs`` writes the hardware table's rows as jobs.

Jobs start in file order, at most ``--procs`` at a time (default: every CPU), each as its own
``python -m bench.cluster`` with ``TREE`` first on ``PYTHONPATH``. At ``--budget`` seconds from
the start nothing new starts and what still runs is killed; ``OUT/matrix.json`` lists every job
with its exit status, wall and CPU seconds (``os.wait4``), or ``not started`` / ``killed``. Its
summary rows (``OUT/matrix.md``) read each job's JSON: policy, prefix mode, hit rate, its share
of the LRU ceiling, TTFT p50/p90/p99.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRACE = re.compile(r"\{trace:([^}]+)\}")


@dataclass
class Job:
    """One ``bench.cluster`` run: ``status`` is ``pending``, ``running``, ``done`` (``rc`` set),
    ``killed`` (the budget ran out) or ``not started``."""

    name: str
    tree: str
    args: list[str]
    status: str = "pending"
    rc: int | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0
    started_s: float = 0.0
    results: Any = None
    """The job's ``--json`` file as read back (``bench.cluster``'s: a list of result dicts)."""


def parse(text: str, out: pathlib.Path) -> tuple[list[list[str]], list[Job]]:
    """The ``@trace`` lines and the jobs of a ``JOBS`` file, ``{trace:N}`` resolved under ``out``."""
    traces: list[list[str]] = []
    jobs: list[Job] = []
    names: set[str] = set()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = shlex.split(line)
        words = [
            TRACE.sub(lambda m: str(out / "traces" / m[1]), w).replace("{root}", str(ROOT)) for w in words
        ]
        if words[0] == "@trace":
            if len(words) < 3:
                raise SystemExit(f"jobs line {n}: @trace NAME ARGS...")
            traces.append(words[1:])
            continue
        if len(words) < 2:
            raise SystemExit(f"jobs line {n}: NAME TREE ARGS...")
        if words[0] in names:
            raise SystemExit(f"jobs line {n}: job name {words[0]!r} twice")
        names.add(words[0])
        jobs.append(Job(words[0], words[1], words[2:]))
    return traces, jobs


def make_traces(traces: list[list[str]], out: pathlib.Path) -> None:
    (out / "traces").mkdir(parents=True, exist_ok=True)
    for name, *args in traces:
        cmd = [sys.executable, "-m", "bench.mktrace", *args, "-o", str(out / "traces" / name)]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def run(
    jobs: list[Job], trees: dict[str, pathlib.Path], out: pathlib.Path, procs: int, budget: float
) -> None:
    """Run ``jobs``, at most ``procs`` at once, none past ``budget`` seconds from now."""
    t0 = time.monotonic()
    queue = list(jobs)
    running: dict[int, tuple[Job, subprocess.Popen[bytes], Any]] = {}
    while queue or running:
        now = time.monotonic() - t0
        while queue and len(running) < procs and now < budget:
            job = queue.pop(0)
            env = dict(os.environ, PYTHONPATH=str(trees[job.tree]))
            log = open(out / f"{job.name}.log", "wb")  # noqa: SIM115 (closed when the job ends)
            module, args = (
                (job.args[1], job.args[2:]) if job.args[:1] == ["-m"] else ("bench.cluster", job.args)
            )
            cmd = [sys.executable, "-m", module, *args, "--json", str(out / f"{job.name}.json")]
            log.write((shlex.join(cmd) + "\n").encode())
            log.flush()
            p = subprocess.Popen(cmd, cwd=trees[job.tree], env=env, stdout=log, stderr=subprocess.STDOUT)
            job.status, job.started_s = "running", now
            running[p.pid] = (job, p, log)
        if not running:
            break
        left = budget - (time.monotonic() - t0)
        if left <= 0:
            for job, p, log in running.values():
                p.send_signal(signal.SIGKILL)
                p.wait()
                job.status, job.wall_s = "killed", time.monotonic() - t0 - job.started_s
                log.close()
            running.clear()
            break
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.2)
            continue
        job, p, log = running.pop(pid)
        p.returncode = os.waitstatus_to_exitcode(status)
        log.close()
        job.status, job.rc = "done", p.returncode
        job.wall_s = time.monotonic() - t0 - job.started_s
        job.cpu_s = usage.ru_utime + usage.ru_stime
        path = out / f"{job.name}.json"
        if job.rc == 0 and path.exists():
            job.results = json.loads(path.read_text())
        print(f"[{time.monotonic() - t0:6.0f}s] {job.name}: rc {job.rc}, {job.wall_s:.0f} s", flush=True)
    for job in queue:
        job.status = "not started"


def _f(v: Any, fmt: str = ".4f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else ""


def table(jobs: list[Job]) -> str:
    """One row per result of each job (a job may run several policies)."""
    rows = [
        "| job | status | policy | mode | hit rate | hit / LRU | TTFT p50 s | p90 s | p99 s "
        "| computed tok/s | holders p50 / p99 | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for job in jobs:
        results = job.results if isinstance(job.results, list) else None
        for r in results or [{}]:
            lru, hit = r.get("lru_hit_rate") or 0.0, r.get("hit_rate")
            rows.append(
                f"| {job.name} | {job.status}{'' if job.rc in (0, None) else f' rc {job.rc}'} "
                f"| {r.get('policy', '')} | {r.get('prefix_mode', '')} | {_f(hit)} "
                f"| {_f(hit / lru, '.3f') if hit is not None and lru else ''} | {_f(r.get('ttft_p50'))} "
                f"| {_f(r.get('ttft_p90'))} | {_f(r.get('ttft_p99'))} | {_f(r.get('computed_tokens_per_s'), '.0f')} "
                f"| {r.get('holders_p50', '')} / {r.get('holders_p99', '')} | {job.wall_s:.0f} |"
            )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cluster_matrix", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", required=True, help="the jobs file (see the module docstring)")
    p.add_argument("--trees", default="", help="name=DIR,... (each a source tree; '.' is this checkout)")
    p.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--budget", type=float, default=540.0, help="seconds: nothing starts after, the rest is killed"
    )
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    out = pathlib.Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    trees = {".": ROOT}
    for item in filter(None, a.trees.split(",")):
        name, _, path = item.partition("=")
        trees[name] = pathlib.Path(path).resolve()
    traces, jobs = parse(pathlib.Path(a.jobs).read_text(), out)
    unknown = sorted({j.tree for j in jobs} - trees.keys())
    if unknown:
        raise SystemExit(f"unknown trees {unknown}: name them in --trees")
    t0 = time.monotonic()
    make_traces(traces, out)
    run(jobs, trees, out, a.procs, a.budget - (time.monotonic() - t0))
    (out / "matrix.json").write_text(json.dumps([asdict(j) for j in jobs], indent=1))
    (out / "matrix.md").write_text(table(jobs))
    print(table(jobs))


if __name__ == "__main__":
    main()

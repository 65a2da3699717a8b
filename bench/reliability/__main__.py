"""``python -m bench.reliability {fuzz,faults,soak,all}``: the long variants of tests/reliability.

    python -m bench.reliability fuzz --cases 100000      # ~10 min here
    python -m bench.reliability faults --repeats 3       # ~6 min
    python -m bench.reliability soak --minutes 10        # ~11 min
    python -m bench.reliability all
    python -m bench.reliability slowbody --before-tree /tmp/kvpick-before   # ~5 min
    python -m bench.reliability labels --before-tree /tmp/kvpick-before     # ~1 min

``slowbody`` and ``labels`` run their script (bench/reliability/slowbody.py, labels.py) once with
this tree and, given ``--before-tree`` (a checkout, e.g. ``git archive COMMIT``), once with that
tree's picker, launcher and Envoy renderer, for a side-by-side figure.

Each run stores its figures in ``bench/results/reliability.json`` (one section per command) and
rewrites ``docs/reliability.md`` from that file. Run from the repository root (it reuses
kvlaunch's process launcher). Heavy: wrap in ``flock /tmp/kvpick-heavy.lock`` on shared
machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from . import checks, faults, fuzz, report, soak

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "reliability.json"
DOC = ROOT / "docs" / "reliability.md"


def run_fuzz(cases: int, seed: int, concurrency: int, drawn: float) -> dict[str, Any]:
    from kvlaunch import stack

    start = time.monotonic()
    todo = fuzz.edge_cases(oversize=10) + fuzz.generate(cases, seed, drawn)
    generated = time.monotonic() - start
    with tempfile.TemporaryDirectory() as tmp, stack(pathlib.Path(tmp), n=2) as st:
        start = time.monotonic()
        tally = asyncio.run(fuzz.send_all(st.url, todo, set(st.upstreams), concurrency))
        took = time.monotonic() - start
        alive = next(p for n, p in st.procs.procs if n == "picker").poll() is None
        crashes = checks.crash_lines(st.procs.log("picker"))
        in_flight = checks.wait_in_flight_zero(st.metrics_port)
    return {
        "command": f"python -m bench.reliability fuzz --cases {cases} --seed {seed} --concurrency {concurrency}"
        f" --drawn-fraction {drawn:g}",
        "drawn_by_hypothesis": int(cases * drawn),
        "cases": tally.sent,
        "generated_s": round(generated, 1),
        "sent_s": round(took, 1),
        "requests_per_s": round(tally.sent / took, 1),
        "classes": dict(sorted(tally.classes.items())),
        "failed": tally.failed,
        "failures": tally.failures,
        "picker_alive": alive,
        "picker_crash_lines": len(crashes),
        "envoy_config": "render.py's defaults (path allowlist, header limits, slow-client limits)"
        + (", mTLS to the picker" if st.client_cert_args else ""),
        "in_flight_after": in_flight,
    }


Scenario = Callable[[pathlib.Path], Coroutine[Any, Any, dict[str, Any]]]
SCENARIOS: dict[str, Scenario] = {
    "replica SIGKILL": lambda t: faults.replica_fault(t, signal.SIGKILL, hold=4.0),
    "replica SIGSTOP (SIGCONT after 6 s)": lambda t: faults.replica_fault(t, signal.SIGSTOP, hold=6.0),
    "picker SIGKILL, fail-close (restart after 2 s)": lambda t: faults.picker_kill(t, "close"),
    "picker SIGKILL, fail-open (restart after 2 s)": lambda t: faults.picker_kill(t, "open"),
    "picker SIGKILL, fail-open, response FULL_DUPLEX_STREAMED": lambda t: faults.picker_kill(
        t, "open", render=("--response-body-mode", "FULL_DUPLEX_STREAMED")
    ),
    "picker SIGTERM mid-stream (16 streams of 4 s)": lambda t: faults.picker_drain(t, 16, 4.0),
    "fake API: 410 Gone, then watches dropped mid-event": lambda t: faults.kube_watch_faults(t, hold=3.0),
}


def run_faults(repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "command": f"python -m bench.reliability faults --repeats {repeats}",
        "scenarios": {},
    }
    for name, scenario in SCENARIOS.items():
        runs: list[dict[str, Any]] = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(asyncio.run(scenario(pathlib.Path(tmp))))
            print(f"{name}: {json.dumps(runs[-1])}", flush=True)
        out["scenarios"][name] = {"runs": runs, "median": _medians(runs)}
    return out


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per numeric figure: ``[median, min, max]``."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            vals = [r[key] for r in runs]
            out[key] = [statistics.median(vals), min(vals), max(vals)]
    return out


def _script(name: str, tree: pathlib.Path, args: Sequence[str] = ()) -> dict[str, Any]:
    """Run bench/reliability/<name>.py with ``tree`` first on the import path; its JSON line."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(ROOT / "bench" / "reliability" / f"{name}.py"), *args]
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd} in {tree} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _trees(before: str) -> list[tuple[str, pathlib.Path]]:
    return [("after", ROOT), *([("before", pathlib.Path(before))] if before else [])]


def run_slowbody(slow: int, repeats: int, before: str, timeout: str, chunked: bool) -> dict[str, Any]:
    hold = "30"
    out: dict[str, Any] = {
        "command": f"python -m bench.reliability slowbody --slow {slow} --repeats {repeats} "
        f"--request-timeout {timeout}"
        + (" --chunked" if chunked else "")
        + (" --before-tree PATH" if before else ""),
        "slow": slow,
        "chunked": chunked,
        "request_timeout": timeout,
        "hold_s": float(hold),
    }
    for label, tree in _trees(before):
        args = ["--slow", str(slow), "--hold", hold] + (["--chunked"] if chunked else [])
        if label == "after":
            args += ["--render-args", f"--request-timeout {timeout}"]
        runs = []
        for _ in range(repeats):
            runs.append(_script("slowbody", tree, args))
            print(f"slowbody {label}: {json.dumps(runs[-1])}", flush=True)
        out[label] = {"runs": runs, "median": _medians(runs)}
    return out


def run_labels(before: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "command": "python -m bench.reliability labels" + (" --before-tree PATH" if before else "")
    }
    for label, tree in _trees(before):
        out[label] = _script("labels", tree)
        print(f"labels {label}: {json.dumps(out[label])}", flush=True)
    return out


def run_soak(
    minutes: float,
    fraction: float,
    index_capacity: int,
    picker_env: Sequence[str] = (),
    picker_args: str = "",
    envoy_args: str = "",
) -> dict[str, Any]:
    env = dict(kv.split("=", 1) for kv in picker_env)
    with tempfile.TemporaryDirectory() as tmp:
        got = asyncio.run(
            soak.soak(
                pathlib.Path(tmp),
                minutes,
                fraction,
                index_capacity=index_capacity,
                picker_env=env or None,
                picker_args=tuple(picker_args.split()),
                envoy_args=tuple(envoy_args.split()),
            )
        )
    got["command"] = f"python -m bench.reliability soak --minutes {minutes:g} --load-fraction {fraction:g}"
    if index_capacity:
        got["command"] += f" --index-capacity {index_capacity}"
    for kv in picker_env:
        got["command"] += f" --picker-env {kv}"
    for flag, value in (("--picker-args", picker_args), ("--envoy-args", envoy_args)):
        if value:
            got["command"] += f" {flag}='{value}'"
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["fuzz", "faults", "soak", "slowbody", "labels", "all", "report"])
    p.add_argument("--cases", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=20261123)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument(
        "--drawn-fraction", type=float, default=0.1, help="cases drawn by hypothesis; the rest mutants"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--load-fraction", type=float, default=0.8)
    p.add_argument(
        "--index-capacity",
        type=int,
        default=0,
        help="soak: the picker's per-endpoint prefix index bound (0: derived from the replicas)",
    )
    p.add_argument("--picker-env", action="append", default=[], help="soak: KEY=VALUE for the picker")
    p.add_argument("--picker-args", default="", help="soak: extra picker flags (one string)")
    p.add_argument("--envoy-args", default="", help="soak: extra render.py flags (one string)")
    p.add_argument("--label", default="", help="soak: store the figures under soak_<label>")
    p.add_argument("--slow", type=int, default=5000, help="slowbody: slow clients")
    p.add_argument("--request-timeout", default="10s", help="slowbody: render.py --request-timeout")
    p.add_argument("--chunked", action="store_true", help="slowbody: the slow bodies sent chunked")
    p.add_argument(
        "--before-tree", default="", help="slowbody, labels: a checkout to measure too, as the before"
    )
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    machine = f"{platform.machine()}, {os.cpu_count()} cores, shared with other engineers' work"
    if a.what in ("faults", "all"):
        results["faults"] = run_faults(a.repeats) | {"machine": machine}
        _save(results)
    if a.what in ("fuzz", "all"):
        results["fuzz"] = run_fuzz(a.cases, a.seed, a.concurrency, a.drawn_fraction) | {"machine": machine}
        _save(results)
    if a.what == "slowbody":
        key = "slowbody_chunked" if a.chunked else "slowbody"
        got = run_slowbody(a.slow, a.repeats, a.before_tree, a.request_timeout, a.chunked)
        results[key] = got | {"machine": machine}
        _save(results)
    if a.what == "labels":
        results["labels"] = run_labels(a.before_tree) | {"machine": machine}
        _save(results)
    if a.what in ("soak", "all"):
        key = f"soak_index_{a.index_capacity}" if a.index_capacity else "soak"
        key = f"soak_{a.label}" if a.label else key
        results[key] = run_soak(
            a.minutes, a.load_fraction, a.index_capacity, a.picker_env, a.picker_args, a.envoy_args
        ) | {"machine": machine}
        _save(results)
    _save(results)
    return 0


def _save(results: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    DOC.write_text(report.render(results))


if __name__ == "__main__":
    raise SystemExit(main())

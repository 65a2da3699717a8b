"""``python -m bench.hardware``: the cost policy across GPU profiles, in cluster mode.

    python -m bench.hardware [--trace bench/data/mooncake_synthetic_trace.jsonl]
                             [--out bench/results/hardware.md] [--json OUT]
    python -m bench.hardware --jobs new=.,base [--seeds 5] [--modes approximate,precise] > JOBS

The Mooncake synthetic trace on 8 simulated replicas (``bench.cluster``: discrete-event
time, the picker's own ``Router``), one fleet per row of :data:`FLEETS`, each with the trace's
arrivals scaled (``time_scale``) to put the fleet near 80% of its capacity, and the same picker
config for every fleet (no per-profile tuning: the load model calibrates itself from the
simulated replicas' vLLM metrics). Then one overloaded fleet. Cluster mode is deterministic
for a seed; each cell is one run (seed 0), and its figures are simulated time, not wall time.

``cost`` runs the way the chart ships it, ``precise`` (the replicas' KV events, delivered
:data:`EVENT_DELAY_S` after the engine stores or evicts a block), and beside it ``approximate``
(the picker's own record of its picks): the variant for a deployment without KV events.

``--jobs`` runs nothing: it prints the table's ``cost`` rows as ``bench.cluster_matrix`` jobs
(``NAME TREE ARGS``), one per fleet, prefix mode, seed and tree, with each fleet's own
profiles, time scale and row limit, so that a landing rule's matrix (five seeds, two trees) runs
exactly the table's cells. Names are ``FLEET-MODE-sSEED-TREE``, e.g. ``a100-70b-approximate-s3-base``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from dataclasses import dataclass

from bench import mooncake_trace as trace
from bench.cluster import Result, simulate
from replica.sim.costmodel import profile


@dataclass(frozen=True)
class Fleet:
    name: str
    key: str
    """Short name for job names (``--jobs``)."""
    profiles: tuple[str, ...]
    time_scale: float
    """Trace timestamps × this: about 80% of the fleet's capacity (the module docstring)."""
    limit: int | None = None


FLEETS = (
    Fleet("8 × H100, Llama-3.1-8B", "h100", ("h100-llama-3.1-8b",), 1.0),
    Fleet("8 × A100, Llama-3.1-70B (TP 4)", "a100-70b", ("a100-llama-3.1-70b",), 4.0),
    Fleet("8 × L4, Llama-3.1-8B", "l4", ("l4-llama-3.1-8b",), 16.0),
    Fleet("4 × H100 + 4 × A100, Llama-3.1-8B", "mixed", ("h100-llama-3.1-8b", "a100-llama-3.1-8b"), 1.4),
)
OVERLOADED = Fleet(
    "overloaded: 8 × A100, Llama-3.1-70B at the trace's own rate",
    "overloaded",
    ("a100-llama-3.1-70b",),
    1.0,
    1500,
)
POLICIES = (("cost", "precise"), ("cost", "approximate"), ("round-robin", "approximate"))
"""(policy, prefix mode); round-robin ignores prefixes, so its mode does not matter."""
BASELINE = "round-robin"
EVENT_DELAY_S = 0.05
"""KV-event delivery delay in precise mode (cluster mode's default)."""


def run(fleet: Fleet, rows: list[trace.Row]) -> dict[str, Result]:
    profs = [profile(p) for p in fleet.profiles]
    rows = rows[: fleet.limit] if fleet.limit else rows
    out = {}
    for pol, mode in POLICIES:
        label = pol if pol == BASELINE else f"{pol} {mode}"
        out[label] = r = simulate(
            rows, 8, pol, profs, fleet.time_scale, prefix_mode=mode, event_delay_s=EVENT_DELAY_S
        )
        print(
            f"[hardware] {fleet.name:<40} {label:<18} hit {r.hit_rate:.3f} (LRU {r.lru_hit_rate:.3f}) "
            f"TTFT p50 {r.ttft_p50:.3f} p90 {r.ttft_p90:.3f} errors {r.errors}",
            flush=True,
        )
    return out


def table(results: list[tuple[Fleet, dict[str, Result]]]) -> str:
    lines = [
        "| fleet | time scale | policy | hit rate | LRU ceiling | ideal | hit / LRU | TTFT p50 s | TTFT p90 s "
        "| p90 / round-robin | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fleet, res in results:
        rr = res[BASELINE]
        for pol, r in res.items():
            ratio = r.ttft_p90 / rr.ttft_p90 if rr.ttft_p90 else float("nan")
            lines.append(
                f"| {fleet.name} | {fleet.time_scale:g} | {pol} | {r.hit_rate:.3f} | {r.lru_hit_rate:.3f} "
                f"| {r.ideal_hit_rate:.3f} | {r.hit_rate / r.lru_hit_rate:.2f} | {r.ttft_p50:.3f} | {r.ttft_p90:.3f} "
                f"| {ratio:.2f} | {r.errors} |"
            )
    return "\n".join(lines) + "\n"


def jobs(fleets: list[Fleet], trees: list[str], seeds: int, modes: list[str], trace_arg: str) -> list[str]:
    """The ``cost`` cells of the table as ``bench.cluster_matrix`` job lines (module docstring):
    the same fleet, profiles, time scale, row limit and event delay as :func:`run`. ``trees``:
    ``NAME[=TREE]`` each (``TREE`` defaults to ``NAME``)."""
    out = []
    for f in fleets:
        limit = ["--limit", str(f.limit)] if f.limit else []
        for mode in modes:
            for seed in range(seeds):
                for tree in trees:
                    name, _, where = tree.partition("=")
                    args = [
                        "--trace", trace_arg, "--replicas", "8", "--policy", "cost",
                        "--prefix-mode", mode, "--profile", ",".join(f.profiles),
                        "--time-scale", f"{f.time_scale:g}", *limit,
                        "--event-delay-s", f"{EVENT_DELAY_S:g}", "--seed", str(seed),
                    ]  # fmt: skip
                    out.append(" ".join([f"{f.key}-{mode}-s{seed}-{name}", where or name, *args]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.hardware",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", default=str(trace.DEFAULT_TRACE), help="Mooncake-format trace (JSONL)")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--fleets", default=None, help="comma-separated row numbers of FLEETS (0-based); default all"
    )
    p.add_argument("--no-overload", action="store_true")
    p.add_argument(
        "--jobs",
        default=None,
        metavar="NAME[=TREE],...",
        help="print the cost rows as bench.cluster_matrix jobs and run nothing: one set per "
        "tree, NAME in the job names, TREE a name of its --trees ('.': this checkout; default NAME)",
    )
    p.add_argument("--seeds", type=int, default=5, help="with --jobs: seeds 0..N-1")
    p.add_argument("--modes", default="approximate,precise", help="with --jobs: prefix modes")
    a = p.parse_args(argv)
    fleets = [FLEETS[int(i)] for i in a.fleets.split(",")] if a.fleets else list(FLEETS)
    if not a.no_overload:
        fleets.append(OVERLOADED)
    if a.jobs is not None:
        root = pathlib.Path(__file__).resolve().parents[1]  # the checkout: cluster_matrix's {root}
        ours = pathlib.Path(a.trace).resolve()
        trace_arg = f"{{root}}/{ours.relative_to(root)}" if ours.is_relative_to(root) else str(ours)
        trees = [t for t in a.jobs.split(",") if t]
        print("\n".join(jobs(fleets, trees, a.seeds, a.modes.split(","), trace_arg)))
        return 0
    rows = trace.read(a.trace)
    results = [(f, run(f, rows)) for f in fleets]
    text = table(results)
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text, encoding="utf-8")
    if a.json:
        doc = [
            {"fleet": f.name, "time_scale": f.time_scale, **{k: v.__dict__ for k, v in r.items()}}
            for f, r in results
        ]
        pathlib.Path(a.json).write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

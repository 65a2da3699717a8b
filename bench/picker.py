"""``python -m bench.picker``: the picker's own cost.

1. In-process decisions (``Router.route`` + ``start`` + ``finish``) per second and per-decision
   latency p50/p99, for prompts of 1k, 8k, 32k and 220k characters over 8, 64 and 256 endpoints,
   with a warmed prefix index (:mod:`bench.picker_inproc`).
2. Index memory: traced bytes per (block, endpoint) entry at a realistic fill.
3. Requests/s through a real Envoy + picker for 32 KB bodies, against the upstreams hit directly
   (:mod:`bench.picker_envoy`).

Prints a markdown report and writes JSON to ``bench/results/picker.json``. Targets (issue 2):
at least 2,000 decisions/s with 8k-token (32k-character) prompts over 64 endpoints, and at most
100 bytes per index entry.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
from dataclasses import asdict

import orjson

from bench.picker_envoy import LoadResult, measure_envoy
from bench.picker_inproc import MemoryResult, PickResult, measure_memory, measure_pick

TARGET_DPS = 2000.0
TARGET_BYTES = 100.0
RESULTS = pathlib.Path(__file__).parent / "results" / "picker.json"


def pick_table(rows: list[PickResult]) -> str:
    out = [
        "| prompt chars | blocks | endpoints | decisions | p50 µs | p99 µs | decisions/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.prompt_chars:,} | {r.blocks:,} | {r.endpoints} | {r.decisions:,} | {r.p50_us:,.0f} "
            f"| {r.p99_us:,.0f} | {r.decisions_per_s:,.0f} |"
        )
    return "\n".join(out)


def envoy_table(direct: LoadResult, via: LoadResult) -> str:
    out = [
        "| target | concurrency | body bytes | requests | errors | req/s | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (direct, via):
        out.append(
            f"| {r.target} | {r.concurrency} | {r.body_bytes:,} | {r.requests:,} | {r.errors} "
            f"| {r.rps:,.0f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} |"
        )
    return "\n".join(out)


def verdicts(rows: list[PickResult], mem: MemoryResult) -> list[str]:
    lines = []
    target = [r for r in rows if r.prompt_chars == 32_000 and r.endpoints == 64]
    if target:
        dps = target[0].decisions_per_s
        ok = "met" if dps >= TARGET_DPS else "MISSED"
        lines.append(
            f"- decisions/s at 32k chars × 64 endpoints: {dps:,.0f} (target ≥ {TARGET_DPS:,.0f}: {ok})"
        )
    ok = "met" if mem.bytes_per_entry <= TARGET_BYTES else "MISSED"
    lines.append(
        f"- index memory: {mem.bytes_per_entry:.1f} B per (block, endpoint) entry over {mem.entries:,} entries "
        f"({mem.endpoints} endpoints × capacity {mem.capacity_blocks:,}; target ≤ {TARGET_BYTES:.0f}: {ok})"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.picker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="1000,8000,32000,220000", help="prompt sizes in characters")
    ap.add_argument("--endpoints", default="8,64,256", help="endpoint counts")
    ap.add_argument("--min-seconds", type=float, default=1.5, help="time per in-process cell")
    ap.add_argument("--envoy-seconds", type=float, default=10.0, help="load duration per Envoy run")
    ap.add_argument("--concurrency", type=int, default=16, help="client concurrency for the Envoy runs")
    ap.add_argument("--no-envoy", action="store_true", help="skip the Envoy throughput runs")
    ap.add_argument("--out", default=str(RESULTS), help="JSON output path")
    args = ap.parse_args(argv)

    rows = []
    for chars in (int(x) for x in args.prompts.split(",")):
        for n in (int(x) for x in args.endpoints.split(",")):
            rows.append(measure_pick(chars, n, min_seconds=args.min_seconds))
            print(f"  in-process {chars} chars × {n} endpoints done", file=sys.stderr)
    mem = measure_memory()
    envoy = (
        None if args.no_envoy else measure_envoy(concurrency=args.concurrency, duration_s=args.envoy_seconds)
    )

    load = os.getloadavg()[0]
    print(
        f"# picker benchmark ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {load:.2f} at the end)\n"
    )
    print("## In-process decisions (route + start + finish, cost policy, warmed index)\n")
    print(pick_table(rows) + "\n")
    if envoy is not None:
        direct, via = envoy
        print("## Through Envoy + picker (32 KB bodies)\n")
        print(envoy_table(direct, via) + "\n")
        print(f"Envoy + picker / direct throughput: {via.rps / direct.rps:.2f}\n")
    print("## Targets\n")
    print("\n".join(verdicts(rows, mem)))

    doc: dict[str, object] = {
        "cpus": os.cpu_count(),
        "load_average_1m": load,
        "in_process": [asdict(r) for r in rows],
        "memory": asdict(mem),
        "envoy": None
        if envoy is None
        else {
            "direct": asdict(envoy[0]),
            "via_picker": asdict(envoy[1]),
            "ratio": envoy[1].rps / envoy[0].rps,
        },
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    print(f"\nJSON: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m bench.exchange``: the picker's own Python per request, in process, without gRPC.

    python -m bench.exchange                                   # this checkout, 8 KB and 220 KB
    git archive main | tar -x -C /tmp/kvpick-base
    python -m bench.exchange --source base=/tmp/kvpick-base    # side by side, interleaved

One ext_proc exchange as the shipped default config makes it (request headers with
``protocol_config`` BUFFERED / response body NONE, then the whole body in one message; the answer
to the headers skips the response path), driven through ``ExtProcService.exchange`` on an
asyncio loop. Each request's two messages are parsed from their wire bytes and each answer is
serialized, as grpc.aio's (de)serializers do; the gRPC transport, TLS and the loop's wake-ups
are left out. That isolates what ``bench.datapath``'s picker CPU per request cannot: the part
our own code and protobuf add, measured as the loop thread's CPU time (``time.thread_time``),
so other processes on a shared machine count far less than in wall-clock timings.

The body is ``bench.datapath``'s (one chat message of random words, the same every request), so
after the first request the prefix index holds the whole prompt on the endpoint it went to, as in
``bench.datapath``. Two endpoints, default policy (``cost``), telemetry on.

Each source tree runs in its own process (``PYTHONPATH`` = the tree, whose ``picker`` and
``bench.datapath.make_body`` the driver, ``bench/_exchange_driver.py``, imports); repeats are interleaved
(repeat 1 of every source, then repeat 2, ...). Prints medians (min–max) of µs per request.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

SIZES = {"8k": 8 * 1024, "220k": 220 * 1024}
DRIVER = pathlib.Path(__file__).with_name("_exchange_driver.py")


FC = "+fc"
"""The source name of this checkout with flow control on (``--flow-control``)."""


def run_once(source: str, size: int, requests: int) -> float:
    """µs of loop-thread CPU per request, for one source tree ("" = this checkout; :data:`FC`:
    this checkout with flow control on)."""
    flow = source == FC or source.startswith(FC + "=")
    root = source.removeprefix(FC + "=") if source.startswith(FC + "=") else "" if flow else source
    root = root or str(pathlib.Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONSAFEPATH": "1",
        "PYTHONPATH": root,
        "KVPICK_EXCHANGE_FLOW": "on" if flow else "",
    }
    out = subprocess.run(
        [sys.executable, str(DRIVER), str(size), str(requests)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(json.loads(out.strip().splitlines()[-1])["us_per_request"])


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.exchange",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another tree, side by side (a NAME ending in +fc: with flow control on)",
    )
    p.add_argument("--sizes", default="8k,220k", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=2000, help="timed requests per repeat")
    p.add_argument(
        "--flow-control",
        action="store_true",
        help="also run this checkout with flow control on (never saturated), as source this+fc",
    )
    a = p.parse_args(argv)
    sources = {"this": "", **dict(s.split("=", 1) for s in a.source)}
    for name, src in list(sources.items()):  # NAME+fc=DIR: that tree with flow control on
        if name.endswith(FC) and src:
            sources[name] = f"{FC}={src}"
    if a.flow_control:
        sources["this+fc"] = FC
    results: dict[tuple[str, str], list[float]] = {}
    for size in a.sizes.split(","):
        n = a.requests if SIZES[size] < 64 * 1024 else max(1, a.requests // 4)
        for _ in range(a.repeats):
            for name, src in sources.items():
                results.setdefault((size, name), []).append(run_once(src, SIZES[size], n))
    print("| body | source | µs per request, median (min–max) | vs this |")
    print("|---|---|---|---|")
    for (size, name), vals in results.items():
        ratio = statistics.median(vals) / statistics.median(results[(size, "this")])
        print(f"| {size} | {name} | {_fmt(vals)} | {ratio:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

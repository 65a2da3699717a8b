"""Where each pick went against what was in flight at the time (issue 12's control):
``python -m bench.balance RUN_DIR [--workload no-sharing@nice19]``.

For every request of a ``bench.real --split`` run (the replica that served it is in its
``.split.jsonl`` record, from vLLM's own span), the requests sent before it and not yet done are
counted per replica, from the client's own records, in two kinds: **prefilling** (no first token
yet) and **decoding** (first token, not finished). The pick is then, against the other replicas:

- ``same``: every replica had as many of each;
- ``fewer-prefilling`` / ``more-prefilling``: the chosen one had the fewest / not the fewest
  requests still prefilling;
- ``fewer-decoding`` / ``more-decoding``: as many prefilling everywhere, and the chosen one had
  the fewest / not the fewest decoding.

Per router and kind: the count, and the median client TTFT and vLLM's own TTFT (its span). On a
workload with nothing to share every pick is load balancing, and a ``more-prefilling`` pick queues
behind another request's prefill. The client's view of "prefilling" ends at its first token,
slightly after the engine's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from dataclasses import dataclass, field
from typing import Any

KINDS = ("same", "fewer-prefilling", "more-prefilling", "fewer-decoding", "more-decoding")


@dataclass(frozen=True)
class Request:
    index: int
    sent_at: float
    ttft: float
    e2e: float
    replica: int
    engine_ttft: float


def _rows(f: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines()]


def load_window(outcomes: pathlib.Path) -> list[Request]:
    """One window's successful requests whose replica is known, in send order."""
    split = outcomes.with_name(outcomes.name.removesuffix(".jsonl") + ".split.jsonl")
    where = {r["index"]: r for r in _rows(split)} if split.exists() else {}
    out = []
    for o in _rows(outcomes):
        s = where.get(o["index"])
        if o["ok"] and s is not None and s.get("replica", -1) >= 0:
            out.append(Request(o["index"], o["sent_at"], o["ttft"], o["e2e"], s["replica"], s["engine"]))
    return sorted(out, key=lambda r: r.sent_at)


def classify(window: list[Request], replicas: int = 2) -> list[tuple[Request, str]]:
    """Each request with its kind (module docstring). O(n²) in the window: 64 to a few hundred."""
    out = []
    for i, r in enumerate(window):
        pre, dec = [0] * replicas, [0] * replicas
        for p in window[:i]:
            if p.sent_at + p.ttft > r.sent_at:
                pre[p.replica] += 1
            elif p.sent_at + p.e2e > r.sent_at:
                dec[p.replica] += 1
        if len(set(pre)) > 1:
            kind = "fewer-prefilling" if pre[r.replica] == min(pre) else "more-prefilling"
        elif len(set(dec)) > 1:
            kind = "fewer-decoding" if dec[r.replica] == min(dec) else "more-decoding"
        else:
            kind = "same"
        out.append((r, kind))
    return out


@dataclass
class Tally:
    client: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    engine: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})


def tally(run_dir: pathlib.Path, workload: str) -> dict[str, Tally]:
    """Per router, every repeat's requests by kind."""
    out: dict[str, Tally] = {}
    for f in sorted(run_dir.glob(f"r*/*/{workload}.jsonl")):
        t = out.setdefault(f.parent.name, Tally())
        for r, kind in classify(load_window(f)):
            t.client[kind].append(r.ttft)
            t.engine[kind].append(r.engine_ttft)
    return out


def report(run_dir: pathlib.Path, workload: str) -> str:
    lines = [
        f"#### {workload}: picks against what was in flight (n; median client TTFT / vLLM TTFT, ms)\n",
        "| router | " + " | ".join(KINDS) + " |",
        "|---|" + "---|" * len(KINDS),
    ]
    for router, t in tally(run_dir, workload).items():
        cells = []
        for k in KINDS:
            c, e = t.client[k], t.engine[k]
            cells.append(
                f"{len(c)}; {statistics.median(c) * 1e3:.0f} / {statistics.median(e) * 1e3:.0f}" if c else "0"
            )
        lines.append(f"| {router} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.balance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="a bench.real --split run directory")
    p.add_argument("--workload", default="no-sharing@nice19", help="the records' file stem")
    a = p.parse_args(argv)
    print(report(pathlib.Path(a.run_dir), a.workload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

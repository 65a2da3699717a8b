"""Pooled TTFT p90 with bootstrap intervals, from ``bench.real``'s per-request records (issue 12):
``python -m bench.pooled RUN_DIR [RUN_DIR...]``.

One repeat's p90 over 64 requests is its 7th-slowest request, and it moved 0.048–0.227 s across
repeats of one router, more than the gaps it was meant to judge. Here every repeat's requests of
one router on one workload are pooled (``rREPEAT/ROUTER/WORKLOAD.jsonl``, every run directory
given: repeat ``r`` of every run uses the same arrival schedule, so several runs add repeats),
and each figure comes with a 95% interval from a **two-stage bootstrap**: draw the repeats with
replacement, then within each drawn repeat its requests with replacement, and take the figure of
the pooled draw; the interval is the 2.5th and 97.5th percentiles over ``draws`` such draws. The
first stage carries the machine's drift between repeats (the routers of a repeat run one after
another, minutes apart, on a shared machine), the second the luck of which requests came late.

**Paired.** Two routers' requests pair when they are the same request of the same repeat (same
``index``: the same prompt sent at the same offset). The ratio ``p90(a) / p90(b)`` is bootstrapped
with the same draws for both (the pairs are drawn, not each side alone), so what both sides share,
a slow arrival burst in that schedule, cancels out of the interval. The verdict against a bound
``limit`` on that ratio (the target's ``p90 <= best peer``: 1.0; the control's "within 10% of
least-loaded": 1.1) is ``met`` when the whole interval is at or under it, ``missed`` when it is
all above, and ``within noise`` when it straddles it: the run cannot tell.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .stats import percentile

Repeats = dict[tuple[int, int], dict[int, float]]
"""Per repeat (the run directory's position, the repeat's number), per request index: the
client's TTFT (seconds) of a successful request."""

PEERS = ("vllm-router", "sglang-router")
LEVEL = 0.95


def load(run_dirs: Sequence[pathlib.Path]) -> dict[tuple[str, str], Repeats]:
    """(workload, router) -> the successful requests' TTFTs by repeat and index. The workload is
    the file's stem (``no-sharing@nice19``). Requests pair only within one run directory (the
    routers of one repeat ran minutes apart; another run's repeat with the same number has the
    same arrivals but another machine state: ``bench.real --first-repeat`` numbers them apart)."""
    out: dict[tuple[str, str], Repeats] = {}
    for k, d in enumerate(run_dirs):
        for f in sorted(d.glob("r*/*/*.jsonl")):
            if f.name.endswith(".split.jsonl"):
                continue
            rep = (k, int(f.parent.parent.name.removeprefix("r")))
            reps = out.setdefault((f.name.removesuffix(".jsonl"), f.parent.name), {})
            rows = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines()]
            reps[rep] = {int(r["index"]): float(r["ttft"]) for r in rows if r["ok"]}
    return out


def p90(xs: Sequence[float]) -> float:
    return percentile(xs, 90)


def pooled(reps: Repeats) -> list[float]:
    return [t for rep in reps.values() for t in rep.values()]


Key = tuple[int, int]


def _draw(rng: random.Random, keys: dict[Key, list[int]]) -> list[tuple[Key, int]]:
    """One two-stage draw of (repeat, index): repeats with replacement, then indices within each."""
    reps = list(keys)
    out: list[tuple[Key, int]] = []
    for r in rng.choices(reps, k=len(reps)):
        ix = keys[r]
        out += [(r, i) for i in rng.choices(ix, k=len(ix))]
    return out


def _interval(xs: list[float]) -> tuple[float, float]:
    s = sorted(xs)
    tail = (1 - LEVEL) / 2
    return percentile(s, 100 * tail), percentile(s, 100 * (1 - tail))


def bootstrap_p90(reps: Repeats, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95% interval of the pooled p90 (module docstring)."""
    keys = {r: sorted(rep) for r, rep in reps.items() if rep}
    assert keys, "no successful request to bootstrap"
    rng = random.Random(seed)
    return _interval([p90([reps[r][i] for r, i in _draw(rng, keys)]) for _ in range(draws)])


@dataclass(frozen=True)
class Paired:
    """``a`` against ``b`` on the requests both served."""

    n: int
    ratio: float
    """p90(a) / p90(b) over the pairs."""
    low: float
    high: float
    """The ratio's 95% interval."""
    median_diff: float
    """The median over pairs of ``ttft(a) - ttft(b)``, seconds."""

    def verdict(self, limit: float = 1.0) -> str:
        if self.high <= limit:
            return "met"
        if self.low > limit:
            return "missed"
        return "within noise"


def paired(a: Repeats, b: Repeats, draws: int = 2000, seed: int = 0) -> Paired | None:
    """Module docstring; None when no request pairs."""
    keys = {r: sorted(set(a[r]) & set(b[r])) for r in a.keys() & b.keys()}
    keys = {r: ix for r, ix in keys.items() if ix}
    if not keys:
        return None
    pairs = [(r, i) for r, ix in keys.items() for i in ix]
    ratio = p90([a[r][i] for r, i in pairs]) / p90([b[r][i] for r, i in pairs])
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        d = _draw(rng, keys)
        ratios.append(p90([a[r][i] for r, i in d]) / p90([b[r][i] for r, i in d]))
    low, high = _interval(ratios)
    diff = statistics.median(a[r][i] - b[r][i] for r, i in pairs)
    return Paired(len(pairs), ratio, low, high, diff)


def _best_peer(runs: dict[str, Repeats]) -> str | None:
    peers = [p for p in PEERS if p in runs]
    return min(peers, key=lambda p: p90(pooled(runs[p]))) if peers else None


def _vs(a: Repeats, b: Repeats, name: str, limit: float, draws: int) -> str:
    pr = paired(a, b, draws)
    if pr is None:
        return "–"
    return (
        f"{name}: {pr.ratio:.2f}× [{pr.low:.2f}–{pr.high:.2f}], n {pr.n}, "
        f"paired median {pr.median_diff * 1e3:+.1f} ms: **{pr.verdict(limit)}**"
        + (f" (≤ {limit:.1f}×)" if limit != 1.0 else "")
    )


def report(data: dict[tuple[str, str], Repeats], draws: int = 2000) -> str:
    """Per workload: every router's pooled p90 with its interval; for each of ours (every router
    but the peers), the paired ratio against the best peer (the one with the lowest pooled p90),
    against ``least-loaded`` on the control (bound 1.1), and, for ``X`` or ``X@TAG``, against
    ``X@base`` (the same router from the source tree ``bench.real --source base=DIR``)."""
    lines = []
    for wl in dict.fromkeys(w for w, _ in data):
        runs = {r: reps for (w, r), reps in data.items() if w == wl}
        lines += [
            f"\n#### {wl}\n",
            "| router | repeats | requests | pooled TTFT p90 s [95%] | pooled p50 s | paired p90 ratio vs … [95%]: verdict |",
            "|---|---|---|---|---|---|",
        ]
        peer = _best_peer(runs)
        for name, reps in runs.items():
            xs = pooled(reps)
            lo, hi = bootstrap_p90(reps, draws)
            cmp = []
            if name not in PEERS:
                if peer is not None:
                    cmp.append(_vs(reps, runs[peer], f"best peer {peer}", 1.0, draws))
                if wl.startswith("no-sharing") and "least-loaded" in runs and name != "least-loaded":
                    cmp.append(_vs(reps, runs["least-loaded"], "least-loaded", 1.1, draws))
                base = name.partition("@")[0] + "@base"
                if base in runs and base != name:
                    cmp.append(_vs(reps, runs[base], base, 1.0, draws))
            lines.append(
                f"| {name} | {len(reps)} | {len(xs)} | {p90(xs):.3f} [{lo:.3f}–{hi:.3f}] "
                f"| {percentile(xs, 50):.3f} | {'<br>'.join(cmp)} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.pooled",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dirs", nargs="+", help="bench.real run directories (their last line names them)")
    p.add_argument("--draws", type=int, default=2000)
    a = p.parse_args(argv)
    data = load([pathlib.Path(d) for d in a.run_dirs])
    print(report(data, a.draws))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""bench.pooled: pooled p90 over repeats, its bootstrap interval, and the paired verdict; read
from files laid out as bench.real writes them."""

from __future__ import annotations

import json
import pathlib
import random

import pytest

from bench.pooled import Repeats, bootstrap_p90, load, p90, paired, pooled, report


def _repeats(seed: int, scale: float = 1.0, n: int = 64, reps: int = 5) -> Repeats:
    """Lognormal TTFTs (a long tail, as measured), ``n`` requests in each of ``reps`` repeats."""
    rng = random.Random(seed)
    return {(0, r): {i: scale * rng.lognormvariate(-3.3, 0.6) for i in range(n)} for r in range(reps)}


def test_a_clear_gap_is_judged_and_a_tie_is_called_noise() -> None:
    b = _repeats(1)
    slower = {r: {i: 1.5 * t for i, t in rep.items()} for r, rep in b.items()}  # every request 1.5x
    pr = paired(slower, b, draws=500)
    assert pr is not None and pr.n == 320
    assert pr.ratio == pytest.approx(1.5) and pr.low == pytest.approx(1.5) and pr.high == pytest.approx(1.5)
    assert pr.verdict() == "missed" and pr.verdict(limit=1.6) == "met"
    assert pr.median_diff > 0
    # Two draws of the same distribution: the interval holds 1, and the run cannot tell.
    tie = paired(_repeats(2), _repeats(3), draws=500)
    assert tie is not None and tie.low < 1 < tie.high and tie.verdict() == "within noise"


def test_the_interval_holds_the_pooled_p90_and_narrows_with_more_requests() -> None:
    small, big = _repeats(4, n=64), _repeats(4, n=640)
    lo, hi = bootstrap_p90(small, draws=500)
    assert lo <= p90(pooled(small)) <= hi
    blo, bhi = bootstrap_p90(big, draws=500)
    assert bhi - blo < (hi - lo) / 1.5, ((lo, hi), (blo, bhi))
    # One slow repeat (the machine's other load) widens it: the repeats are drawn too.
    drift = dict(small)
    drift[(0, 0)] = {i: 3 * t for i, t in small[(0, 0)].items()}
    dlo, dhi = bootstrap_p90(drift, draws=500)
    assert dhi - dlo > hi - lo


def test_only_the_same_request_of_the_same_repeat_pairs() -> None:
    a = {(0, 0): {0: 1.0, 1: 2.0}, (0, 1): {0: 5.0}}
    b = {(0, 0): {1: 1.0, 2: 9.0}, (1, 1): {0: 1.0}}
    pr = paired(a, b, draws=50)
    assert pr is not None and pr.n == 1 and pr.ratio == 2.0  # (0, 0) index 1 only
    assert paired({(0, 0): {0: 1.0}}, {(0, 1): {0: 1.0}}) is None


def _write(d: pathlib.Path, rep: int, router: str, wl: str, ttfts: list[float], ok: bool = True) -> None:
    f = d / f"r{rep}" / router / f"{wl}.jsonl"
    f.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"index": i, "ok": ok or i > 0, "ttft": t} for i, t in enumerate(ttfts)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    f.with_suffix(".split.jsonl").write_text('{"index": 0, "client_ttft": 9.0}\n')  # not an outcome


def test_runs_load_and_report(tmp_path: pathlib.Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    for rep in range(2):
        _write(one, rep, "cost", "no-sharing@nice19", [0.01 * (i + 1) for i in range(20)], ok=False)
        _write(one, rep, "cost@base", "no-sharing@nice19", [0.02 * (i + 1) for i in range(20)])
        _write(one, rep, "cost@new", "no-sharing@nice19", [0.04 * (i + 1) for i in range(20)])
        _write(one, rep, "least-loaded", "no-sharing@nice19", [0.01 * (i + 1) for i in range(20)])
        _write(one, rep, "sglang-router", "no-sharing@nice19", [0.01 * (i + 1) for i in range(20)])
    _write(two, 0, "cost", "no-sharing@nice19", [0.5] * 20)  # another run's repeat 0: kept apart
    data = load([one, two])
    cost = data[("no-sharing@nice19", "cost")]
    assert sorted(cost) == [(0, 0), (0, 1), (1, 0)]
    assert 0 not in cost[(0, 0)] and len(cost[(0, 0)]) == 19  # the failed request is left out
    assert ("no-sharing@nice19", "cost@base") in data
    text = report(load([one]), draws=100)
    row = next(line for line in text.splitlines() if line.startswith("| cost |"))
    assert "best peer sglang-router: 1.00×" in row and "least-loaded: 1.00×" in row and "(≤ 1.1×)" in row
    assert "cost@base: 0.50×" in row and "**met**" in row
    new = next(line for line in text.splitlines() if line.startswith("| cost@new |"))
    assert "cost@base: 2.00×" in new and "**missed**" in new
    peer = next(line for line in text.splitlines() if line.startswith("| sglang-router |"))
    assert peer.endswith("|  |"), "peers are not judged"

"""Hit-rate ceilings on hand-made traces, and on a generated workload with a known answer."""

from __future__ import annotations

import pytest

from bench import ideal, workloads


def test_infinite_cache_counts_leading_seen_blocks_and_keeps_the_last_token_uncached() -> None:
    # block size 4; (prompt tokens, block hashes)
    seqs = [(8, [1, 2]), (8, [1, 2]), (12, [1, 2, 3]), (4, [9]), (9, [7, 2])]
    # 1st: cold. 2nd: 8 tokens, lookup capped at (8-1)//4 = 1 block → 4. 3rd: blocks 1,2 → 8.
    # 4th: one-block prompt, cap 0 → 0. 5th: first block 7 unseen → 0 (block 2 does not count).
    assert ideal.ideal_hit_rate(seqs, 4) == pytest.approx(12 / 41)


def test_lru_forgets_what_an_infinite_cache_keeps() -> None:
    seqs = [(9, [1, 2]), (9, [3, 4]), (9, [1, 2])]
    assert ideal.ideal_hit_rate(seqs, 4) == pytest.approx(8 / 27)
    assert ideal.lru_hit_rate(seqs, 4, capacity_blocks=2) == 0.0
    assert ideal.lru_hit_rate(seqs, 4, capacity_blocks=4) == pytest.approx(8 / 27)


def test_lru_touch_keeps_a_hot_prefix() -> None:
    # capacity 3: A=[1,2] is touched again before C arrives, so C evicts B's blocks, not A's
    seqs = [(9, [1, 2]), (5, [3]), (9, [1, 2]), (5, [4]), (9, [1, 2])]
    assert ideal.lru_hit_rate(seqs, 4, capacity_blocks=3) == pytest.approx(16 / 37)


def test_shared_prefix_ideal_matches_the_closed_form() -> None:
    g, p, s, q = 3, 5, 64, 16
    w = workloads.shared_prefix(g, p, s, q, 4)
    inf, lru = ideal.ceilings(w, block_size=16, capacity_blocks=10_000)
    want = g * (p - 1) * s / (g * p * (s + q))
    assert inf == pytest.approx(want)
    assert lru == pytest.approx(want)
    assert ideal.ceilings(w, 16, None)[1] is None
    assert ideal.ceilings(workloads.no_sharing(10, 64, 4), 16, 1000)[0] == 0.0

"""Property tests for chained block hashing and the segmented per-endpoint LRU index."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from picker.core.prefix.hashing import MASK60, HashConfig, block_hashes, seed_for
from picker.core.prefix.index import EndpointLRU, PrefixIndex
from picker.core.prefix.memo import HashMemo, common_prefix

SEED = seed_for("model")
texts = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=600)
small_cfg = st.builds(HashConfig, block_size=st.integers(1, 32), max_blocks=st.integers(1, 64))


def test_hash_shape() -> None:
    cfg = HashConfig(block_size=64, max_blocks=2048)
    hs = block_hashes("a" * 200, SEED, cfg)
    assert len(hs) == 4, "three full blocks plus the trailing partial one"
    assert all(0 <= h <= MASK60 for h in hs)
    assert block_hashes("", SEED, cfg) == []
    assert block_hashes("a" * 200, SEED, cfg) == block_hashes(b"a" * 200, SEED, cfg), "str and bytes agree"


@given(st.binary(max_size=400), st.integers(0, 12), small_cfg, st.binary(min_size=1, max_size=40))
def test_shared_blocks_share_exactly_k_leading_hashes(
    base: bytes, k: int, cfg: HashConfig, tail: bytes
) -> None:
    bs = cfg.block_size
    prefix = (base * (k * bs // max(1, len(base)) + 1))[: k * bs] if base else b"p" * (k * bs)
    a = prefix + tail
    b = prefix + bytes([tail[0] ^ 0xFF]) + tail[1:]  # differs in the first byte after the prefix
    ha, hb = block_hashes(a, SEED, cfg), block_hashes(b, SEED, cfg)
    shared = min(k, cfg.max_blocks)
    assert ha[:shared] == hb[:shared]
    if k < cfg.max_blocks:
        assert len(ha) > k and len(hb) > k
        assert all(x != y for x, y in zip(ha[k:], hb[k:], strict=True)), "chained: differ from block k on"


@given(st.binary(max_size=3000), small_cfg)
def test_max_blocks_cap(data: bytes, cfg: HashConfig) -> None:
    hs = block_hashes(data, SEED, cfg)
    expected = min(cfg.max_blocks, -(-len(data) // cfg.block_size))
    assert len(hs) == expected


@given(texts, st.text(min_size=1, max_size=5), st.text(min_size=1, max_size=5))
def test_seed_separates_models_salts_and_loras(text: str, s1: str, s2: str) -> None:
    if not text or s1 == s2:
        return
    cfg = HashConfig(block_size=8)
    seeds = [seed_for("m", lora=s1), seed_for("m", lora=s2), seed_for("m", salt=s1), seed_for(s1)]
    first = {block_hashes(text, s, cfg)[0] for s in seeds}
    assert len(first) == len(seeds), "each seed gives a different first block"


# ---- the LRU -------------------------------------------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.lists(st.integers(0, 300), max_size=40)),
        st.tuples(st.just("resize"), st.integers(1, 120)),
    ),
    max_size=60,
)


@settings(max_examples=300)
@given(st.integers(2, 100), st.integers(2, 6), ops)
def test_lru_bound_never_exceeded(capacity: int, segments: int, steps: list[tuple[str, object]]) -> None:
    if capacity < segments:
        capacity = segments
    lru = EndpointLRU(capacity, segments)
    for op, arg in steps:
        if op == "record":
            assert isinstance(arg, list)
            for h in arg:  # one at a time, so the bound is checked after every insert
                lru.record([h])
                assert len(lru) <= lru.capacity, f"{len(lru)} > {lru.capacity}"
        else:
            assert isinstance(arg, int)
            lru.resize(arg)
            assert len(lru) <= lru.capacity
        seen: set[int] = set()
        for g in lru.gens:
            assert not seen & set(g), "a hash lives in one segment only"
            seen |= set(g)


def _naive_match(lru: EndpointLRU, hashes: list[int]) -> int:
    n = 0
    while n < len(hashes) and any(hashes[n] in g for g in lru.gens):
        n += 1
    return n


@settings(max_examples=300)
@given(
    st.integers(6, 60),
    st.integers(2, 6),
    st.lists(
        st.tuples(st.sampled_from(["record", "discard", "match"]), st.lists(st.integers(0, 40), max_size=50))
    ),
)
def test_match_equals_a_block_by_block_walk(
    capacity: int, segments: int, steps: list[tuple[str, list[int]]]
) -> None:
    """``match`` finds what a walk over every block and every segment finds, whatever records and
    discards came before."""
    capacity = max(capacity, segments)
    lru, plain = EndpointLRU(capacity, segments), EndpointLRU(capacity, segments)
    for op, hashes in steps:
        if op == "match":
            assert lru.match(hashes) == _naive_match(plain, hashes)
            assert lru.match(hashes) == plain.match(list(hashes))
        else:
            getattr(lru, op)(hashes)
            getattr(plain, op)(list(hashes))
        assert [list(g) for g in lru.gens] == [list(g) for g in plain.gens]


def test_match_across_alternating_segments() -> None:
    """A prompt whose blocks alternate between two segments is matched whole."""
    lru = EndpointLRU(40, 2)  # two segments of 20
    lru.record(list(range(0, 20, 2)) + list(range(100, 110)))  # the evens, then fillers: full
    lru.record(list(range(1, 20, 2)))  # the odds open a new segment
    assert [sorted(g)[:3] for g in lru.gens] == [[0, 2, 4], [1, 3, 5]]
    assert lru.match(list(range(20))) == _naive_match(lru, list(range(20))) == 20
    assert lru.match([*range(20), 999, 0]) == 20


chains = st.lists(st.integers(0, 60), max_size=30)
between = st.lists(
    st.one_of(
        st.tuples(st.just("record"), chains),
        st.tuples(st.just("discard"), chains),
        st.tuples(st.just("resize"), st.integers(1, 80)),
        st.tuples(st.just("match"), chains),
    ),
    max_size=3,
)


@settings(max_examples=400)
@given(st.integers(2, 60), st.integers(2, 5), st.lists(st.tuples(chains, between), max_size=25))
@example(8, 2, [([1, 2, 3], []), ([1, 2, 3], [("record", [10, 11])])])  # a roll in between
@example(8, 2, [([1, 2, 3], []), ([1, 2, 3], [("discard", [2])])])
@example(8, 2, [([1, 2, 3], []), ([1, 2, 3], [("resize", 12)])])
def test_record_after_match_equals_a_plain_record(
    capacity: int, segments: int, picks: list[tuple[list[int], list[tuple[str, object]]]]
) -> None:
    """A record that skips the blocks its match found in the newest segment leaves the LRU exactly
    as a record that walks them all: same blocks, same segments, same order, whatever happened
    between the match and the record (other records, rolls, discards, resizes, other matches)."""
    capacity = max(capacity, segments)
    skipping, plain = EndpointLRU(capacity, segments), EndpointLRU(capacity, segments)
    for hashes, ops_between in picks:
        assert skipping.match(hashes) == plain.match(list(hashes))
        for op, arg in ops_between:
            for lru in (skipping, plain):
                if op == "resize":
                    assert isinstance(arg, int)
                    lru.resize(arg)
                else:
                    assert isinstance(arg, list)
                    getattr(lru, op)(list(arg))  # a different list: never the matched one
        skipping.record(hashes)
        plain.record(list(hashes))  # a copy: nothing to skip
        assert [list(g) for g in skipping.gens] == [list(g) for g in plain.gens]


@settings(max_examples=200)
@given(st.integers(4, 100), st.integers(2, 4), st.lists(st.integers(0, 10_000), max_size=300))
def test_lru_keeps_the_most_recent(capacity: int, segments: int, stream: list[int]) -> None:
    """With refreshes, the most recent ``seg_cap`` distinct blocks survive; with distinct blocks
    only, the most recent ``(segments - 1) * seg_cap`` do."""
    seg_cap = capacity // segments
    lru = EndpointLRU(capacity, segments)
    for h in stream:
        lru.record([h])
    recent = list(dict.fromkeys(reversed(stream)))
    assert all(h in lru for h in recent[:seg_cap])
    fresh = EndpointLRU(capacity, segments)
    distinct = list(dict.fromkeys(stream))
    fresh.record(distinct)
    assert all(h in fresh for h in distinct[::-1][: (segments - 1) * seg_cap])


@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.sampled_from("abcd"), st.lists(st.integers(0, 50), max_size=20)), max_size=40),
    st.sampled_from("abcd"),
)
def test_index_remove_drops_all_entries(records: list[tuple[str, list[int]]], gone: str) -> None:
    idx = PrefixIndex(default_capacity=32, segments=4)
    for key, hs in records:
        idx.record(key, hs)
    before = {k: idx.size(k) for k in "abcd"}
    idx.remove(gone)
    assert idx.size(gone) == 0 and gone not in list(idx.keys())
    assert idx.size() == sum(v for k, v in before.items() if k != gone), "others keep their entries"
    for _, hs in records:
        assert idx.match(gone, hs) == 0


@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 200)), max_size=20),
    st.lists(st.integers(0, 500), max_size=400),
)
def test_index_set_capacity_bounds_each_endpoint(caps: list[tuple[str, int]], stream: list[int]) -> None:
    idx = PrefixIndex(default_capacity=64, segments=4)
    for i, h in enumerate(stream):
        if caps and i % 20 == 0:
            key, cap = caps[(i // 20) % len(caps)]
            idx.set_capacity(key, cap)
        key = "ab"[h % 2]
        idx.record(key, [h])
        for k in "ab":
            lru = idx._lrus.get(k)
            assert lru is None or len(lru) <= lru.capacity


@settings(max_examples=200)
@given(texts, st.integers(1, 16))
def test_match_length_monotone_in_shared_prefix(text: str, block_size: int) -> None:
    """Record ``text``; a query sharing a longer text prefix never matches fewer blocks."""
    cfg = HashConfig(block_size=block_size, max_blocks=64)
    idx = PrefixIndex(default_capacity=10_000)
    idx.record("e", block_hashes(text, SEED, cfg))
    last = -1
    for j in range(len(text) + 1):
        # diverge right after j characters, in the first byte of the next character
        nxt = text[j : j + 1].encode()[:1]
        query = text[:j] + ("\x01" if nxt == b"\x00" else "\x00") + "q" * block_size
        n = idx.match("e", block_hashes(query, SEED, cfg))
        assert n >= last, f"shared {j} chars matched {n} blocks, fewer than {last} for a shorter prefix"
        assert n == min(len(text[:j].encode()) // block_size, cfg.max_blocks)
        last = n
    assert idx.match("e", block_hashes(text, SEED, cfg)) == len(block_hashes(text, SEED, cfg))


def test_match_stops_at_first_miss() -> None:
    lru = EndpointLRU(100)
    lru.record([1, 2, 3, 5])
    assert lru.match([1, 2, 3, 4, 5]) == 3
    assert lru.match([9, 1, 2]) == 0
    assert lru.match([]) == 0


def test_refresh_moves_a_block_to_the_newest_segment() -> None:
    lru = EndpointLRU(8, segments=4)  # two blocks per segment
    lru.record([1, 2, 3, 4, 5, 6])
    lru.record([1])  # refresh the oldest
    lru.record([7, 8, 9, 10])
    assert 1 in lru and 2 not in lru and 3 not in lru


@pytest.mark.parametrize(("capacity", "segments"), [(1, 2), (3, 4), (10, 1)])
def test_lru_rejects_bad_shapes(capacity: int, segments: int) -> None:
    with pytest.raises(AssertionError, match="capacity >= segments >= 2"):
        EndpointLRU(capacity, segments)


def test_resize_keeps_the_newest_blocks() -> None:
    lru = EndpointLRU(100, segments=4)
    lru.record(range(1, 101))
    lru.resize(40)  # seg_cap 10: three full old segments fit
    assert len(lru) == 30 and all(h in lru for h in range(71, 101))
    lru.record(range(200, 260))
    assert len(lru) <= 40
    lru.resize(400)
    assert lru.capacity == 400 and all(h in lru for h in range(230, 260)), "growing keeps everything"


# ---- the hash memo -------------------------------------------------------------------------------


@settings(max_examples=300)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2000), st.binary(max_size=300)), max_size=12),
    st.binary(min_size=1, max_size=1500),
    st.integers(1, 48),
    st.integers(1, 64),
    st.integers(1, 3),
)
def test_memo_equals_direct_hashing(
    edits: list[tuple[int, int, bytes]], base: bytes, block_size: int, max_blocks: int, entries: int
) -> None:
    """Texts derived from a common base (cut at a point and given a new tail) hash exactly as the
    plain hasher does, whatever the memo remembers."""
    cfg = HashConfig(block_size=block_size, max_blocks=max_blocks)
    memo = HashMemo(cfg, entries=entries)
    base = base * (1 + 2000 // len(base))
    for seed_n, cut, tail in edits:
        data = base[:cut] + tail
        seed = seed_for("m", salt=str(seed_n))
        assert memo.hashes(data, seed) == block_hashes(data, seed, cfg)
        assert memo.hashes(data, seed) == block_hashes(data, seed, cfg), "an exact repeat too"
    assert len(memo._memo) <= entries


@given(st.binary(max_size=200), st.binary(max_size=200))
def test_common_prefix(a: bytes, b: bytes) -> None:
    n = common_prefix(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]

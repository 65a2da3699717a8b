"""Property tests for chained block hashing and the segmented per-endpoint LRU index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
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


def _full_record(lru: EndpointLRU, hashes: list[int]) -> None:
    """``EndpointLRU.record`` without its early stop: every block of the path, deepest first."""
    gens = lru.gens
    for h in reversed(hashes):
        if h in gens[-1]:
            continue
        for g in gens[-2::-1]:
            if g.pop(h, 0) is None:
                break
        gens[-1][h] = None
        if len(gens[-1]) >= lru.seg_cap:
            gens.pop(0)
            gens.append({})


class _Tree:
    """Paths of chained hashes: a path is a list of branch choices, and block ``i``'s hash names
    the choices ``0..i`` (as :func:`block_hashes` names a text's first ``i + 1`` blocks)."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, ...], int] = {}

    def path(self, choices: list[int]) -> list[int]:
        return [self.ids.setdefault(tuple(choices[: i + 1]), len(self.ids)) for i in range(len(choices))]


def _closed(lru: EndpointLRU, tree: _Tree) -> bool:
    """Closure (index.py's docstring): every held block's parent is held in the same segment or
    a newer one."""
    seg = {h: i for i, g in enumerate(lru.gens) for h in g}
    return all(
        seg.get(tree.ids[k[:-1]], -1) >= seg[h] for k, h in tree.ids.items() if len(k) > 1 and h in seg
    )


paths = st.lists(st.integers(0, 2), max_size=30)  # few branches: paths share long prefixes


@settings(max_examples=400)
@given(
    st.integers(2, 60),
    st.integers(2, 5),
    st.lists(st.tuples(st.sampled_from(["record", "match"]), paths), max_size=60),
)
def test_paths_stay_closed_and_match_equals_a_block_by_block_walk(
    capacity: int, segments: int, steps: list[tuple[str, list[int]]]
) -> None:
    """Whatever paths were recorded (and however the segments rolled in the middle of one),
    every held block's prefix is held, ``match`` (a binary search per segment) finds what a walk
    over every block and every segment finds, ``match_many`` agrees with it, and the record that
    stops at the first block in the newest segment leaves the LRU as a full walk does."""
    capacity = max(capacity, segments)
    tree = _Tree()
    lru, full = EndpointLRU(capacity, segments), EndpointLRU(capacity, segments)
    idx = PrefixIndex(capacity, segments)
    for op, choices in steps:
        hashes = tree.path(choices)
        if op == "match":
            n = _naive_match(lru, hashes)
            assert lru.match(hashes) == n
            assert idx.match_many(["e", "other"], hashes) == {"e": n, "other": 0}
        else:
            lru.record(hashes)
            _full_record(full, hashes)
            idx.record("e", hashes)
            assert _closed(lru, tree)
            assert [list(g) for g in lru.gens] == [list(g) for g in full.gens]
            assert lru.match(hashes) == len(hashes) or len(hashes) > (segments - 1) * lru.seg_cap


@settings(max_examples=200)
@given(st.integers(4, 60), st.lists(paths, max_size=20), st.integers(1, 80), paths)
def test_a_record_after_a_resize_closes_its_path(
    capacity: int, before: list[list[int]], new_capacity: int, choices: list[int]
) -> None:
    """A resize can split a path between segments; the next record of a path holds it whole
    (the newest segment is empty after a resize, so the record walks down to the root)."""
    tree = _Tree()
    lru = EndpointLRU(capacity, 4)
    for c in before:
        lru.record(tree.path(c))
    lru.resize(new_capacity)
    hashes = tree.path(choices)
    lru.record(hashes)
    if len(hashes) < lru.seg_cap:  # a path longer than a segment rolls while it is recorded
        assert lru.match(hashes) == _naive_match(lru, hashes) == len(hashes)


def test_a_path_across_two_segments_is_matched_whole() -> None:
    """A path recorded as the newest segment fills: its deepest blocks land in the older
    segment, its head in the newest, and it is matched whole; the head outlives the tail."""
    lru = EndpointLRU(40, 2)  # two segments of 20
    lru.record(list(range(100, 110)))  # ten fillers
    path = list(range(20))
    lru.record(path)  # 19..10 fill the newest segment, which rolls; 9..0 open the next
    assert sorted(lru.gens[0])[:3] == [10, 11, 12] and sorted(lru.gens[1]) == list(range(10))
    assert lru.match(path) == _naive_match(lru, path) == 20
    assert lru.match([*path, 999]) == 20
    lru.record(list(range(200, 220)))  # rolls: the tail's segment goes, the head stays
    assert lru.match(path) == 10


@settings(max_examples=200)
@given(st.integers(4, 100), st.integers(2, 4), st.lists(st.integers(0, 10_000), max_size=300))
def test_lru_keeps_the_most_recent(capacity: int, segments: int, stream: list[int]) -> None:
    """With refreshes, the most recent ``seg_cap`` distinct blocks survive; with distinct blocks
    only, the most recent ``(segments - 1) * seg_cap`` do (a path's head is recorded last)."""
    seg_cap = capacity // segments
    lru = EndpointLRU(capacity, segments)
    for h in stream:
        lru.record([h])
    recent = list(dict.fromkeys(reversed(stream)))
    assert all(h in lru for h in recent[:seg_cap])
    fresh = EndpointLRU(capacity, segments)
    distinct = list(dict.fromkeys(stream))
    fresh.record(distinct)
    assert all(h in fresh for h in distinct[: (segments - 1) * seg_cap])


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
    lru.record([1, 2, 3])
    assert lru.match([1, 2, 3, 4, 5]) == 3
    assert lru.match([1, 2]) == 2
    assert lru.match([9, 10]) == 0
    assert lru.match([]) == 0


def test_refresh_moves_a_block_to_the_newest_segment() -> None:
    lru = EndpointLRU(8, segments=4)  # two blocks per segment
    for h in [1, 2, 3, 4, 5, 6]:
        lru.record([h])
    lru.record([1])  # refresh the oldest
    for h in [7, 8, 9, 10]:
        lru.record([h])
    assert 1 in lru and 2 not in lru and 3 not in lru


@pytest.mark.parametrize(("capacity", "segments"), [(1, 2), (3, 4), (10, 1)])
def test_lru_rejects_bad_shapes(capacity: int, segments: int) -> None:
    with pytest.raises(AssertionError, match="capacity >= segments >= 2"):
        EndpointLRU(capacity, segments)


def test_resize_keeps_the_newest_blocks() -> None:
    lru = EndpointLRU(100, segments=4)
    for h in range(1, 101):
        lru.record([h])
    lru.resize(40)  # seg_cap 10: three full old segments fit
    assert len(lru) == 30 and all(h in lru for h in range(71, 101))
    lru.record(range(200, 260))
    assert len(lru) <= 40
    lru.resize(400)
    assert lru.capacity == 400 and all(h in lru for h in range(200, 230)), "growing keeps everything"


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

"""Approximate prefix index: which endpoint has recently been sent which blocks.

Each endpoint has a bounded, segmented LRU of block hashes (:class:`EndpointLRU`):

- ``gens`` is a list of ``segments`` dicts, newest last. A recorded block is moved into the
  newest segment. When the newest segment holds ``capacity // segments`` blocks, the oldest
  segment is dropped whole and a new one is opened.
- Invariant (asserted): an endpoint never holds more than ``capacity`` blocks. Every block put
  into the newest segment by the last ``(segments - 1) * seg_cap`` insertions is retained (moving
  a block up from an older segment counts as an insertion): exact LRU at segment granularity.
  With no refreshes that is the most recent ``(segments - 1) * seg_cap`` distinct blocks; with
  refreshes, never fewer than the most recent ``seg_cap``.
- Why dicts made afresh and dropped whole: measured 141 B per entry for an ``OrderedDict``, and
  about 136 B for one dict of block -> segment under churn (deleted slots keep it at twice the
  size), against about 70 B here with 60-bit int keys; ``python -m bench.picker`` reports the
  index's bytes per entry.

**Closure.** The hashes are chained (:mod:`picker.core.prefix.hashing`): block ``i``'s hash names
its whole prefix, so a recorded list is always a path from a root. ``record`` inserts a path
deepest block first, so every block's parent sits in the same segment as the block or a newer
one: along a path the segments never get newer. The LRU therefore loses a path's tail before its
head, as vLLM's prefix cache does (it evicts a freed sequence's last blocks first), and a block
held means its whole prefix is held. Lookups rely on that. ``match`` takes the segments newest
first; where the path's next block is in one, the run of blocks there is found by binary search
(``bisect`` over the reversed path, in C): a handful of membership tests per holder instead of
one per block. ``record`` stops at the first block it finds in the newest segment (its ancestors
are there too). Two rare operations can break closure for a path: ``resize`` re-cuts the
segments (a path's head can land in an older one than its tail), and ``discard`` takes a pick's
new blocks back while a later pick through them still holds deeper ones. ``match`` then returns
the edge of a held run, possibly past the gap, until the path is recorded again (after a resize
the first record heals it: the newest segment is empty then) or evicted.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence


class EndpointLRU:
    """One endpoint's segmented LRU (the module docstring). Writer: the router that owns the
    :class:`PrefixIndex` (its picks, a peer's picks, recredits); one thread."""

    __slots__ = ("capacity", "gens", "seg_cap")

    def __init__(self, capacity: int, segments: int = 4) -> None:
        assert capacity >= segments >= 2, f"need capacity >= segments >= 2, got {capacity}, {segments}"
        self.capacity = capacity
        self.seg_cap = capacity // segments
        self.gens: list[dict[int, None]] = [{} for _ in range(segments)]

    def __len__(self) -> int:
        return sum(len(g) for g in self.gens)

    def __contains__(self, h: int) -> bool:
        return any(h in g for g in reversed(self.gens))

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading ``hashes`` held (closure, module docstring: the first ``n`` blocks
        are held and block ``n`` is not)."""
        return self.depth(hashes, hashes[::-1])

    def depth(self, hashes: Sequence[int], rev: Sequence[int]) -> int:
        """:meth:`match`, given ``rev = hashes[::-1]`` (made once per request by
        :meth:`PrefixIndex.match_many`). Hot path: once per holder per request.

        ``d`` blocks found so far; each segment, newest first, holds either nothing more of the
        path (block ``d`` is not in it: one test) or a run from ``d`` on, whose end the bisect
        finds: in ``rev[:n - d]`` the blocks in the segment are a suffix."""
        n, d = len(hashes), 0
        for g in reversed(self.gens):
            if d < n and hashes[d] in g:
                d = n - bisect_left(rev, True, 0, n - d, key=g.__contains__)
        return d

    def record(self, hashes: Sequence[int]) -> None:
        """Insert or refresh the path ``hashes`` as most recently used, deepest block first
        (closure). Stops at the first block already in the newest segment: by closure its
        ancestors are there too, so a repeated prompt costs one lookup."""
        gens, seg_cap = self.gens, self.seg_cap
        newest, older = gens[-1], gens[-2::-1]  # a refreshed block is likeliest in the newer ones
        for i in range(len(hashes) - 1, -1, -1):
            h = hashes[i]
            if h in newest:
                break
            for g in older:
                if g.pop(h, 0) is None:  # stored values are None; 0 means absent
                    break
            newest[h] = None
            if len(newest) >= seg_cap:
                gens.pop(0)
                newest = {}
                gens.append(newest)
                older = gens[-2::-1]
        assert len(self) <= self.capacity, f"LRU holds {len(self)} blocks > capacity {self.capacity}"

    def discard(self, hashes: Iterable[int]) -> None:
        """Forget ``hashes`` (a pick credited here that another endpoint served: the blocks it
        added, a path's tail, so closure holds unless a later pick went through them)."""
        for h in hashes:
            for g in self.gens:
                if g.pop(h, 0) is None:
                    break

    def resize(self, capacity: int) -> None:
        """Change the capacity. Keeps the most recent blocks that fit in ``segments - 1`` segments
        of the new size, re-cut oldest first, with an empty newest segment: every old segment then
        holds at most ``seg_cap`` blocks, so later inserts cannot overshoot the bound. (The cut
        can split a path: module docstring, closure.)"""
        segments = len(self.gens)
        self.capacity = max(capacity, segments)
        self.seg_cap = seg_cap = self.capacity // segments
        kept = [h for g in self.gens for h in g]  # oldest first
        kept = kept[max(0, len(kept) - (segments - 1) * seg_cap) :]
        cut = [dict.fromkeys(kept[i : i + seg_cap]) for i in range(0, len(kept), seg_cap)]
        empty: list[dict[int, None]] = [{} for _ in range(segments - 1 - len(cut))]
        self.gens = [*empty, *cut, {}]


class PrefixIndex:
    """Per-endpoint LRUs keyed by endpoint key (``"ip:port"``)."""

    def __init__(self, default_capacity: int, segments: int = 4) -> None:
        self.default_capacity = default_capacity
        self.segments = segments
        self._lrus: dict[str, EndpointLRU] = {}

    def match(self, key: str, hashes: Sequence[int]) -> int:
        lru = self._lrus.get(key)
        return lru.match(hashes) if lru is not None else 0

    def match_many(self, keys: Iterable[str], hashes: Sequence[int]) -> dict[str, int]:
        """``{key: match(key, hashes)}`` for every key: :meth:`EndpointLRU.depth` inlined (it
        runs for every candidate of every request), with the reversed list it searches made once
        for all of them. Most endpoints hold no block of the path, which costs one test per
        segment."""
        n = len(hashes)
        if not n:
            return dict.fromkeys(keys, 0)
        rev = hashes[::-1]
        lrus = self._lrus
        out: dict[str, int] = {}
        for key in keys:
            lru = lrus.get(key)
            d = 0
            if lru is not None:
                for g in reversed(lru.gens):
                    if d < n and hashes[d] in g:
                        d = n - bisect_left(rev, True, 0, n - d, key=g.__contains__)
            out[key] = d
        return out

    def record(self, key: str, hashes: Sequence[int]) -> None:
        lru = self._lrus.get(key)
        if lru is None:
            lru = self._lrus[key] = EndpointLRU(self.default_capacity, self.segments)
        lru.record(hashes)

    def discard(self, key: str, hashes: Sequence[int]) -> None:
        lru = self._lrus.get(key)
        if lru is not None and hashes:
            lru.discard(hashes)

    def set_capacity(self, key: str, capacity: int) -> None:
        lru = self._lrus.get(key)
        if lru is None:
            self._lrus[key] = EndpointLRU(max(capacity, self.segments), self.segments)
        elif lru.capacity != capacity:
            lru.resize(capacity)

    def remove(self, key: str) -> None:
        self._lrus.pop(key, None)

    def size(self, key: str | None = None) -> int:
        if key is not None:
            lru = self._lrus.get(key)
            return len(lru) if lru is not None else 0
        return sum(len(lru) for lru in self._lrus.values())

    def keys(self) -> list[str]:
        return list(self._lrus)

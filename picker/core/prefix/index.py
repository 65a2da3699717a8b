"""Approximate prefix index: which endpoint has recently been sent which blocks.

Each endpoint has a bounded, segmented LRU of block hashes:

- ``gens`` is a list of ``segments`` dicts, newest last. A recorded or matched block is moved
  into the newest segment. When the newest segment holds ``capacity // segments`` blocks, the
  oldest segment is dropped whole and a new one is opened.
- Invariant (asserted): an endpoint never holds more than ``capacity`` blocks. Every block put
  into the newest segment by the last ``(segments - 1) * seg_cap`` insertions is retained (moving
  a block up from an older segment counts as an insertion): exact LRU at segment granularity.
  With no refreshes that is the most recent ``(segments - 1) * seg_cap`` distinct blocks; with
  refreshes, never fewer than the most recent ``seg_cap``.
- Why not ``OrderedDict``: measured 141 B per entry against about 88 B for a plain dict with
  60-bit int keys; ``python -m bench.picker`` reports the index's bytes per entry.

Lookups walk the chained hashes from the first block and stop at the first miss, so a match
length ``k`` means "the first ``k`` blocks were sent to this endpoint".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice


class EndpointLRU:
    """One endpoint's segmented LRU (the module docstring).

    ``record`` right after ``match`` of the same hash list (the pick, then its record) skips the
    blocks ``match`` found leading in the newest segment: refreshing them would change nothing.
    Every change to the LRU in between (a record, a discard, a resize) drops what ``match`` saw,
    so the skip applies only where nothing can have taken a block out of the newest segment."""

    __slots__ = ("_fresh", "capacity", "gens", "seg_cap")

    def __init__(self, capacity: int, segments: int = 4) -> None:
        assert capacity >= segments >= 2, f"need capacity >= segments >= 2, got {capacity}, {segments}"
        self.capacity = capacity
        self.seg_cap = capacity // segments
        self.gens: list[dict[int, None]] = [{} for _ in range(segments)]
        self._fresh: tuple[Sequence[int], int] | None = None
        """``(hashes, n)``: the last ``match`` found ``hashes[:n]`` in the newest segment, and the
        LRU has not changed since. The list is held (not its id: a freed list's id is reused)
        until the next match or change here: one list per endpoint at most."""

    def __len__(self) -> int:
        return sum(len(g) for g in self.gens)

    def __contains__(self, h: int) -> bool:
        return any(h in g for g in reversed(self.gens))

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading ``hashes`` present (stops at the first miss).

        Hot path (once per endpoint per request): the newest segment is probed first, and the
        older ones with a plain loop rather than a generator, so a miss costs a few lookups."""
        gens = self.gens
        newest = gens[-1]
        older = gens[-2::-1]
        n, fresh = 0, -1
        for h in hashes:
            if h not in newest:
                if fresh < 0:
                    fresh = n
                for g in older:
                    if h in g:
                        break
                else:
                    break
            n += 1
        self._fresh = (hashes, n if fresh < 0 else fresh)
        return n

    def record(self, hashes: Sequence[int]) -> None:
        """Insert or refresh ``hashes`` as most recently used. The leading blocks the last
        ``match`` of this same list found in the newest segment are skipped, if the LRU has not
        changed since (the class docstring)."""
        fresh, self._fresh = self._fresh, None
        skip = fresh[1] if fresh is not None and fresh[0] is hashes else 0
        gens, seg_cap = self.gens, self.seg_cap
        newest, older = gens[-1], gens[-2::-1]  # a refreshed block is likeliest in the newer ones
        for h in islice(hashes, skip, None) if skip else hashes:
            if h in newest:
                continue
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
        """Forget ``hashes`` (a pick credited here that another endpoint served)."""
        self._fresh = None
        for h in hashes:
            for g in self.gens:
                if g.pop(h, 0) is None:
                    break

    def resize(self, capacity: int) -> None:
        """Change the capacity. Keeps the most recent blocks that fit in ``segments - 1`` segments
        of the new size, re-cut oldest first, with an empty newest segment: every old segment then
        holds at most ``seg_cap`` blocks, so later inserts cannot overshoot the bound."""
        segments = len(self.gens)
        self._fresh = None
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
        """``{key: match(key, hashes)}`` for every key. Most endpoints miss on the first block,
        so that probe is done inline before the full walk."""
        if not hashes:
            return dict.fromkeys(keys, 0)
        first = hashes[0]
        lrus = self._lrus
        out: dict[str, int] = {}
        for key in keys:
            lru = lrus.get(key)
            if lru is None:
                out[key] = 0
                continue
            for g in lru.gens:
                if first in g:
                    out[key] = lru.match(hashes)
                    break
            else:
                out[key] = 0
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

"""Precise prefix index: which endpoint holds which KV blocks, from the replicas' own KV events.

Keys are our own, recomputed from token ids (never the engine's hash, whose seed and algorithm
the picker does not depend on):

- ``key[i] = xxh64(tokens of block i as uint32, seed=key[i-1] ^ xxh64(msgpack(extra_i)))``,
  masked to 60 bits, with ``key[-1] = 0`` and ``extra_i`` the block's untagged extra keys as vLLM
  publishes them in ``BlockStored.extra_keys`` (the LoRA name on every block, the cache salt on
  block 0 only, in that order; none: no fold). A request computes the same extras from its LoRA
  adapter and salt, so request keys and event keys agree whatever vLLM's hash algorithm is.
- Both paths go through :func:`chain_keys` (one ``array('I')`` conversion of all the tokens, one
  xxh64 call per block, the chain carried in the seed): a key depends on every token and every
  extra up to the end of its block and on nothing after it. Peers exchange keys (picks), so every
  picker must run this same scheme.
- Collision resistance: 60 bits of a non-cryptographic hash. Accidental collisions among N keys
  have probability about N² / 2^61 (1e-7 at a million keys). There is no secret in the chain, so a
  client can craft a prompt whose keys collide with another prefix's. That only misroutes: a
  predicted hit that is not one costs a cold prefill, and the speculative entries it leaves
  mislead others for ``spec_ttl_s``. The engine's own hash decides what is really reused, so no
  wrong KV is ever served.

State, one writer each:

- ``_held[slot]``: engine hash → our key, written by :meth:`stored` / :meth:`removed` /
  :meth:`clear` (the endpoint's KV-event subscriber); ``_copies[slot]``: engine hash → extra
  engine blocks carrying it (vLLM may cache one hash twice and then sends one ``BlockRemoved``
  per block; rare, so kept apart to keep ``_held`` small).
- ``_mask``: our key → bitmask of slots holding it, and ``_dup`` (keys carried by more than one
  engine hash): derived from ``_held``, same writer.
- ``_spec_mask`` / ``_spec_until``: speculative entries, written by :meth:`speculate` (the router,
  at pick time) and expired lazily by :meth:`match`; :meth:`forget` (an endpoint restarted) and
  :meth:`remove` (it left the pool) drop an endpoint's all at once. ``_spec_until[slot]`` maps
  each key to its :class:`Run`: keys speculated together share one expiry object, so that a pick
  that re-sends a held prefix (the next turn of a conversation, another question on a document)
  re-times that prefix's keys by one assignment instead of one dict write per key, and a look-up
  steps over them by one tuple comparison (below).

Invariants (``check``): bit ``s`` of ``_mask[k]`` is set iff some entry of ``_held[s]`` maps to
``k``; an endpoint never holds more than ``max_blocks`` engine hashes (past that it is dropped as
out of sync: we must have missed removals); speculative entries number at most ``max_speculative``.

A lookup walks the request's keys once for all endpoints at a time (AND of bitmasks), so its cost
is O(blocks), not O(blocks × endpoints); once at most ``FEW`` endpoints still match (a held
prompt is usually on one or two), each of those goes on alone: over a whole speculative
:class:`Run` that the keys repeat, in one step; then through C-level scans of its runs of held
keys (:meth:`PreciseIndex._depth`). Either way an endpoint's match is the number of leading keys
it holds, confirmed or speculatively (property tests hold it to a naive walk, and the runs to a
per-key model of the speculative entries: ``tests/precise/test_spec_runs.py``).
"""

from __future__ import annotations

import enum
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, count, islice, repeat
from operator import not_
from typing import Any

import msgpack
import xxhash

MASK60 = (1 << 60) - 1
FEW = 4
"""A look-up walks the keys for all endpoints at once while more than this many still match,
then each of those left alone (:meth:`PreciseIndex._depth`)."""
RUNS = 8
"""Runs of keys held one way (speculatively, by events) scanned at C level per endpoint; past
them (keys held alternately), key by key."""


def extra_seed(extra: Sequence[Any] | None) -> int:
    """The fold of one block's extra keys into its chain (0: none)."""
    if not extra:
        return 0
    return xxhash.xxh64_intdigest(msgpack.packb(list(extra), use_bin_type=True)) & MASK60


def chain_keys(
    tokens: Sequence[int],
    block_size: int,
    extras: Sequence[Sequence[Any] | None] | None = None,
    parent: int = 0,
) -> list[int]:
    """Our keys of the full blocks of ``tokens`` chained after ``parent`` (0: the first block).
    ``extras[i]`` is block ``i``'s extra keys (None or missing: none).

    Per block: one xxh64 call over a slice of one C-level conversion of all the tokens (no
    per-block pack), the chain carried in the seed; an extra's fold is computed once per run of
    equal extras (a LoRA name repeats on every block), not once per block."""
    n = len(tokens) // block_size
    if n == 0:
        return []
    whole = n * block_size
    data = array("I", tokens if len(tokens) == whole else tokens[:whole]).tobytes()
    step = block_size * 4
    xxh = xxhash.xxh64_intdigest
    h = parent
    if not extras or not any(extras):
        return [h := xxh(data[off : off + step], h) & MASK60 for off in range(0, len(data), step)]
    seeds: list[int] = []
    last: Sequence[Any] | None = None
    fold = 0
    for i in range(n):
        e = extras[i] if i < len(extras) else None
        if e is not last and e != last:
            last, fold = e, extra_seed(e)
        seeds.append(fold)
    return [
        h := xxh(data[off : off + step], h ^ fold) & MASK60
        for off, fold in zip(range(0, len(data), step), seeds, strict=True)
    ]


def request_keys(tokens: Sequence[int], block_size: int, lora: str = "", salt: str = "") -> list[int]:
    """Keys of a request's full prompt blocks, with the extras vLLM folds for it: the LoRA name on
    every block, the cache salt on block 0."""
    n = len(tokens) // block_size
    if n == 0:
        return []
    if not lora and not salt:
        return chain_keys(tokens, block_size)
    first: list[str] | None = [x for x in (lora, salt) if x]
    extras: list[list[str] | None] = [first, *[[lora] if lora else None] * (n - 1)]
    return chain_keys(tokens, block_size, extras)


def continue_keys(
    keys: Sequence[int], rest: Sequence[int], block_size: int, lora: str = "", salt: str = ""
) -> list[int]:
    """The keys of the full blocks of ``rest``, the tokens that follow the ``len(keys)`` blocks
    whose request keys are ``keys``, chained from the last of them:
    ``request_keys(t, ...) == [*keys, *continue_keys(keys, t[len(keys) * block_size:], ...)]``
    when ``keys == request_keys(t[:len(keys) * block_size], ...)``. Only ``rest`` is hashed (a
    held prefix's keys are reused, e.g. from the tokenization cache)."""
    if not keys:
        return request_keys(rest, block_size, lora, salt)
    n = len(rest) // block_size
    if n == 0:
        return []
    return chain_keys(rest, block_size, [[lora]] * n if lora else None, keys[-1])


class Run:
    """Keys speculated on one endpoint that share one expiry (one slot's ``_spec_until`` values).

    ``keys``: a stretch of one speculation's keys, in order; ``exp``: the expiry of every key that
    maps to this run; ``owned``: how many keys map to it. The run is *whole* when ``owned ==
    len(keys)``: then its keys are distinct and every one maps to it, so a speculation that repeats
    ``keys`` may re-time them all by setting ``exp``, and a look-up may step over them at once.
    A key speculated again apart from its run leaves it (``owned`` drops: no longer whole).
    Writer: :class:`PreciseIndex` only (its speculate / expire / drop). Memory: the ``keys`` tuple
    (slots shared with the queued speculations' tuples' int objects) lives while one key maps to
    the run; a run's keys are a stretch of a speculation still queued, so the runs hold at most as
    many slots as the queue does."""

    __slots__ = ("exp", "keys", "owned")

    def __init__(self, exp: float, keys: tuple[int, ...] = (), owned: int = 0) -> None:
        self.exp, self.keys, self.owned = exp, keys, owned


def _shared(a: tuple[int, ...], b: tuple[int, ...], i: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b[i:]`` (C-level slice compares)."""
    lo, hi = 0, min(len(a), len(b) - i)
    while lo < hi:  # a[:lo] == b[i : i + lo], and the answer is at most hi
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[i + lo : i + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PreciseIndex:
    def __init__(
        self, max_blocks: int = 1_000_000, spec_ttl_s: float = 2.0, max_speculative: int = 1_000_000
    ):
        assert max_blocks > 0 and max_speculative >= 0 and spec_ttl_s >= 0, "bad precise index bounds"
        self.max_blocks, self.spec_ttl_s, self.max_speculative = max_blocks, spec_ttl_s, max_speculative
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._live_memo: tuple[int, tuple[str, ...], dict[int, str], int] | None = None
        """The last :meth:`_live` answer; :meth:`slot` and :meth:`remove` drop it."""
        self._held: dict[int, dict[Any, int]] = {}
        self._copies: dict[int, dict[Any, int]] = {}
        self._mask: dict[int, int] = {}
        self._dup: dict[int, dict[int, int]] = {}
        """Per slot: our key → engine hashes beyond the first that carry it (rarely non-empty)."""
        self._spec_mask: dict[int, int] = {}
        self._spec_until: dict[int, dict[int, Run]] = {}
        """Per slot: key → its run (the key's expiry is the run's ``exp``)."""
        self._spec_queue: deque[tuple[float, int, tuple[int, ...]]] = deque()
        """(expiry, slot, keys) per speculation, oldest first. The keys are a tuple: a tuple of ints
        is untracked by the cyclic GC after its first collection, so a full collection does not walk
        every queued key (a list of 100k-token prompt's keys would be walked in each)."""
        self._spec_count = 0
        self.block_size = 0
        """Tokens per block of the last ``BlockStored`` seen (what request keys must be cut by)."""
        self.dropped: dict[str, int] = {}
        """Times each endpoint was dropped for overflowing ``max_blocks`` (telemetry reads it)."""

    # --- endpoints -------------------------------------------------------------------------
    def slot(self, key: str) -> int:
        s = self._slots.get(key)
        if s is None:
            s = self._free_slots.pop() if self._free_slots else len(self._slots)
            self._slots[key] = s
            self._live_memo = None
            self._held[s] = {}
            self._copies[s] = {}
            self._dup[s] = {}
            self._spec_until[s] = {}
        return s

    def remove(self, key: str) -> None:
        """Forget an endpoint entirely (it left the pool); its slot is reused."""
        s = self._slots.get(key)
        if s is None:
            return
        self.clear(key)
        self._drop_speculative(s)
        del self._slots[key], self._held[s], self._copies[s], self._dup[s], self._spec_until[s]
        self._free_slots.append(s)
        self._live_memo = None

    def forget(self, key: str) -> None:
        """``key`` restarted: its cache is empty, and the requests picked for it before (the
        speculative entries) died with the old engine. Drop both."""
        s = self._slots.get(key)
        if s is None:
            return
        self.clear(key)
        self._drop_speculative(s)

    def clear(self, key: str) -> None:
        """Drop every confirmed entry of ``key`` (AllBlocksCleared, a restart, a gap)."""
        s = self._slots.get(key)
        if s is None:
            return
        bit, mask = 1 << s, self._mask
        for k in self._held[s].values():
            m = mask.get(k, 0) & ~bit
            if m:
                mask[k] = m
            else:
                mask.pop(k, None)
        self._held[s] = {}
        self._copies[s] = {}
        self._dup[s] = {}

    def size(self, key: str) -> int:
        s = self._slots.get(key)
        return len(self._held[s]) if s is not None else 0

    # --- events ----------------------------------------------------------------------------
    def stored(
        self,
        key: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        extras: Sequence[Sequence[Any] | None] | None,
    ) -> bool:
        """Apply one ``BlockStored``. Returns False (and stores nothing) when its parent block is
        unknown to us: its chain cannot be keyed."""
        s = self.slot(key)
        held = self._held[s]
        self.block_size = block_size
        parent = 0
        if parent_engine_hash is not None:
            p = held.get(parent_engine_hash)
            if p is None:
                return False
            parent = p
        keys = chain_keys(token_ids, block_size, extras, parent)
        assert len(keys) == len(engine_hashes), (
            f"{key}: BlockStored has {len(engine_hashes)} hashes for {len(token_ids)} tokens of {block_size}"
        )
        bit, mask, dup = 1 << s, self._mask, self._dup[s]
        copies = self._copies[s]
        mget = mask.get
        for eh, k in zip(engine_hashes, keys, strict=True):
            if eh in held:
                copies[eh] = copies.get(eh, 0) + 1
                continue
            held[eh] = k
            m = mget(k, 0)
            if m & bit:  # rare: two engine hashes for one key (e.g. keys we do not fold)
                dup[k] = dup.get(k, 0) + 1
            mask[k] = m | bit
        if len(held) > self.max_blocks:
            self.dropped[key] = self.dropped.get(key, 0) + 1
            self.clear(key)
        return True

    def removed(self, key: str, engine_hashes: Iterable[int]) -> None:
        s = self.slot(key)
        held, copies, dup, mask = self._held[s], self._copies[s], self._dup[s], self._mask
        keep, pop, mget = ~(1 << s), held.pop, mask.get
        for eh in engine_hashes:
            if copies:  # rare: checked per hash only while some hash is cached twice
                n = copies.get(eh)
                if n is not None:  # another engine block still carries this hash
                    if n > 1:
                        copies[eh] = n - 1
                    else:
                        del copies[eh]
                    continue
            k = pop(eh, None)
            if k is None:
                continue
            if dup and k in dup:  # rare: another engine hash still carries this key
                dup[k] -= 1
                if not dup[k]:
                    del dup[k]
                continue
            m = mget(k, 0) & keep
            if m:
                mask[k] = m
            else:
                mask.pop(k, None)

    # --- speculative entries ----------------------------------------------------------------
    def speculate(self, key: str, keys: Sequence[int], now: float) -> None:
        """Mark ``keys`` as held by ``key`` until ``now + spec_ttl_s`` (a pick just sent them).

        The same as setting each key's expiry to ``now + spec_ttl_s``: a stretch of ``keys`` that
        repeats a whole :class:`Run` re-times that run (one assignment; a run that ``keys`` repeat
        only in part is split first, the rest keeping its expiry); the other keys, one by one,
        join a new run."""
        if not keys or self.spec_ttl_s <= 0:
            return
        self._expire(now)
        s = self.slot(key)
        until, bit, smask = self._spec_until[s], 1 << s, self._spec_mask
        exp = now + self.spec_ttl_s
        sget, uget, n0 = smask.get, until.get, len(until)
        tk = tuple(keys)
        n, i = len(tk), 0
        while i < n:
            r = uget(tk[i])
            if r is not None and r.owned == len(r.keys) and r.keys[0] == tk[i]:  # a whole run starts here
                m = len(r.keys)
                j = m if tk[i : i + m] == r.keys else _shared(r.keys, tk, i)
                if j < m:  # keys repeats its first j keys only: the rest keeps its expiry apart
                    rest = Run(r.exp, r.keys[j:], m - j)
                    for k in rest.keys:
                        until[k] = rest
                    r.keys, r.owned = r.keys[:j], j
                r.exp = exp
                i += j
                continue
            start, new = i, Run(exp)  # a stretch no whole run starts at: its keys one by one
            while i < n:
                k = tk[i]
                r = uget(k)
                if r is not new:
                    if r is None:
                        smask[k] = sget(k, 0) | bit
                    elif i > start and r.owned == len(r.keys) and r.keys[0] == k:
                        break  # a whole run starts here
                    else:
                        r.owned -= 1
                    until[k] = new
                    new.owned += 1
                i += 1
            new.keys = tk[start:i]
        self._spec_count += len(until) - n0
        self._spec_queue.append((exp, s, tk))
        while self._spec_count > self.max_speculative and self._spec_queue:
            self._expire_one()

    def _expire(self, now: float) -> None:
        q = self._spec_queue
        while q and q[0][0] <= now:
            self._expire_one()

    def _expire_one(self) -> None:
        exp, s, keys = self._spec_queue.popleft()
        until = self._spec_until.get(s)
        if until is None:
            return
        keep, smask, uget, sget = ~(1 << s), self._spec_mask, until.get, self._spec_mask.get
        n0, i, n = len(until), 0, len(keys)
        while i < n:
            k = keys[i]
            r = uget(k)
            if r is None:
                i += 1
                continue
            if r.exp > exp:  # re-timed since: kept; a whole run re-timed is stepped over at once
                j = len(r.keys)
                i += j if r.owned == j and r.keys[0] == k and keys[i : i + j] == r.keys else 1
                continue
            del until[k]  # not re-timed since (a repeated key: gone the first time)
            r.owned -= 1
            m = sget(k, 0) & keep
            if m:
                smask[k] = m
            else:
                smask.pop(k, None)
            i += 1
        self._spec_count -= n0 - len(until)

    def _drop_speculative(self, s: int) -> None:
        bit, smask = 1 << s, self._spec_mask
        for k in self._spec_until[s]:
            m = smask.get(k, 0) & ~bit
            if m:
                smask[k] = m
            else:
                smask.pop(k, None)
        self._spec_count -= len(self._spec_until[s])
        self._spec_until[s] = {}

    # --- lookup ----------------------------------------------------------------------------
    def match_many(self, endpoints: Iterable[str], keys: Sequence[int], now: float) -> dict[str, int]:
        """``{endpoint: leading blocks of keys it holds}`` (confirmed or speculative)."""
        self._expire(now)
        names = tuple(endpoints)
        out = dict.fromkeys(names, 0)
        live, mask = self._live(names)
        cget, sget = self._mask.get, self._spec_mask.get
        depth = 0
        if mask.bit_count() > FEW:
            for k in keys:
                m = cget(k, 0) & mask
                if m != mask:  # the speculative entries only where the confirmed ones fall short
                    m |= sget(k, 0) & mask
                    if m != mask:
                        gone = mask & ~m
                        while gone:
                            low = gone & -gone
                            out[live[low.bit_length() - 1]] = depth
                            gone ^= low
                        mask = m
                        if m.bit_count() <= FEW:  # the rest: each endpoint alone, from here
                            depth += 1  # (those left hold this key)
                            break
                depth += 1
        while mask:
            low = mask & -mask
            s = low.bit_length() - 1
            out[live[s]] = self._depth(s, keys, depth)
            mask ^= low
        return out

    def _depth(self, s: int, keys: Sequence[int], i: int) -> int:
        """The first index from ``i`` of a key that slot ``s`` holds neither by its events nor
        speculatively (``i``: the keys before it are held). Scans runs of keys held one way with
        C-level iterators (a long held prompt is one run), switching at each key the run's kind
        lacks."""
        bit, until, n = 1 << s, self._spec_until[s], len(keys)
        held, cget, uget = bit.__and__, self._mask.get, until.get
        for _ in range(RUNS):  # a run held speculatively, then a run held by events, ...
            while i < n:  # whole speculative runs that the keys repeat: each in one step
                r = uget(keys[i])
                if r is None or r.owned != len(r.keys) or r.keys[0] != keys[i]:
                    break
                m = len(r.keys)
                if tuple(keys[i : i + m]) != r.keys:
                    break
                i += m
            i = next(compress(count(i), map(not_, map(until.__contains__, islice(keys, i, None)))), n)
            if i == n:
                return n
            j = next(compress(count(i), map(not_, map(held, map(cget, islice(keys, i, None), repeat(0))))), n)
            if j == i:  # held neither way
                return i
            i = j
        while i < n and (cget(keys[i], 0) & bit or keys[i] in until):  # many short runs: key by key
            i += 1
        return i

    def _live(self, names: tuple[str, ...]) -> tuple[dict[int, str], int]:
        """Slot → endpoint of the ``names`` that have a slot, and their slots' bitmask; the last
        answer is kept while the same endpoints are asked for and no slot was taken or freed (a
        pick asks for the whole pool each time)."""
        memo = self._live_memo
        if memo is not None and memo[1] == names:
            return memo[2], memo[3]
        slots = self._slots
        live: dict[int, str] = {}
        for e in names:
            s = slots.get(e)
            if s is not None:
                live[s] = e
        mask = 0
        for s in live:
            mask |= 1 << s
        self._live_memo = (len(slots), names, live, mask)
        return live, mask

    def holds(self, key: str) -> set[int]:
        """Our keys confirmed on ``key`` (tests compare them with a replica's true cache)."""
        s = self._slots.get(key)
        return set(self._held[s].values()) if s is not None else set()

    def engine_hashes(self, key: str) -> set[int]:
        s = self._slots.get(key)
        return set(self._held[s]) if s is not None else set()

    def confirmed_depth(self, key: str, keys: Sequence[int]) -> int:
        """Leading ``keys`` that endpoint ``key`` holds by its KV events (speculative entries do
        not count): what every picker subscribed to the same events knows already."""
        s = self._slots.get(key)
        if s is None:
            return 0
        bit, get = 1 << s, self._mask.get
        depth = 0
        for k in keys:
            if not get(k, 0) & bit:
                break
            depth += 1
        return depth

    def check(self) -> None:
        want: dict[int, int] = {}
        for s, held in self._held.items():
            assert len(held) <= self.max_blocks, f"slot {s} holds {len(held)} > {self.max_blocks} blocks"
            assert self._copies[s].keys() <= held.keys(), f"slot {s}: copies of hashes not held"
            for k in held.values():
                want[k] = want.get(k, 0) | (1 << s)
        assert want == self._mask, "the key → slots bitmask disagrees with the per-endpoint tables"
        assert self._spec_count == sum(len(u) for u in self._spec_until.values()), "speculative count drifted"
        for s, until in self._spec_until.items():
            owned: dict[int, list[int]] = {}
            runs = {id(r): r for r in until.values()}
            for k, r in until.items():
                owned.setdefault(id(r), []).append(k)
                assert self._spec_mask.get(k, 0) >> s & 1, f"slot {s}: speculative key {k} not in the mask"
            for rid, r in runs.items():
                assert r.owned == len(owned[rid]), f"slot {s}: a run's count of its keys drifted"
                assert set(owned[rid]) <= set(r.keys), f"slot {s}: keys map to a run without them"


class State(enum.Enum):
    """Where an endpoint's KV-event stream stands, as the router reads it (:meth:`Router.is_precise`)."""

    WAITING = "waiting"
    """No message yet (nothing known: an idle replica publishes nothing)."""
    SYNCED = "synced"
    """Every batch since the engine's seq 0 (or a replay) applied: the index is exact."""
    REFILL = "refill"
    """Entries dropped after an unrecoverable gap; approximate routing until ``refill_until``."""


@dataclass
class Sync:
    """One endpoint's position in its KV-event stream. Writer: that endpoint's subscriber task
    (:class:`picker.feeds.events.Subscriber`), or cluster mode's replay; the router only reads it."""

    state: State = State.WAITING
    expected: int | None = None
    refill_until: float = 0.0
    gaps: int = 0
    restarts: int = 0
    bad: int = 0
    skipped_stores: int = 0

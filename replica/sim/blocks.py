"""KV block pool with vLLM's prefix-caching semantics (vLLM 0.32 ``v1/core/block_pool.py``).

- Only full blocks are cached. A block's hash chains its parent's: ``H(parent, tokens, extra)``,
  where ``extra`` carries the LoRA name on every block and the cache salt on the first only.
- Block 0 is vLLM's null block: never handed out, so ``num_blocks - 1`` blocks are usable.
- A block is *used* while its ref count is positive, *free* otherwise. Free blocks wait in an
  LRU queue: released blocks join the tail, allocation pops the head. A freed block keeps its
  hash, so a later request can hit it (taking it back out of the queue), until allocation hands
  it out again: that is eviction, reported as ``BlockRemoved``.
- Several blocks may hold the same hash (two requests computed it at once); a lookup takes any.

Invariants (``check``): ref counts never go negative; ``free + used == usable``; every hash in the
index names blocks that carry it. A hit is only a hit when the block's stored tokens equal the
looked-up tokens, so a hash collision reads as a miss.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash


def chain_hashes(
    tokens: Sequence[int],
    block_size: int,
    lora: str = "",
    salt: str = "",
    start: int = 0,
    parent: int | None = None,
) -> list[int]:
    """Hashes of the full blocks of ``tokens`` from block ``start`` on (``parent``: the hash of
    block ``start - 1``). Each depends on every token before its end.

    ``h[0] = xxh64(block_0, seed=xxh64(lora|salt))``, ``h[i] = xxh64(block_i, seed=h[i-1] ^ L)``
    with ``L = xxh64(lora)`` (0 without LoRA): the LoRA feeds every block, the salt the first only.
    """
    assert (start == 0) == (parent is None), "a continuation needs its parent hash"
    lora_key = xxhash.xxh64_intdigest(lora.encode()) if lora else 0
    out: list[int] = []
    end = len(tokens) // block_size
    if start >= end:
        return out
    data = array("q", tokens[start * block_size : end * block_size]).tobytes()
    step = block_size * 8
    h = xxhash.xxh64_intdigest(f"{lora}|{salt}".encode()) if parent is None else parent ^ lora_key
    for off in range(0, len(data), step):
        h = xxhash.xxh64_intdigest(data[off : off + step], h)
        out.append(h)
        h ^= lora_key
    return out


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    tokens: tuple[int, ...] = ()


@dataclass(slots=True)
class Stored:
    """Blocks newly cached for one request in one step (one vLLM ``BlockStored``)."""

    hashes: list[int]
    parent: int | None
    token_ids: list[int]
    lora: str
    salt: str  # the request's cache salt when the first of these blocks is block 0, else ""


@dataclass(slots=True)
class Removed:
    block_hash: int


@dataclass(slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, record_events: bool = False) -> None:
        assert num_blocks > 1 and block_size > 0, f"bad pool shape {num_blocks}x{block_size}"
        self.block_size, self.num_blocks = block_size, num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blocks[0].ref_cnt = 1  # the null block
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.index: dict[int, dict[int, Block]] = {}  # hash -> {block id: block}
        self.record_events = record_events
        self.events: list[Event] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: used fraction of the usable blocks."""
        return 1.0 - len(self.free) / (self.num_blocks - 1)

    def probe(self, hashes: Sequence[int]) -> int:
        """How many leading hashes are cached (no token check: for ordering heuristics only)."""
        k = 0
        for h in hashes:
            if h not in self.index:
                break
            k += 1
        return k

    def lookup(self, hashes: Sequence[int], tokens: Sequence[int], max_blocks: int) -> list[Block]:
        """The longest cached prefix (at most ``max_blocks``), tokens checked on every hit."""
        bs, hit = self.block_size, []
        for i, h in enumerate(hashes[:max_blocks]):
            found = self.index.get(h)
            if found is None:
                break
            b = next(iter(found.values()))
            if b.tokens != tuple(tokens[i * bs : (i + 1) * bs]):
                break  # a hash collision: a miss
            hit.append(b)
        return hit

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on hit blocks, taking free ones out of the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """``n`` blocks from the head of the free queue, evicting the cached ones."""
        assert n <= len(self.free), f"asked for {n} blocks with {len(self.free)} free"
        out = []
        for _ in range(n):
            b = self.blocks[self.free.popitem(last=False)[0]]
            if b.block_hash is not None:
                self._unindex(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _unindex(self, b: Block) -> None:
        assert b.block_hash is not None, f"block {b.block_id} has no hash to drop"
        same = self.index[b.block_hash]
        del same[b.block_id]
        if not same:
            del self.index[b.block_hash]
        if self.record_events:
            self.events.append(Removed(b.block_hash))
        b.block_hash, b.tokens = None, ()

    def cache(
        self,
        blocks: Sequence[Block],
        hashes: list[int],
        tokens: list[int],
        parent: int | None,
        lora: str = "",
        salt: str = "",
    ) -> None:
        """Register full blocks under their hashes; ``tokens[i*bs:(i+1)*bs]`` fills ``blocks[i]``.
        ``parent``: the hash before ``hashes[0]`` (None for block 0, which alone carries ``salt``)."""
        bs = self.block_size
        assert len(tokens) == len(blocks) * bs, "only full blocks are cached"
        for i, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
            assert b.block_hash is None and b.ref_cnt > 0, f"block {b.block_id} cached twice"
            b.block_hash, b.tokens = h, tuple(tokens[i * bs : (i + 1) * bs])
            self.index.setdefault(h, {})[b.block_id] = b
        if self.record_events and blocks:
            self.events.append(Stored(hashes, parent, tokens, lora, salt if parent is None else ""))

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference each. Blocks reaching zero join the free queue's tail in reverse
        order, so that a request's last blocks are evicted first (as vLLM does)."""
        for b in reversed(blocks):
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {b.block_id} ref count went negative"
            if b.ref_cnt == 0:
                self.free[b.block_id] = None

    def reset(self) -> bool:
        """Forget every cached hash (vLLM's /reset_prefix_cache); refused while blocks are in use."""
        if len(self.free) != self.num_blocks - 1:
            return False
        for b in self.blocks:
            b.block_hash, b.tokens = None, ()
        self.index.clear()
        if self.record_events:
            self.events.append(Cleared())
        return True

    def take_events(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    def check(self) -> None:
        used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        assert all(b.ref_cnt >= 0 for b in self.blocks), "a ref count went negative"
        assert used + len(self.free) == self.num_blocks - 1, "free + used != usable blocks"
        assert all(self.blocks[i].ref_cnt == 0 for i in self.free), "a used block sits in the free queue"
        for h, same in self.index.items():
            assert same and all(b.block_hash == h for b in same.values()), f"index entry {h} is stale"

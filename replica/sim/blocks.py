"""KV block pool with vLLM's prefix-caching semantics.

- Only full blocks are cached. A block's hash chains its parent's: ``H(parent, tokens, extra)``
  where ``extra`` carries the LoRA name, and the cache salt on the first block only.
- A block is *used* while its ref count is positive, *free* otherwise. Free blocks wait in an
  LRU queue (least recently freed first) and keep their hash, so a later request can hit them,
  until the queue hands them out again: that is eviction.

Invariants (asserted): ref counts never go negative; ``free + used == num_blocks``; a hash maps
to exactly one block, and that block's stored tokens are the ones hashed.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash


def chain_hashes(tokens: Sequence[int], block_size: int, lora: str = "", salt: str = "") -> list[int]:
    """Hashes of the full blocks of ``tokens``; each depends on every token before its end.

    ``h[0] = xxh64(block_0, seed=xxh64(lora|salt))`` and ``h[i] = xxh64(block_i, seed=h[i-1] ^ L)``,
    with ``L = xxh64(lora)`` (0 without LoRA): the LoRA feeds every block, the salt the first only.
    """
    data = array("q", tokens).tobytes()
    step = block_size * 8
    lora_key = xxhash.xxh64_intdigest(lora.encode()) if lora else 0
    parent = xxhash.xxh64_intdigest(f"{lora}|{salt}".encode())
    out: list[int] = []
    for start in range(0, (len(tokens) // block_size) * step, step):
        parent = xxhash.xxh64_intdigest(data[start : start + step], parent if not out else parent ^ lora_key)
        out.append(parent)
    return out


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    tokens: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0, f"bad pool shape {num_blocks}x{block_size}"
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.evicted: list[int] = []  # hashes evicted since the last drain (for KV events)
        self.stored: list[tuple[int, int | None, tuple[int, ...]]] = []  # (hash, parent, tokens)
        self.cleared = False

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def cached_prefix(self, hashes: Sequence[int]) -> list[Block]:
        """Leading blocks already cached (used or free), in order."""
        hit: list[Block] = []
        for h in hashes:
            bid = self.cached.get(h)
            if bid is None:
                break
            hit.append(self.blocks[bid])
        return hit

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on cached blocks (removing free ones from the free queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free.pop(b.block_id)
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """``n`` fresh blocks, evicting the least recently freed cached ones."""
        assert n <= len(self.free), f"asked for {n} blocks with {len(self.free)} free"
        out: list[Block] = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            b = self.blocks[bid]
            if b.block_hash is not None:
                del self.cached[b.block_hash]
                self.evicted.append(b.block_hash)
                b.block_hash, b.tokens = None, ()
            b.ref_cnt = 1
            out.append(b)
        return out

    def cache_full_block(
        self, b: Block, block_hash: int, tokens: tuple[int, ...], parent: int | None = None
    ) -> None:
        assert len(tokens) == self.block_size, "only full blocks are cached"
        if block_hash in self.cached or b.block_hash is not None:
            return  # an identical block is already cached (computed twice concurrently)
        b.block_hash, b.tokens = block_hash, tokens
        self.cached[block_hash] = b.block_id
        self.stored.append((block_hash, parent, tokens))

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference; blocks reaching zero join the free queue's tail, in reverse order so
        that a request's last blocks are evicted first (as vLLM does)."""
        for b in reversed(blocks):
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {b.block_id} ref count went negative"
            if b.ref_cnt == 0:
                self.free[b.block_id] = None

    def reset(self) -> bool:
        """Forget every cached hash (vLLM's /reset_prefix_cache); refused while blocks are in use."""
        if len(self.free) != len(self.blocks):
            return False
        for b in self.blocks:
            b.block_hash, b.tokens = None, ()
        self.cached.clear()
        self.cleared = True
        return True

    def check(self) -> None:
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert used + len(self.free) == len(self.blocks), "free + used != total"
        for h, bid in self.cached.items():
            assert self.blocks[bid].block_hash == h, f"cached map points at block {bid} with another hash"

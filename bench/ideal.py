"""Hit-rate ceilings of a workload, computed on the token blocks the replicas actually cache.

Requests are taken in send order. A request's hit is its leading full blocks already cached,
at most ``(len - 1) // block_size`` of them (the last prompt token is always computed, as in vLLM
and the simulator); hit rate = Σ hit tokens / Σ prompt tokens, the same ratio as
Σ ``usage.prompt_tokens_details.cached_tokens`` / Σ ``usage.prompt_tokens``.

- ``ideal_hit_rate``: one cache of infinite size (every block ever seen stays).
- ``lru_hit_rate``: one LRU cache of ``capacity_blocks`` blocks, the ceiling for a router over
  replicas whose caches hold that many blocks together (all blocks of a request are touched or
  inserted after its lookup; in-flight pinning is ignored).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from replica.sim import tokenizer
from replica.sim.blocks import chain_hashes

from .workloads import Workload


def block_hashes(prompts: Iterable[str], block_size: int) -> list[tuple[int, list[int]]]:
    """(prompt tokens, chained block hashes) per prompt, as the simulator computes them."""
    out = []
    for p in prompts:
        toks = tokenizer.encode(p) or [0]
        out.append((len(toks), chain_hashes(toks, block_size)))
    return out


def _lookup_limit(n_tokens: int, block_size: int) -> int:
    return (n_tokens - 1) // block_size


def ideal_hit_rate(seqs: Sequence[tuple[int, list[int]]], block_size: int) -> float:
    seen: set[int] = set()
    hit = total = 0
    for n, hashes in seqs:
        k = 0
        for h in hashes[: _lookup_limit(n, block_size)]:
            if h not in seen:
                break
            k += 1
        hit += k * block_size
        total += n
        seen.update(hashes)
    return hit / total if total else 0.0


def lru_hit_rate(seqs: Sequence[tuple[int, list[int]]], block_size: int, capacity_blocks: int) -> float:
    assert capacity_blocks > 0, f"LRU capacity must be positive, got {capacity_blocks}"
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for n, hashes in seqs:
        k = 0
        for h in hashes[: _lookup_limit(n, block_size)]:
            if h not in lru:
                break
            k += 1
        hit += k * block_size
        total += n
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hit / total if total else 0.0


def ceilings(w: Workload, block_size: int, capacity_blocks: int | None) -> tuple[float, float | None]:
    """(infinite-cache hit rate, single-LRU hit rate or None when the capacity is unknown)."""
    seqs = block_hashes((r.prompt for r in w.requests), block_size)
    lru = lru_hit_rate(seqs, block_size, capacity_blocks) if capacity_blocks else None
    return ideal_hit_rate(seqs, block_size), lru

"""Hit-rate ceilings of a workload, computed on the token blocks the replicas actually cache.

The ceilings themselves (``ideal_hit_rate``: one infinite cache; ``lru_hit_rate``: one LRU cache of
a given capacity) live in ``bench.ceilings``, shared with the simulator's cluster mode; this
module turns a benchmark workload's prompts into the ``(prompt tokens, block hashes)`` they take.
"""

from __future__ import annotations

from collections.abc import Iterable

from bench.ceilings import ideal_hit_rate, lru_hit_rate
from replica.sim import tokenizer
from replica.sim.blocks import chain_hashes

from .workloads import Workload

__all__ = ["block_hashes", "ceilings", "ideal_hit_rate", "lru_hit_rate"]


def block_hashes(prompts: Iterable[str], block_size: int) -> list[tuple[int, list[int]]]:
    """(prompt tokens, chained block hashes) per prompt, as the simulator computes them."""
    out = []
    for p in prompts:
        toks = tokenizer.encode(p) or [0]
        out.append((len(toks), chain_hashes(toks, block_size)))
    return out


def ceilings(w: Workload, block_size: int, capacity_blocks: int | None) -> tuple[float, float | None]:
    """(infinite-cache hit rate, single-LRU hit rate or None when the capacity is unknown)."""
    seqs = block_hashes((r.prompt for r in w.requests), block_size)
    lru = lru_hit_rate(seqs, block_size, capacity_blocks) if capacity_blocks else None
    return ideal_hit_rate(seqs, block_size), lru

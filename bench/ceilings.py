"""Hit-rate ceilings of a request sequence, on the token blocks the replicas actually cache.

Pure functions, shared by the cluster mode (``bench.cluster``) and the benchmarks
(``bench.ideal``). Input: one ``(prompt tokens, chained block hashes)`` pair per request, in send
order. A request's hit is its leading full blocks already cached, at most
``(len - 1) // block_size`` of them (the last prompt token is always computed, as in vLLM and the
simulator); hit rate = Σ hit tokens / Σ prompt tokens, the same ratio as
Σ ``usage.prompt_tokens_details.cached_tokens`` / Σ ``usage.prompt_tokens`` and as
``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``.

- ``ideal_hit_rate``: one cache of infinite size (every block ever seen stays).
- ``lru_hit_rate``: one LRU cache of ``capacity_blocks`` blocks, the ceiling for a router over
  replicas whose caches hold that many blocks together (all blocks of a request are touched or
  inserted after its lookup; in-flight pinning is ignored).

And the TTFT floor (``ttft_floor``): each request's time to first token alone on an idle engine
whose cache is the infinite one. No router can give a request less, on that engine, so a TTFT
quantile of the floor bounds what any routing policy can reach at that quantile.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Sequence

Seqs = Sequence[tuple[int, Sequence[int]]]


def _lookup_limit(n_tokens: int, block_size: int) -> int:
    return (n_tokens - 1) // block_size


def _cached_blocks(n_tokens: int, hashes: Sequence[int], block_size: int, cache: Container[int]) -> int:
    """The request's leading blocks in ``cache``: at most all but the one with its last token."""
    k = 0
    for h in hashes[: _lookup_limit(n_tokens, block_size)]:
        if h not in cache:
            break
        k += 1
    return k


def ideal_hit_rate(seqs: Seqs, block_size: int) -> float:
    return lru_hit_rate(seqs, block_size, None)


def lru_hit_rate(seqs: Seqs, block_size: int, capacity_blocks: int | None) -> float:
    """The hit rate of one LRU cache of ``capacity_blocks`` blocks (None: infinite)."""
    assert capacity_blocks is None or capacity_blocks > 0, (
        f"LRU capacity must be positive, got {capacity_blocks}"
    )
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for n, hashes in seqs:
        hit += _cached_blocks(n, hashes, block_size, lru) * block_size
        total += n
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while capacity_blocks is not None and len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hit / total if total else 0.0


def ttft_floor(
    seqs: Seqs,
    block_size: int,
    step_time: Callable[[Sequence[tuple[int, int]]], float],
    chunk_tokens: int,
) -> list[float]:
    """Per request, in send order, seconds: its prefill alone on an idle engine that holds every
    block sent before it (the infinite cache of :func:`ideal_hit_rate`), in chunks of at most
    ``chunk_tokens`` (the engine's ``max_num_batched_tokens``), each chunk one step of
    ``step_time([(new tokens, context before them)])`` (``replica.sim.costmodel.Profile``'s); the
    last chunk's step gives the first token. Queueing, other requests in the batch, a smaller
    cache or a slower engine only add to it."""
    assert block_size > 0 and chunk_tokens > 0, "block_size and chunk_tokens must be positive"
    seen: set[int] = set()
    out: list[float] = []
    for n, hashes in seqs:
        done, t = _cached_blocks(n, hashes, block_size, seen) * block_size, 0.0
        seen.update(hashes)
        while done < n:
            step = min(chunk_tokens, n - done)
            t += step_time([(step, done)])
            done += step
        out.append(t)
    return out

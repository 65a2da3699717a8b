"""A vLLM V1 scheduler (vLLM 0.32 ``v1/core/sched/scheduler.py``, FCFS policy) over :class:`BlockPool`.

Per step, with a budget of ``max_num_batched_tokens`` tokens and at most ``max_num_seqs`` running:

1. Running requests, in order. Each takes ``num_tokens - num_computed`` tokens (1 when decoding),
   cut to the budget (chunked prefill). When blocks run out the *last* running request is
   preempted (blocks freed, recomputed later from scratch, back at the head of the queue); if
   that is the request itself, the loop stops.
2. Only if nothing was preempted: waiting requests. A lookup finds the cached prefix, up to
   ``num_tokens - 1`` (the last token is always computed, so a full hit recomputes its last
   block); a request whose KV arrived from a prefill replica (``kv_loaded``, P/D) starts at its
   last token instead, its other blocks allocated and cached as if computed. Cached tokens are not charged to the budget. Admission needs free blocks for the
   uncached part only, counting hit blocks that sit in the free queue, and (vLLM's default
   ``scheduler_reserve_full_isl``) for the whole sequence, not just the first chunk. The first
   request that cannot be admitted stops the loop.

Blocks are registered in the prefix cache when scheduled, as vLLM does, so a request admitted
later in the same step already hits them. Prefix-cache counters count first admissions only
(vLLM keeps preempted requests' lookups apart). The admission order is the hook of :mod:`.policies`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .blocks import BlockPool
from .policies import AdmissionOrder, CacheAware, Fcfs
from .request import Request

Batch = list[tuple[Request, int]]


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    cache_aware: bool = False
    aging_s: float = 2.0
    reserve_full_sequence: bool = True
    long_prefill_token_threshold: int = 0
    """vLLM's ``--long-prefill-token-threshold``: a cap on one request's prefill chunk, applied
    only while more than one request is running or waiting (0: no cap, vLLM's default)."""
    charge_cached_tokens: bool = False
    """An ablation, not vLLM: cached prompt tokens are charged to the token budget as if they
    were computed (they are walked through in chunks, at no compute cost), as before vLLM V1."""

    def __post_init__(self) -> None:
        cap = self.long_prefill_token_threshold
        assert cap >= 0, f"long_prefill_token_threshold must be >= 0, got {cap}"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, pool: BlockPool, cfg: SchedulerConfig) -> None:
        self.pool, self.cfg = pool, cfg
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.order: AdmissionOrder = CacheAware(cfg.aging_s) if cfg.cache_aware else Fcfs()
        self.queries = self.hits = self.preemptions = 0  # prefix-cache counters are in tokens
        self._cap = 0  # the long-prefill cap of the step being scheduled

    def add(self, req: Request) -> None:
        assert req.block_size == self.pool.block_size, "request hashed with another block size"
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is; a step already holding it skips it in ``update``."""
        req.aborted = True
        if req in self.running:
            self.running.remove(req)
            self._free(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def schedule(self, now: float = 0.0) -> Batch:
        batch: Batch = []
        several = len(self.running) + len(self.waiting) > 1
        self._cap = self.cfg.long_prefill_token_threshold if several else 0
        budget = self._schedule_running(batch)
        if budget >= 0:
            self._schedule_waiting(batch, budget, now)
        return batch

    def _schedule_running(self, batch: Batch) -> int:
        """Returns the budget left, or -1 after a preemption (no admissions this step)."""
        budget, preempted, i = self.cfg.max_num_batched_tokens, False, 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, req.num_tokens - req.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            while _cdiv(req.num_computed + n, self.pool.block_size) - len(req.blocks) > self.pool.num_free:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    return -1
            self._grow(req, n)
            batch.append((req, n))
            budget -= n
            i += 1
        return -1 if preempted else budget

    def _schedule_waiting(self, batch: Batch, budget: int, now: float) -> None:
        admitted: list[Request] = []
        for req in self.order.order(self.waiting, self.pool, now):
            if budget <= 0 or len(self.running) + len(admitted) >= self.cfg.max_num_seqs:
                break
            n = self._admit(req, budget)
            if n <= 0:
                break
            admitted.append(req)
            batch.append((req, n))
            budget -= n
        self._move_to_running(admitted)

    def _admit(self, req: Request, budget: int) -> int:
        """Take the cached prefix and blocks for the first chunk; returns the chunk (0: not now)."""
        bs, pool = self.pool.block_size, self.pool
        hit = pool.lookup(req.hashes, req.tokens, (req.num_tokens - 1) // bs)
        cached = len(hit) * bs
        # P/D: a prompt whose KV came over the link starts at its last token (a decode step).
        start = req.num_tokens - 1 if req.kv_loaded else cached
        req.num_computed = 0 if self.cfg.charge_cached_tokens and not req.kv_loaded else start
        req.free_until = start
        n = self._chunk(req, req.num_tokens - req.num_computed, budget)
        evictable = sum(1 for b in hit if b.ref_cnt == 0)  # touching takes them off the free queue
        end = req.num_tokens if self.cfg.reserve_full_sequence else cached + n
        if n <= 0 or _cdiv(end, bs) - len(hit) + evictable > pool.num_free:
            req.num_computed = req.free_until = 0
            return 0
        pool.touch(hit)
        req.blocks, req.num_cached_blocks = list(hit), len(hit)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = cached
        if req.num_preemptions == 0 and not req.kv_loaded:  # loaded KV is no prefix-cache query
            self.queries += req.num_tokens
            self.hits += cached
        self._grow(req, n)
        return n

    def _chunk(self, req: Request, left: int, budget: int) -> int:
        """Greedy chunks, as vLLM: as much of ``left`` as the budget and the long-prefill cap allow."""
        if 0 < self._cap < left:
            budget = min(budget, self._cap)
        return min(left, budget)

    def computed_part(self, req: Request, n: int) -> tuple[int, int]:
        """(tokens really computed, their context) of a chunk of ``n`` scheduled for ``req``:
        the part of a chunk below ``req.free_until`` (a charged cached prefix) costs nothing."""
        start = max(req.num_computed, req.free_until)
        computed = req.num_computed + n - start
        return (computed, start) if computed > 0 else (0, 0)

    def _grow(self, req: Request, n: int) -> None:
        """Allocate blocks for ``n`` more tokens and cache the blocks they fill (vLLM caches at
        scheduling time, up to ``num_tokens``)."""
        bs = self.pool.block_size
        req.blocks += self.pool.allocate(max(_cdiv(req.num_computed + n, bs) - len(req.blocks), 0))
        full, k = min(req.num_computed + n, req.num_tokens) // bs, req.num_cached_blocks
        if full > k:
            parent = req.hashes[k - 1] if k else None
            toks = req.tokens[k * bs : full * bs]
            self.pool.cache(req.blocks[k:full], req.hashes[k:full], toks, parent, req.lora, req.salt)
            req.num_cached_blocks = full

    def _move_to_running(self, admitted: list[Request]) -> None:
        if not admitted:
            return
        k = len(admitted)
        if all(a is w for a, w in zip(admitted, self.waiting, strict=False)):
            for _ in range(k):
                self.waiting.popleft()
        else:
            ids = {id(r) for r in admitted}
            self.waiting = deque(r for r in self.waiting if id(r) not in ids)
        self.running += admitted

    def _free(self, req: Request) -> None:
        self.pool.release(req.blocks)
        req.blocks, req.num_cached_blocks = [], 0

    def _preempt(self, req: Request) -> None:
        self._free(req)
        req.num_computed = req.free_until = 0
        req.kv_loaded = False
        req.num_preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def update(self, batch: Batch, now: float) -> list[Request]:
        """Apply a finished step; returns the requests that sampled a token in it."""
        produced: list[Request] = []
        for req, n in batch:
            if req.aborted:
                continue
            req.num_computed += n
            if req.num_computed == req.num_tokens:
                req.sample()
                if req.first_token_at is None:
                    req.first_token_at = now
                req.prev_token_at, req.last_token_at = req.last_token_at, now
                produced.append(req)
                if req.finished:
                    self.running.remove(req)
                    self._free(req)
        return produced

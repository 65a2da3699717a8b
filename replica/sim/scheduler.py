"""A vLLM V1-style scheduler over :class:`BlockPool`.

Per step, with a token budget of ``max_num_batched_tokens`` and at most ``max_num_seqs`` running:
1. Running requests first: a decode takes one token; an unfinished prefill takes the next chunk.
   When blocks run out, the most recently admitted running request is preempted (its blocks are
   freed and it is recomputed later), as vLLM does.
2. Then waiting requests, FCFS: cached prefix blocks are reused and not charged to the budget;
   admission needs free blocks only for the uncached part; a prefill longer than the remaining
   budget is chunked. A full-prompt hit still computes the last token (the last block is dropped
   from the hit), as in vLLM.

Option ``page_aligned``: every non-final prefill chunk is a whole number of blocks.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from .blocks import Block, BlockPool, chain_hashes

_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    block_size: int
    lora: str = ""
    salt: str = ""
    arrival: float = 0.0
    request_id: int = field(default_factory=lambda: next(_ids))
    hashes: list[int] = field(init=False)
    blocks: list[Block] = field(default_factory=list)
    num_computed: int = 0
    num_output: int = 0
    num_cached: int = 0
    first_token_at: float | None = None
    cached_blocks: int = 0  # leading prompt blocks already registered in the cache

    def __post_init__(self) -> None:
        self.hashes = chain_hashes(self.prompt, self.block_size, self.lora, self.salt)

    @property
    def prefill_left(self) -> int:
        return max(0, len(self.prompt) - self.num_computed)

    @property
    def finished(self) -> bool:
        return self.num_output >= self.max_tokens


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    page_aligned: bool = False
    cache_aware: bool = False
    """Admit the waiting request with the longest cached prefix first, unless the oldest has
    waited ``aging_s`` or more: then it goes first (no request waits more than the bound beyond FCFS)."""
    aging_s: float = 2.0
    dedupe: bool = False
    """Defer a waiting request whose next uncached block is being prefilled by a running one; it
    is admitted once that block is cached, as a hit."""


class Scheduler:
    def __init__(self, pool: BlockPool, cfg: SchedulerConfig) -> None:
        self.pool, self.cfg = pool, cfg
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which were cached
        self.preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    def _chunk(self, left: int, budget: int) -> int:
        n = min(left, budget)
        if n < left and self.cfg.page_aligned:
            n -= n % self.pool.block_size
        return n

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.pool.release(victim.blocks)
        victim.blocks, victim.num_computed, victim.cached_blocks = [], 0, 0
        self.waiting.appendleft(victim)
        self.preemptions += 1

    def schedule(self, now: float = 0.0) -> list[tuple[Request, int]]:
        budget = self.cfg.max_num_batched_tokens
        out: list[tuple[Request, int]] = []
        for req in list(self.running):
            if req not in self.running or budget <= 0:
                continue
            n = 1 if req.prefill_left == 0 else self._chunk(req.prefill_left, budget)
            if n <= 0:
                continue
            need = self._blocks_for(req.num_computed + n) - len(req.blocks)
            while need > self.pool.num_free and self.running[-1] is not req:
                self._preempt(self.running[-1])
            if need > self.pool.num_free:
                self._preempt(req)
                continue
            req.blocks += self.pool.allocate(max(0, need))
            out.append((req, n))
            budget -= n
        if not (self.cfg.cache_aware or self.cfg.dedupe):  # vLLM's FCFS
            while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
                if not self._admit(self.waiting[0], budget, out):
                    break
                budget -= out[-1][1]
                self.running.append(self.waiting.popleft())
            return out
        in_flight = self._in_flight_blocks() if self.cfg.dedupe else set()
        for req in self._admission_order(now):
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            if in_flight and self._waits_on(req, in_flight):
                continue
            if not self._admit(req, budget, out):
                break
            budget -= out[-1][1]
            self.waiting.remove(req)  # O(waiting): acceptable in the simulator, not in a server
            self.running.append(req)
            if self.cfg.dedupe:
                in_flight.update(req.hashes[req.cached_blocks :])
        return out

    def _admission_order(self, now: float) -> list[Request]:
        if not self.cfg.cache_aware:
            return list(self.waiting)
        aged = [r for r in self.waiting if now - r.arrival >= self.cfg.aging_s]
        fresh = [r for r in self.waiting if now - r.arrival < self.cfg.aging_s]
        fresh.sort(key=lambda r: -len(self.pool.cached_prefix(r.hashes)))  # stable: FCFS among equals
        return aged + fresh

    def _in_flight_blocks(self) -> set[int]:
        return {h for r in self.running if r.prefill_left > 0 for h in r.hashes[r.cached_blocks :]}

    def _waits_on(self, req: Request, in_flight: set[int]) -> bool:
        k = len(self.pool.cached_prefix(req.hashes))
        return k < len(req.hashes) and req.hashes[k] in in_flight

    def _admit(self, req: Request, budget: int, out: list[tuple[Request, int]]) -> bool:
        hit = self.pool.cached_prefix(req.hashes)
        if hit and len(hit) * self.pool.block_size >= len(req.prompt):
            hit = hit[:-1]  # the last token must be computed to produce logits
        cached = len(hit) * self.pool.block_size
        n = self._chunk(len(req.prompt) - cached, budget)
        if n <= 0:
            return False
        need = self._blocks_for(cached + n) - len(hit)
        reclaimable = sum(1 for b in hit if b.ref_cnt == 0)  # hit blocks leave the free queue
        if need > self.pool.num_free - reclaimable:
            return False  # only uncached blocks count against admission
        self.pool.touch(hit)
        req.blocks = list(hit) + self.pool.allocate(need)
        req.num_computed = req.num_cached = cached
        req.cached_blocks = len(hit)
        self.queries += len(req.prompt)
        self.hits += cached
        out.append((req, n))
        return True

    def update(self, scheduled: list[tuple[Request, int]], now: float) -> list[Request]:
        """Apply a finished step; returns requests that produced a token this step."""
        produced: list[Request] = []
        bs = self.pool.block_size
        for req, n in scheduled:
            was_prefill = req.prefill_left > 0
            req.num_computed += n
            full = min(req.num_computed, len(req.prompt)) // bs
            for i in range(req.cached_blocks, full):
                parent = req.hashes[i - 1] if i else None
                self.pool.cache_full_block(
                    req.blocks[i], req.hashes[i], tuple(req.prompt[i * bs : (i + 1) * bs]), parent
                )
            req.cached_blocks = max(req.cached_blocks, full)
            if req.prefill_left == 0:
                req.num_output += 1
                if was_prefill and req.first_token_at is None:
                    req.first_token_at = now
                produced.append(req)
        for req in produced:
            if req.finished and req in self.running:
                self.running.remove(req)
                self.pool.release(req.blocks)
                req.blocks = []
        return produced

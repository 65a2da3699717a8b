"""The scheduler's two narrow extension points, one ``Protocol`` each, with vLLM's behaviour as
the default and the replica-side options of the vLLM-plugin issue as alternatives:

- ``AdmissionOrder``: in which order waiting requests are tried (vLLM: FCFS; ``CacheAware``:
  longest cached prefix first, except that a request waiting ``aging_s`` or more goes first, so
  none waits longer than the bound beyond FCFS).
- ``AdmissionGate``: whether to skip a waiting request this step (vLLM: never; ``Dedupe``: skip
  one whose next uncached block a running request will compute in a later chunk, so that it
  is admitted afterwards as a hit instead of computing the same block twice).

Why dedupe needs a chunk cap (checked in vLLM 0.32: ``KVCacheManager.allocate_slots`` caches
blocks up to ``num_computed_tokens + num_new_tokens`` when it schedules them): a block is a hit
for the next request from the step that *schedules* it, computed or not. With greedy chunks a
running prefill that is not fully scheduled has taken the whole budget, so a follower can only
be admitted once the leader's whole prompt is scheduled, i.e. cached: the gate has nothing to
defer. Only ``long_prefill_token_threshold`` (a per-request chunk cap) leaves budget beside a
pending prefill; there vLLM starts the followers next to the leader and they compute its blocks
again, and the gate defers them until they hit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from .blocks import BlockPool
from .request import Request


class AdmissionOrder(Protocol):
    def order(self, waiting: Sequence[Request], pool: BlockPool, now: float) -> Iterable[Request]: ...


class AdmissionGate(Protocol):
    def begin(self, running: Sequence[Request]) -> None: ...
    def defer(self, req: Request, pool: BlockPool) -> bool: ...
    def admitted(self, req: Request) -> None: ...


class Fcfs:
    def order(self, waiting: Sequence[Request], pool: BlockPool, now: float) -> Iterable[Request]:
        return waiting


class CacheAware:
    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s

    def order(self, waiting: Sequence[Request], pool: BlockPool, now: float) -> Iterable[Request]:
        aged = [r for r in waiting if now - r.arrival >= self.aging_s]
        fresh = [r for r in waiting if now - r.arrival < self.aging_s]
        fresh.sort(key=lambda r: -pool.probe(r.hashes))  # stable: FCFS among equals
        return aged + fresh


class Never:
    def begin(self, running: Sequence[Request]) -> None:
        pass

    def defer(self, req: Request, pool: BlockPool) -> bool:
        return False

    def admitted(self, req: Request) -> None:
        pass


class Dedupe:
    """Blocks that running requests have yet to schedule are "pending"; a waiting request whose
    first uncached block is pending waits until it is cached."""

    def __init__(self) -> None:
        self.pending: set[int] = set()

    def begin(self, running: Sequence[Request]) -> None:
        self.pending = {h for r in running if r.in_prefill for h in r.hashes[r.num_cached_blocks :]}

    def defer(self, req: Request, pool: BlockPool) -> bool:
        k = pool.probe(req.hashes)
        return k < len(req.hashes) and req.hashes[k] in self.pending

    def admitted(self, req: Request) -> None:
        self.pending.update(req.hashes[req.num_cached_blocks :])

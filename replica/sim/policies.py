"""The scheduler's narrow extension point, a ``Protocol``, with vLLM's behaviour as the default
and the replica-side option of the vLLM-plugin issue as the alternative:

- ``AdmissionOrder``: in which order waiting requests are tried (vLLM: FCFS; ``CacheAware``:
  longest cached prefix first, except that a request waiting ``aging_s`` or more goes first, so
  none waits longer than the bound beyond FCFS).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from .blocks import BlockPool
from .request import Request


class AdmissionOrder(Protocol):
    def order(self, waiting: Sequence[Request], pool: BlockPool, now: float) -> Iterable[Request]: ...


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

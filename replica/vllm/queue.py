"""A waiting queue that serves the longest cached prefix first, within an aging bound."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.request import Request


class CacheAwareQueue(FCFSRequestQueue):
    """FCFS storage, cache-aware choice.

    Invariants: if any request has waited ``aging_s`` or more (by ``arrival_time`` and
    ``clock``), the queue's FCFS head is served, so no request waits more than ``aging_s`` beyond
    its FCFS turn; otherwise the request with the most cached prefix tokens is served, ties in
    FCFS order. ``pop_request`` returns what the last ``peek_request`` chose, so vLLM's
    peek-then-pop loop stays consistent even when allocating for the peeked request evicts
    blocks of others. Only the first ``scan`` requests are scored, to bound the cost per peek."""

    def __init__(
        self,
        cached_tokens: Callable[[Request], int],
        aging_s: float,
        clock: Callable[[], float] = time.time,
        scan: int = 256,
    ) -> None:
        super().__init__()
        self.cached_tokens = cached_tokens
        self.aging_s = aging_s
        self.clock = clock
        self.scan = scan
        self._chosen: Request | None = None

    def _choose(self) -> Request:
        head = self[0]
        if self.clock() - head.arrival_time >= self.aging_s:
            return head
        best, best_cached = head, self.cached_tokens(head)
        for i, request in enumerate(self):
            if i == 0:
                continue
            if i >= self.scan:
                break
            cached = self.cached_tokens(request)
            if cached > best_cached:
                best, best_cached = request, cached
        return best

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        self._chosen = self._choose()
        return self._chosen

    def pop_request(self) -> Request:
        chosen = self._chosen if self._chosen is not None else self.peek_request()
        self._chosen = None
        self.remove(chosen)
        return chosen

    def remove_request(self, request: Request) -> None:
        if request is self._chosen:
            self._chosen = None
        super().remove_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = set(requests)
        if self._chosen in gone:
            self._chosen = None
        super().remove_requests(gone)

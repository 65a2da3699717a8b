"""Per-request timing and per-step counters, with the semantics of vLLM 0.32's
``vllm/v1/metrics/stats.py`` and ``loggers.py``:

- at a request's first token: ``prompt_tokens`` (the whole prompt) and ``computed_prompt_tokens``
  (its uncached part; ``vllm:prompt_tokens_by_source_total{source="local_compute"}``);
- per token after a request's first: ``itl``, the time since its previous token
  (``vllm:inter_token_latency_seconds``);
- per step: ``iteration_tokens``, computed prompt tokens counted above plus tokens sampled
  (``vllm:iteration_tokens_total``);
- when a request finishes (``FinishedRequestStats``): ``queue`` = first scheduled − arrival,
  ``prefill`` = first token − first scheduled, ``decode`` = last token − first token
  (``vllm:request_{queue,prefill,decode}_time_seconds``), and ``prefill_kv_computed`` = prompt −
  cached tokens (``vllm:request_prefill_kv_computed_tokens``). Aborted requests observe none.

Writer: :meth:`EngineStats.on_step` (the engine, after each step; :meth:`begin` before it) and
:meth:`forget` on abort. Readers: ``replica.sim.metrics`` (the HTTP ``/metrics``) and
``bench.cluster`` (the discrete-event scrape), so both export the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .request import Request

Observer = Callable[[str, float], None]
"""``(histogram name, value)``: the HTTP metrics forward each observation to a histogram."""


@dataclass(slots=True)
class Sum:
    """A histogram's ``_sum`` and ``_count``."""

    total: float = 0.0
    count: int = 0

    def add(self, v: float) -> None:
        self.total += v
        self.count += 1


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill: Sum = field(default_factory=Sum)
    decode: Sum = field(default_factory=Sum)
    queue: Sum = field(default_factory=Sum)
    itl: Sum = field(default_factory=Sum)
    iteration_tokens: Sum = field(default_factory=Sum)
    prefill_kv_computed: Sum = field(default_factory=Sum)
    observer: Observer | None = None
    _scheduled: dict[int, float] = field(default_factory=dict)
    """Request id → first scheduled time, for live requests (bounded by them)."""
    _last_token: dict[int, float] = field(default_factory=dict)
    """Request id → time of its latest token, for live requests that have one."""
    _started: float = 0.0
    """Start of the step in progress."""

    def _observe(self, name: str, s: Sum, v: float) -> None:
        s.add(v)
        if self.observer is not None:
            self.observer(name, v)

    def begin(self, started: float) -> None:
        """A step starts at ``started``: the first scheduled time of the requests new in it."""
        self._started = started

    def on_step(self, batch: list[tuple[Request, int]], produced: list[Request], now: float) -> None:
        """The step begun at :meth:`begin` ended at ``now``: ``batch`` was scheduled in it and
        ``produced`` sampled a token in it."""
        for req, _ in batch:
            self._scheduled.setdefault(req.request_id, self._started)
        computed = 0
        for req in produced:
            rid = req.request_id
            last = self._last_token.get(rid)
            if last is None:
                self.prompt_tokens += len(req.prompt)
                computed += len(req.prompt) - max(0, req.num_cached_tokens)
            else:
                self._observe("itl", self.itl, now - last)
            if req.finished:
                self._finished(req, now)
            else:
                self._last_token[rid] = now
        self.computed_prompt_tokens += computed
        self.generation_tokens += len(produced)
        if batch:
            self._observe("iteration_tokens", self.iteration_tokens, float(computed + len(produced)))

    def _finished(self, req: Request, now: float) -> None:
        scheduled = self._scheduled.pop(req.request_id, now)
        self._last_token.pop(req.request_id, None)
        first = req.first_token_at if req.first_token_at is not None else now
        self._observe("queue", self.queue, max(0.0, scheduled - req.arrival))
        self._observe("prefill", self.prefill, first - scheduled)
        self._observe("decode", self.decode, now - first)
        cached = max(0, req.num_cached_tokens)
        self._observe("prefill_kv_computed", self.prefill_kv_computed, float(len(req.prompt) - cached))

    def forget(self, req: Request) -> None:
        """An aborted request: drop its timestamps (the maps stay bounded by live requests)."""
        self._scheduled.pop(req.request_id, None)
        self._last_token.pop(req.request_id, None)

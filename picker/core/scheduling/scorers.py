"""Scorers: a score in [0, 1] per endpoint key, higher is better. Pure functions of their input,
except :class:`SessionAffinityScorer`, which remembers its own past picks (bounded)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from picker.core.endpoints.types import EndpointState
from picker.core.scheduling.types import Cycle


def inverse_minmax(values: dict[str, float]) -> dict[str, float]:
    """Lowest value → 1, highest → 0; all equal → 1 everywhere."""
    lo, hi = min(values.values()), max(values.values())
    if hi <= lo:
        return dict.fromkeys(values, 1.0)
    span = hi - lo
    return {k: 1.0 - (v - lo) / span for k, v in values.items()}


def _by_load(endpoints: Sequence[EndpointState], load: Callable[[EndpointState], float]) -> dict[str, float]:
    return inverse_minmax({e.key: load(e) for e in endpoints})


@dataclass
class PrefixScorer:
    """Fraction of the request's blocks that the index says the endpoint holds."""

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        n = cycle.n_blocks
        return {e.key: (cycle.matches.get(e.key, 0) / n if n else 0.0) for e in endpoints}


@dataclass
class QueueScorer:
    """Shorter waiting queue scores higher (min-max normalised, as GIE's queue scorer)."""

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        return _by_load(endpoints, lambda e: e.metrics.waiting)


@dataclass
class KVCacheScorer:
    """Lower KV-cache usage scores higher: ``1 - kv_usage``."""

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        return {e.key: 1.0 - min(1.0, max(0.0, e.metrics.kv_usage)) for e in endpoints}


@dataclass
class InFlightTokensScorer:
    """Fewer prompt tokens in flight (sent by us, not finished) scores higher."""

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        return _by_load(endpoints, lambda e: float(e.load.in_flight_tokens))


@dataclass
class LeastLoadedScorer:
    """Fewest requests (ours in flight, or the scraped running + waiting, whichever is larger)."""

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        return _by_load(
            endpoints, lambda e: max(float(e.load.in_flight_requests), e.metrics.running + e.metrics.waiting)
        )


@dataclass
class LoraAffinityScorer:
    """Adapter already running → 1; queued → 0.8; a free adapter slot → 0.5; else 0.
    Requests for the base model get no scores (equal everywhere, so they cannot change a pick)."""

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        lora = cycle.request.lora
        if not lora:
            return {}
        out: dict[str, float] = {}
        for e in endpoints:
            m = e.metrics
            if lora in m.running_loras:
                out[e.key] = 1.0
            elif lora in m.waiting_loras:
                out[e.key] = 0.8
            elif len(m.running_loras) < m.max_lora:
                out[e.key] = 0.5
            else:
                out[e.key] = 0.0
        return out


@dataclass
class SessionAffinityScorer:
    """The endpoint that served the request's ``x-session-id`` last scores 1, others 0.
    Remembers at most ``max_sessions`` sessions (LRU)."""

    max_sessions: int = 100_000
    _last: OrderedDict[str, str] = field(default_factory=OrderedDict, repr=False)

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        target = self._last.get(cycle.request.session_id) if cycle.request.session_id else None
        return {target: 1.0} if target is not None else {}  # unscored endpoints count as 0

    def picked(self, cycle: Cycle, chosen: EndpointState) -> None:
        sid = cycle.request.session_id
        if not sid:
            return
        self._last[sid] = chosen.key
        self._last.move_to_end(sid)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)

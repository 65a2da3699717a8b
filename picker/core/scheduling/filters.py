"""Filters: narrow the candidates. A filter returns a sub-list of its input, order kept."""

from __future__ import annotations

from dataclasses import dataclass

from picker.core.endpoints.types import NOT_ROUTABLE, EndpointState
from picker.core.errors import Overloaded
from picker.core.scheduling.types import Cycle


@dataclass
class ReadyFilter:
    """Keeps routable endpoints (not UNREACHABLE)."""

    def filter(self, cycle: Cycle, endpoints: list[EndpointState]) -> list[EndpointState]:
        return [e for e in endpoints if e.health not in NOT_ROUTABLE]  # e.routable, inline


@dataclass
class NotSaturatedFilter:
    """Drops saturated endpoints: a waiting queue at ``max_waiting`` or more, or KV usage at
    ``max_kv_usage`` or more while requests already wait.

    When every endpoint is saturated, a sheddable request (negative priority) is shed with 429 if
    ``shed`` is true; any other request keeps only the least-loaded endpoint (the protocol keeps
    429 for requests that may be dropped). With ``shed`` false all candidates are kept
    (saturation then only shows in the scores).
    """

    max_waiting: int = 64
    max_kv_usage: float = 0.98
    shed: bool = True

    def saturated(self, e: EndpointState) -> bool:
        m = e.metrics
        return m.waiting >= self.max_waiting or (m.kv_usage >= self.max_kv_usage and m.waiting > 0)

    def filter(self, cycle: Cycle, endpoints: list[EndpointState]) -> list[EndpointState]:
        most, full = self.max_waiting, self.max_kv_usage  # saturated(), inline (per endpoint)
        kept = [
            e for e in endpoints if (m := e.metrics).waiting < most and (m.kv_usage < full or m.waiting <= 0)
        ]
        if kept or not endpoints:
            return kept
        if not self.shed:
            return endpoints
        if cycle.priority < 0:
            raise Overloaded(f"all {len(endpoints)} endpoints are saturated; the request is sheddable")
        return [min(endpoints, key=LoadGuardFilter.load)]


@dataclass
class LoadGuardFilter:
    """Stops one hot prefix from piling traffic onto one endpoint.

    Keeps endpoints whose load (our in-flight requests, or the scraped running + waiting count,
    whichever is larger) is at most ``max(min_load * rel, min_load + abs_slack)``, where
    ``min_load`` is the least-loaded candidate's. The hot endpoint stays eligible until it is
    clearly busier than the rest; then the prefix spills to another endpoint, which caches it too.

    It is a backstop, not the balancer: the cost scorer already prices queued prefill. The load
    counted here is mostly running decodes, which swing by a dozen per replica under ordinary
    traffic; with ``abs_slack`` 8 the guard tripped on those swings and split prefixes that
    needed no split (profile ``cost-guard8`` in bench/configs/cost-variants.yaml; figures in
    bench/results/2026-11-27-readme-archive.md). SGLang's router and vllm-router use 64.
    """

    rel: float = 1.5
    abs_slack: int = 32

    @staticmethod
    def load(e: EndpointState) -> float:
        scraped = e.metrics.running + e.metrics.waiting
        sent = e.load.in_flight_requests + e.peer_load.in_flight_requests
        return sent if sent > scraped else scraped

    def filter(self, cycle: Cycle, endpoints: list[EndpointState]) -> list[EndpointState]:
        if len(endpoints) < 2:
            return endpoints
        # load(), inline (it runs per endpoint per request)
        loads = [
            sent if sent > (scraped := e.metrics.running + e.metrics.waiting) else scraped
            for e in endpoints
            for sent in [e.load.in_flight_requests + e.peer_load.in_flight_requests]
        ]
        least = min(loads)
        limit = max(least * self.rel, least + self.abs_slack)
        return [e for e, load in zip(endpoints, loads, strict=True) if load <= limit]

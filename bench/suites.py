"""Suite definitions: which workloads, at what size, under which routers.

``quick`` (``make bench``) keeps every workload's shape but fewer requests and shorter outputs,
so the whole run fits in 10 minutes on a 2-core machine; ``full`` uses the issue's defaults
(SGLang generated-shared-prefix 64 × 16, 2048 + 128 → 256) and a longer slice of the trace.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from . import mooncake_trace
from .routers import ROUTERS
from .workloads import Workload, mooncake, multi_turn, no_sharing, shared_prefix

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_TRACE = mooncake_trace.DEFAULT_TRACE


@dataclass
class Suite:
    name: str
    replicas: int = 4
    profile: str = "h100-llama-3.1-8b"
    time_scale: float = 1.0
    """Simulator step-time multiplier (1: H100 speed)."""
    load_fraction: float = 0.8
    calib_per_replica: int = 16
    """Capacity = closed-loop throughput with this many requests in flight per replica."""
    calib_max: int = 128
    """At most this many requests in the calibration run."""
    routers: tuple[str, ...] = ROUTERS
    gsp: tuple[int, int, int, int, int] = (64, 16, 2048, 128, 256)
    """groups, prompts per group, system prompt, question, output (tokens)."""
    no_sharing: tuple[int, int, int] = (1024, 2176, 256)
    multi_turn: tuple[int, int] = (64, 8)
    """sessions, turns."""
    trace_rows: int = 1000
    overhead: tuple[tuple[int, float, int], ...] = ((600, 20.0, 8), (400, 12.0, 128))
    """Router-overhead loads: (requests, Poisson rate, output tokens)."""
    workloads: tuple[str, ...] = field(
        default=("generated-shared-prefix", "no-sharing", "multi-turn", "mooncake")
    )


SUITES = {
    "quick": Suite(
        "quick",
        gsp=(16, 16, 2048, 128, 128),
        no_sharing=(160, 2176, 128),
        multi_turn=(32, 4),
        trace_rows=64,
        overhead=((150, 20.0, 8), (100, 12.0, 128)),
        calib_max=96,
    ),
    "full": Suite("full"),
    # CI smoke run (tests/bench/test_smoke.py): the whole pipeline in well under 30 seconds
    "smoke": Suite(
        "smoke",
        replicas=2,
        calib_per_replica=4,
        routers=("cost", "cost-approximate", "round-robin"),
        gsp=(4, 4, 256, 32, 8),
        workloads=("generated-shared-prefix",),
        overhead=((40, 20.0, 8),),
    ),
}


def build(suite: Suite, name: str, trace: pathlib.Path) -> Workload:
    if name == "generated-shared-prefix":
        return shared_prefix(*suite.gsp)
    if name == "no-sharing":
        return no_sharing(*suite.no_sharing)
    if name == "multi-turn":
        return multi_turn(*suite.multi_turn)
    if name == "mooncake":
        return mooncake(str(trace), suite.trace_rows)
    raise ValueError(f"unknown workload {name!r}")

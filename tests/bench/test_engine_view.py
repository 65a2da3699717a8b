"""bench.engine_view: histogram deltas and quantiles as vLLM's /metrics gives them, and a process
group's CPU time read from /proc."""

from __future__ import annotations

import os
import pathlib
import time

from bench.engine_view import Hist, group_cpu
from bench.fleet import FleetConfig
from bench.real import VllmFleet, picker_variant
from kvlaunch import Procs


def test_delta_and_quantile() -> None:
    before = Hist({0.01: 2, 0.1: 3, 1.0: 3, float("inf"): 3}, total=0.2, count=3)
    after = Hist({0.01: 2, 0.1: 5, 1.0: 12, float("inf"): 13}, total=4.0, count=13)
    d = after.minus(before)
    assert d.count == 10 and abs(d.total - 3.8) < 1e-9
    assert d.quantile(0.1) == 0.1  # 2 of the window's 10 are at or under 0.1
    assert d.quantile(0.9) == 1.0
    assert d.quantile(1.0) == float("inf")
    assert Hist().quantile(0.9) == 0.0 and Hist().mean() == 0.0


def test_group_cpu_counts_this_process() -> None:
    me = os.getpgid(0)
    start = group_cpu(me)
    t = time.process_time() + 0.05
    while time.process_time() < t:
        pass
    assert group_cpu(me) >= start + 0.03


def test_variant_adds_one_flag(tmp_path: os.PathLike[str]) -> None:
    fleet = VllmFleet(FleetConfig(replicas=2), Procs(pathlib.Path(tmp_path)), ports=[1, 2])
    policy, args = picker_variant("cost-approximate+scrape-interval=1.0", fleet)
    assert policy == "cost"
    assert args == ["--prefix-mode", "approximate", "--scrape-interval", "1.0"]
    assert picker_variant("sglang-router", fleet) == ("sglang-router", [])

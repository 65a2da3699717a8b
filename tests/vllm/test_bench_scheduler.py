"""``bench.vllm_trace.BenchScheduler`` (the scheduler ``bench.vllm_pressure`` measures with)
on vLLM's real V1 Scheduler (no model): switched between runs it schedules exactly as our
scheduler built with those options does, and its trace reads back as that schedule."""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest

from tests.vllm.harness import finish_step, make_request, make_scheduler

pytestmark = pytest.mark.vllm


def run(sched: Any, prompts: list[list[int]], tag: str) -> list[list[tuple[int, int, int]]]:
    """Every step's (prompt index, computed before, scheduled), all prompts added at once."""
    for i, prompt in enumerate(prompts):
        sched.add_request(make_request(f"{tag}{i}", prompt, arrival=0.0))
    steps = []
    while sched.has_requests():
        out = sched.schedule()
        step = []
        for rid, n in out.num_scheduled_tokens.items():
            step.append((int(rid.removeprefix(tag)), sched.requests[rid].num_computed_tokens - n, n))
        steps.append(sorted(step))
        finish_step(sched, out)
    return steps


def test_switched_options_schedule_as_built_options_and_trace_it(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import vllm_pressure as pressure
    from bench.vllm_trace import BenchScheduler
    from replica.vllm.options import PrefixAwareOptions
    from replica.vllm.scheduler import PrefixAwareScheduler

    workload = pressure.Workload(groups=4, per_group=3, prefix=96, tail=20)
    prompts = workload.prompts()
    trace = tmp_path / "schedule.jsonl"
    monkeypatch.setenv("KVPICK_SCHEDULE_TRACE", str(trace))
    monkeypatch.setenv("KVPICK_BENCH_OPTIONS", str(tmp_path / "options.json"))
    pressure.set_options(str(tmp_path), {})
    bench = make_scheduler(tiny_model_dir, 24, 100, cls=BenchScheduler, max_num_seqs=2, clock=lambda: 0.0)
    cases = ["vllm", "cache_aware", "vllm, cap 128", "vllm"]
    schedules = []
    for n, name in enumerate(cases):
        options = dict(pressure.CONFIGS[name])
        cap = int(str(options.pop("long_prefill_token_threshold", 0)))
        built = make_scheduler(
            tiny_model_dir,
            24,
            100,
            cls=PrefixAwareScheduler,
            max_num_seqs=2,
            long_prefill=cap,
            options=PrefixAwareOptions(**{k: bool(v) for k, v in options.items()}),
            clock=lambda: 0.0,
        )
        pressure.set_options(str(tmp_path), pressure.CONFIGS[name])
        time.sleep(0.01)  # a new mtime
        assert bench.reset_prefix_cache(), "the pool is free between runs"
        start = time.time()
        got = run(bench, prompts, f"b{n}-")
        schedules.append(got)
        assert got == run(built, prompts, f"o{n}-"), f"{name}: switched options schedule differently"
        requests, steps = pressure.read_schedule(str(trace), (start, time.time()), prompts)
        assert len(steps) == len([s for s in got if s]), f"{name}: one trace line per step"
        for r in requests:
            computed = sum(k for step in got for i, _, k in step if i == r.index)
            first = next(before for step in got for i, before, _ in step if i == r.index)
            assert (r.computed, r.cached) == (computed, first), f"{name}: request {r.index} traced wrongly"
    assert schedules[0] == schedules[-1], "switching back restores vLLM's schedule"
    assert schedules[1] != schedules[0], "cache-aware admission changed this schedule"

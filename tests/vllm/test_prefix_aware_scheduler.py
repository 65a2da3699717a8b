"""PrefixAwareScheduler on vLLM's real V1 Scheduler (no model): all options off equals vLLM, the
async variant applies the same hooks, and the options reach it from the environment."""

from __future__ import annotations

import pathlib
import random
from typing import Any

import pytest

from tests.vllm.harness import finish_step, make_request, make_scheduler

pytestmark = pytest.mark.vllm


def _stream(seed: int, n: int = 24) -> list[tuple[int, str, list[int], int]]:
    """(step to add at, id, prompt, max_tokens): prompts of random length, some sharing prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 2000) for _ in range(rng.randrange(16, 200))] for _ in range(3)]
    out = []
    for i in range(n):
        tail = [rng.randrange(2, 2000) for _ in range(rng.randrange(1, 300))]
        prompt = [*rng.choice(prefixes), *tail] if rng.random() < 0.6 else tail
        out.append((rng.randrange(0, 20), f"r{i}", prompt, rng.randrange(1, 6)))
    return out


def run_stream(
    sched: Any, stream: list[tuple[int, str, list[int], int]], steps: int = 400
) -> list[dict[str, int]]:
    """Drive the stream to completion; returns the scheduled tokens of each step."""
    trace: list[dict[str, int]] = []
    for step in range(steps):
        for at, rid, prompt, max_tokens in stream:
            if at == step:
                sched.add_request(make_request(rid, prompt, max_tokens, arrival=float(at)))
        if step > max(s[0] for s in stream) and not sched.has_requests():
            return trace
        out = sched.schedule()
        trace.append(dict(out.num_scheduled_tokens))
        finish_step(sched, out)
    raise AssertionError(f"stream not finished in {steps} steps: {sched.get_request_counts()}")


@pytest.mark.parametrize("seed", [0, 1])
def test_all_options_off_equals_vllm(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from replica.vllm.scheduler import PrefixAwareScheduler

    monkeypatch.delenv("KVPICK_CACHE_AWARE_ADMISSION", raising=False)
    stream = _stream(seed)
    plain = run_stream(make_scheduler(tiny_model_dir, 60, 100, cls=Scheduler, max_num_seqs=4), stream)
    ours = make_scheduler(tiny_model_dir, 60, 100, cls=PrefixAwareScheduler, max_num_seqs=4)
    assert not ours.kvpick.any_on, f"options default to off: {ours.kvpick}"
    assert run_stream(ours, stream) == plain


def test_async_variant_applies_the_same_hooks(tiny_model_dir: pathlib.Path) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from replica.vllm.options import PrefixAwareOptions
    from replica.vllm.queue import CacheAwareQueue
    from replica.vllm.scheduler import PrefixAwareAsyncScheduler

    opts = PrefixAwareOptions(cache_aware_admission=True)
    sched = make_scheduler(
        tiny_model_dir,
        200,
        512,
        cls=PrefixAwareAsyncScheduler,
        max_num_seqs=2,
        options=opts,
        clock=lambda: 0.0,
    )
    assert isinstance(sched, AsyncScheduler) and isinstance(sched.waiting, CacheAwareQueue)
    prefix = list(range(10, 310))
    sched.add_request(make_request("warm", [*prefix, 1], max_tokens=4, arrival=0.0))
    assert sched.schedule().num_scheduled_tokens == {"warm": 301}
    sched.add_request(make_request("cold", list(range(500, 640)), arrival=0.0))
    sched.add_request(make_request("hot", [*prefix, 2], arrival=0.0))
    second = sched.schedule()
    assert [r.req_id for r in second.scheduled_new_reqs] == ["hot"], "the cached prefix takes the last seat"
    assert second.scheduled_new_reqs[0].num_computed_tokens == 288, "admitted with its 18 cached blocks"


def test_options_reach_the_scheduler_from_the_environment(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from replica.vllm.queue import CacheAwareQueue
    from replica.vllm.scheduler import PrefixAwareScheduler

    monkeypatch.setenv("KVPICK_CACHE_AWARE_ADMISSION", "1")
    monkeypatch.setenv("KVPICK_AGING_S", "0.5")
    sched = make_scheduler(tiny_model_dir, 60, 100, cls=PrefixAwareScheduler)
    assert isinstance(sched.waiting, CacheAwareQueue) and sched.waiting.aging_s == 0.5

"""Cache-aware admission on vLLM's real V1 Scheduler (no model): under KV pressure it raises
prefix hits over FCFS on the same stream, and no request waits more than the aging bound past
its FCFS turn (checked with an injected clock)."""

from __future__ import annotations

import pathlib
import random
from typing import Any

import pytest

from tests.vllm.harness import finish_step, make_request, make_scheduler

pytestmark = pytest.mark.vllm


def _grouped_stream(groups: int = 4, per_group: int = 4) -> list[list[int]]:
    """Interleaved A B C D A B C D ...: 128-token shared prefix per group, 20-token unique tail."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(2, 2000) for _ in range(128)] for _ in range(groups)]
    return [
        [*prefixes[g], *(rng.randrange(2, 2000) for _ in range(20))]
        for _ in range(per_group)
        for g in range(groups)
    ]


def hits_on(sched: Any, prompts: list[list[int]]) -> int:
    """Add every prompt at t=0, run to completion, return the cached tokens found at admission."""
    for i, prompt in enumerate(prompts):
        sched.add_request(make_request(f"r{i}", prompt, arrival=0.0))
    hits = 0
    for _ in range(200):
        if not sched.has_requests():
            return hits
        out = sched.schedule()
        hits += sum(r.num_computed_tokens for r in out.scheduled_new_reqs)
        finish_step(sched, out)
    raise AssertionError("stream did not finish")


def test_cache_aware_admission_raises_hits_under_kv_pressure(tiny_model_dir: pathlib.Path) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from replica.vllm.options import PrefixAwareOptions
    from replica.vllm.scheduler import PrefixAwareScheduler

    prompts = _grouped_stream()
    # 24 blocks hold about two groups' prefixes (8 blocks each + tails): FCFS evicts each prefix
    # before its next sibling comes round; cache-aware admission serves siblings while cached.
    fcfs = hits_on(make_scheduler(tiny_model_dir, 24, 512, cls=Scheduler, max_num_seqs=1), prompts)
    ours_sched = make_scheduler(
        tiny_model_dir,
        24,
        512,
        cls=PrefixAwareScheduler,
        max_num_seqs=1,
        options=PrefixAwareOptions(cache_aware_admission=True),
        clock=lambda: 0.0,
    )
    ours = hits_on(ours_sched, prompts)
    assert ours == 4 * 3 * 128, f"every sibling after the first hits its 128-token prefix: {ours}"
    assert ours > 2 * fcfs, f"cache-aware {ours} tokens hit vs FCFS {fcfs}"


def admissions_with_cold_request(
    tiny_model_dir: pathlib.Path, aging_s: float
) -> list[tuple[float, str, float]]:
    """One admission per step (0.1 s): a hot request (cached prefix) arrives every step, one cold
    request (nothing cached) at t=0.05. Returns (admitted at, id, arrival) per admission, and
    asserts the aging invariant at every step."""
    from replica.vllm.options import PrefixAwareOptions
    from replica.vllm.scheduler import PrefixAwareScheduler

    now = [0.0]
    sched = make_scheduler(
        tiny_model_dir,
        64,
        512,
        cls=PrefixAwareScheduler,
        max_num_seqs=1,
        options=PrefixAwareOptions(cache_aware_admission=True, aging_s=aging_s),
        clock=lambda: now[0],
    )
    hot = list(range(10, 138))
    admitted: list[tuple[float, str, float]] = []
    for step in range(40):
        now[0] = step * 0.1
        sched.add_request(make_request(f"hot{step}", [*hot, 2000 + step], arrival=now[0]))
        if step == 0:
            sched.add_request(make_request("cold", list(range(500, 640)), arrival=0.05))
        out = sched.schedule()
        for new in out.scheduled_new_reqs:
            arrival = sched.requests[new.req_id].arrival_time
            older_aged = [
                r.request_id
                for r in sched.waiting
                if r.arrival_time < arrival and now[0] - r.arrival_time >= aging_s
            ]
            assert not older_aged, (
                f"{new.req_id} admitted at {now[0]:.1f} while {older_aged} waited past the bound"
            )
            admitted.append((now[0], new.req_id, arrival))
        finish_step(sched, out)
    return admitted


def test_cache_aware_admission_respects_the_aging_bound(tiny_model_dir: pathlib.Path) -> None:
    cold = [
        (at, arrival)
        for at, rid, arrival in admissions_with_cold_request(tiny_model_dir, 1.0)
        if rid == "cold"
    ]
    assert cold, "the cold request was admitted"
    at, arrival = cold[0]
    assert 1.0 <= at - arrival <= 1.0 + 0.1 + 1e-9, (
        f"cold waited {at - arrival:.2f}s: hot first, then the bound"
    )
    # Without aging the cold request starves for the whole run: the bound is what admits it.
    starved = admissions_with_cold_request(tiny_model_dir, 1e9)
    assert "cold" not in [rid for _, rid, _ in starved]

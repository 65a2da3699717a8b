"""Deduplication on vLLM's real V1 Scheduler (no model): four waiting requests share a 256-token
prefix nobody has computed; with chunks capped at 64 tokens vLLM runs them side by side and
computes prefix blocks more than once, while ours computes the prefix once."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tests.vllm.harness import finish_step, make_request, make_scheduler

pytestmark = pytest.mark.vllm

PREFIX = list(range(10, 266))  # 16 blocks


def prefill_tokens(sched: Any) -> int:
    """Add 4 requests (shared prefix, 16-token tails) at t=0; return the prompt tokens computed."""
    for i in range(4):
        sched.add_request(make_request(f"r{i}", [*PREFIX, *range(1000 + 16 * i, 1016 + 16 * i)], arrival=0.0))
    computed = 0
    for _ in range(100):
        if not sched.has_requests():
            return computed
        out = sched.schedule()
        for rid, n in out.num_scheduled_tokens.items():
            request = sched.requests[rid]
            start = request.num_computed_tokens - n  # already advanced by schedule()
            computed += max(min(n, request.num_prompt_tokens - start), 0)
        finish_step(sched, out)
    raise AssertionError("requests did not finish")


def test_dedupe_computes_a_shared_prefix_once(tiny_model_dir: pathlib.Path) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from replica.vllm.options import PrefixAwareOptions
    from replica.vllm.scheduler import PrefixAwareScheduler

    vllm = prefill_tokens(
        make_scheduler(tiny_model_dir, 200, 512, cls=Scheduler, max_num_seqs=4, long_prefill=64)
    )
    ours = prefill_tokens(
        make_scheduler(
            tiny_model_dir,
            200,
            512,
            cls=PrefixAwareScheduler,
            max_num_seqs=4,
            long_prefill=64,
            options=PrefixAwareOptions(dedupe_shared_prefixes=True),
            clock=lambda: 0.0,
        )
    )
    once = 256 + 4 * 16
    assert ours == once, f"the prefix is computed once: {ours} prompt tokens computed, expected {once}"
    assert vllm > once, f"vLLM alone recomputes shared blocks ({vllm}), or the test proves nothing"

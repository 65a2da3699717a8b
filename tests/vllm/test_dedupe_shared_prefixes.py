"""In-flight prefix sharing on vLLM's real V1 Scheduler (no model), and what the dedupe gate adds.

vLLM caches a block when it *schedules* it (``KVCacheManager.allocate_slots`` calls
``cache_blocks`` up to ``num_computed_tokens + num_new_tokens`` before the step runs), so the next
request finds it at once, computed or not. Without a per-request chunk cap, vLLM already computes a
shared prefix once: the dedupe gate is redundant there. With ``long_prefill_token_threshold`` a
leader's capped chunk leaves budget beside its pending blocks, vLLM admits the followers next to
it and they compute the same blocks again; the gate defers them until they hit."""

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


def test_a_block_is_findable_once_scheduled_before_it_is_computed(tiny_model_dir: pathlib.Path) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    sched = make_scheduler(tiny_model_dir, 200, 512, cls=Scheduler)
    sched.add_request(make_request("a", [*PREFIX, 1, 2]))
    sched.add_request(make_request("b", [*PREFIX, 3, 4]))
    out = sched.schedule()  # no model step has run: a's prefix blocks are allocated, not computed
    assert out.num_scheduled_tokens == {"a": 258, "b": 2}, (
        f"b hits a's in-flight prefix in the same step: {out.num_scheduled_tokens}"
    )
    late = make_request("c", [*PREFIX, 5, 6])
    sched.add_request(late)
    out = sched.schedule()  # still before any result was fed back
    assert out.num_scheduled_tokens.get("c") == 2, "scheduled-but-uncomputed blocks are hits too"


def test_without_a_chunk_cap_vllm_computes_a_shared_prefix_once(tiny_model_dir: pathlib.Path) -> None:
    """A 256-token prefix against a 128-token budget: the leader's chunks take the whole budget
    until its last one, so no follower is admitted beside a pending block; the gate has nothing to
    defer and the schedule is identical."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from replica.vllm.options import PrefixAwareOptions
    from replica.vllm.scheduler import PrefixAwareScheduler

    once = 256 + 4 * 16
    vllm = prefill_tokens(make_scheduler(tiny_model_dir, 200, 128, cls=Scheduler, max_num_seqs=4))
    ours = prefill_tokens(
        make_scheduler(
            tiny_model_dir,
            200,
            128,
            cls=PrefixAwareScheduler,
            max_num_seqs=4,
            options=PrefixAwareOptions(dedupe_shared_prefixes=True),
            clock=lambda: 0.0,
        )
    )
    assert vllm == ours == once, f"vLLM {vllm}, with the gate {ours}: both compute the prefix once"


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


def test_dedupe_without_a_cap_says_it_does_nothing(
    tiny_model_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    from replica.vllm.options import PrefixAwareOptions
    from replica.vllm.scheduler import PrefixAwareScheduler

    dedupe = PrefixAwareOptions(dedupe_shared_prefixes=True)
    with caplog.at_level("WARNING", logger="replica.vllm.scheduler"):
        make_scheduler(tiny_model_dir, 200, 512, cls=PrefixAwareScheduler, options=dedupe)
    assert "no effect without --long-prefill-token-threshold" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="replica.vllm.scheduler"):
        make_scheduler(tiny_model_dir, 200, 512, cls=PrefixAwareScheduler, long_prefill=64, options=dedupe)
    assert "no effect" not in caplog.text, "with the cap the gate is live: no warning"

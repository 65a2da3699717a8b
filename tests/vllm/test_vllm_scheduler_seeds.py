"""Seed problems 1 and 2 on vLLM's real V1 Scheduler (no model execution; the recipe in
docs/design.md#environment-facts):
admission counts only uncached blocks, and cached tokens are not charged to the token budget.
Each assertion would fail under the old behaviour (charging or reserving for the whole prompt).

And in-flight prefix sharing, which made a replica-side dedupe gate redundant: vLLM caches a block
when it *schedules* it (``KVCacheManager.allocate_slots`` calls ``cache_blocks`` up to
``num_computed_tokens + num_new_tokens`` before the step runs), so the next request finds it at
once, computed or not; without a per-request chunk cap a shared prefix is computed once."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tests.vllm.harness import finish_step, make_request, make_scheduler

pytestmark = pytest.mark.vllm


PREFIX = list(range(10, 266))  # 256 tokens = 16 blocks


def test_cached_tokens_are_not_charged_to_the_budget(tiny_model_dir: pathlib.Path) -> None:
    sched = make_scheduler(tiny_model_dir, num_blocks=200, budget=512)
    sched.add_request(make_request("a", [*PREFIX, 1, 2]))
    out = sched.schedule()
    assert out.num_scheduled_tokens["a"] == 258
    finish_step(sched, out)
    sched.add_request(make_request("b", [*PREFIX, 3, 4]))
    out = sched.schedule()
    assert out.num_scheduled_tokens["b"] == 2, "only the 2 uncached tokens are scheduled (not 258)"


def test_admission_counts_only_uncached_blocks(tiny_model_dir: pathlib.Path) -> None:
    # 20 blocks. "a" (257 tokens, 17 blocks) keeps running, so its 16 prefix blocks stay in use and
    # only 2 blocks are free (vLLM reserves one null block). "b" shares those 16 and needs 18 blocks in all: admitting it is only
    # possible when admission counts the 2 uncached blocks, not all 18.
    sched = make_scheduler(tiny_model_dir, num_blocks=20, budget=512)
    sched.add_request(make_request("a", [*PREFIX, 1], max_tokens=50))
    finish_step(sched, sched.schedule())
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 2  # 20 - 17 - vLLM's null block
    sched.add_request(make_request("b", [*PREFIX, *range(500, 520)]))
    out = sched.schedule()
    assert out.num_scheduled_tokens.get("b") == 20, (
        f"admitted with only its uncached blocks: {out.num_scheduled_tokens}"
    )


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
    until its last one, so no follower is admitted beside a block still to be scheduled."""
    from vllm.v1.core.sched.scheduler import Scheduler

    once = 256 + 4 * 16
    vllm = prefill_tokens(make_scheduler(tiny_model_dir, 200, 128, cls=Scheduler, max_num_seqs=4))
    assert vllm == once, f"vLLM computes the prefix once: {vllm} prompt tokens computed, expected {once}"

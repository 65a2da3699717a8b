"""Seed problems 1 and 2 on vLLM's real V1 Scheduler (no model execution; the recipe in
docs/design.md#environment-facts):
admission counts only uncached blocks, and cached tokens are not charged to the token budget.
Each assertion would fail under the old behaviour (charging or reserving for the whole prompt)."""

from __future__ import annotations

import pathlib

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

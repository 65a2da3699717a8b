"""Seed problems 1 and 2 on vLLM's real V1 Scheduler (no model execution; DESIGN §5 recipe):
admission counts only uncached blocks, and cached tokens are not charged to the token budget.
Each assertion would fail under the old behaviour (charging or reserving for the whole prompt)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
BLOCK = 16


def make_scheduler(model_dir: pathlib.Path, num_blocks: int, budget: int) -> Any:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=2048, seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=budget,
            max_model_len=2048,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
    )
    cfg.cache_config.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer0"],
                FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32),
            )
        ],
    )
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK,
        log_stats=True,
    )


def make_request(rid: str, tokens: list[int], max_tokens: int = 1) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def finish_step(sched: Any, out: Any) -> None:
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[1] for _ in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        ),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from tests.support.vllm import tiny_model

    return tiny_model(tmp_path_factory.mktemp("seeds"))


PREFIX = list(range(10, 266))  # 256 tokens = 16 blocks


def test_cached_tokens_are_not_charged_to_the_budget(model_dir: pathlib.Path) -> None:
    sched = make_scheduler(model_dir, num_blocks=200, budget=512)
    sched.add_request(make_request("a", [*PREFIX, 1, 2]))
    out = sched.schedule()
    assert out.num_scheduled_tokens["a"] == 258
    finish_step(sched, out)
    sched.add_request(make_request("b", [*PREFIX, 3, 4]))
    out = sched.schedule()
    assert out.num_scheduled_tokens["b"] == 2, "only the 2 uncached tokens are scheduled (not 258)"


def test_admission_counts_only_uncached_blocks(model_dir: pathlib.Path) -> None:
    # 20 blocks. "a" (257 tokens, 17 blocks) keeps running, so its 16 prefix blocks stay in use and
    # only 2 blocks are free (vLLM reserves one null block). "b" shares those 16 and needs 18 blocks in all: admitting it is only
    # possible when admission counts the 2 uncached blocks, not all 18.
    sched = make_scheduler(model_dir, num_blocks=20, budget=512)
    sched.add_request(make_request("a", [*PREFIX, 1], max_tokens=50))
    finish_step(sched, sched.schedule())
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 2  # 20 - 17 - vLLM's null block
    sched.add_request(make_request("b", [*PREFIX, *range(500, 520)]))
    out = sched.schedule()
    assert out.num_scheduled_tokens.get("b") == 20, (
        f"admitted with only its uncached blocks: {out.num_scheduled_tokens}"
    )

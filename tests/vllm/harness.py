"""Drive vLLM's real V1 Scheduler with no model (the recipe in docs/design.md#environment-facts):
build it on a real KV cache
config, add requests, and feed back one sampled token per scheduled request."""

from __future__ import annotations

import pathlib
from typing import Any

BLOCK = 16


def make_scheduler(
    model_dir: pathlib.Path,
    num_blocks: int,
    budget: int,
    cls: type[Any] | None = None,
    max_num_seqs: int = 16,
    long_prefill: int = 0,
    **kwargs: Any,
) -> Any:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=2048, seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=2048,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            long_prefill_token_threshold=long_prefill,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
    )
    cfg.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)]
    )
    return (cls or Scheduler)(
        vllm_config=cfg,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK,
        log_stats=True,
        **kwargs,
    )


def make_request(rid: str, tokens: list[int], max_tokens: int = 1, arrival: float | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        None,
        arrival_time=arrival,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def finish_step(sched: Any, out: Any) -> Any:
    """Complete a step as the model runner would: one sampled token (id 1) per scheduled
    request whose prefill is done. Returns the engine-core outputs."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sampled = [[] if sched.requests[r].is_prefill_chunk else [1] for r in ids]
    return sched.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        ),
    )

"""The simulator's ``/metrics``, with vLLM 0.32's names, label sets and buckets
(``vllm/v1/metrics/loggers.py``, ``vllm/v1/metrics/buckets.py``, docs/design.md#vllm-facts):

- gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
  (0–1), and counters ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (tokens),
  ``vllm:num_preemptions``, ``vllm:prompt_tokens``, ``vllm:generation_tokens``, all labelled
  ``model_name`` and ``engine`` (``"0"``); ``vllm:request_success`` adds ``finished_reason``;
- histogram ``vllm:time_to_first_token_seconds`` with vLLM's buckets;
- the load model's inputs (``picker.core.calibration``), from :class:`~.stats.EngineStats` with vLLM's
  semantics: counters ``vllm:prompt_tokens_by_source{source}`` (``local_compute``,
  ``local_cache_hit``, ``external_kv_transfer``), histograms ``vllm:inter_token_latency_seconds``,
  ``vllm:iteration_tokens_total``, ``vllm:request_{queue,prefill,decode}_time_seconds`` and
  ``vllm:request_prefill_kv_computed_tokens``; ``vllm:prompt_tokens`` and
  ``vllm:generation_tokens`` count at the first token and per token, as vLLM's do;
- ``vllm:cache_config_info``: a gauge at 1 labelled with every ``CacheConfig`` field and ``engine``;
- ``vllm:lora_requests_info{max_lora,waiting_lora_adapters,running_lora_adapters}`` set to the
  current time on each refresh, only when LoRA adapters are served (as vLLM, without LoRA, has none).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .engine import EngineCore

TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's ``build_buckets([1, 2, 5], max_model_len)``: 1, 2, 5, 10, 20, 50, ... up to the limit."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(float(m * scale))
        scale *= 10


CACHE_CONFIG_KEYS = [
    "block_size",
    "user_specified_block_size",
    "kv_cache_layout",
    "prefix_match_unit",
    "gpu_memory_utilization",
    "cache_dtype",
    "is_attention_free",
    "num_gpu_blocks_override",
    "sliding_window",
    "enable_prefix_caching",
    "prefix_caching_hash_algo",
    "prefix_cache_retention_interval",
    "kv_cache_dtype_skip_layers",
    "mamba_page_size_padded",
    "skip_page_size_padded",
    "mamba_block_size",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
    "mamba_cache_mode",
    "enable_mamba_shared_prefix_checkpoint",
    "replayssm_buffer_len",
    "use_replayssm",
    "use_kda_recoverssm",
    "num_gpu_blocks",
    "num_cpu_blocks",
    "effective_attention_block_size",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
    "hash_block_size",
    "cache_hit_alignment_tokens",
    "kv_sharing_fast_prefill",
    "swa_bounded_replay",
    "kv_cache_memory_bytes",
    "kv_offloading_size",
    "kv_offloading_backend",
    "_block_size_resolved",
]


def _cache_config(core: EngineCore) -> dict[str, str]:
    labels = dict.fromkeys(CACHE_CONFIG_KEYS, "None")
    labels.update(
        block_size=str(core.pool.block_size),
        num_gpu_blocks=str(core.pool.num_blocks),
        enable_prefix_caching="True",
        gpu_memory_utilization="0.9",
        cache_dtype="auto",
        prefix_caching_hash_algo="xxhash",
        user_specified_block_size="True",
        _block_size_resolved="True",
    )
    return {**labels, "engine": "0"}


class Metrics:
    def __init__(self, core: EngineCore, model: str, loras: tuple[str, ...] = (), max_loras: int = 1) -> None:
        r = self.registry = CollectorRegistry()
        names, lbl = ["model_name", "engine"], {"model_name": model, "engine": "0"}
        self.core, self.loras, self.max_loras = core, loras, max_loras
        self.running = Gauge("vllm:num_requests_running", "Running requests.", names, registry=r).labels(
            **lbl
        )
        self.waiting = Gauge("vllm:num_requests_waiting", "Waiting requests.", names, registry=r).labels(
            **lbl
        )
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100%.", names, registry=r).labels(
            **lbl
        )
        self.queries = Counter(
            "vllm:prefix_cache_queries", "Prefix-cache queries (tokens).", names, registry=r
        )
        self.hits = Counter("vllm:prefix_cache_hits", "Prefix-cache hits (tokens).", names, registry=r)
        self.preempt = Counter("vllm:num_preemptions", "Cumulative preemptions.", names, registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed.", names, registry=r).labels(
            **lbl
        )
        self.gen = Counter("vllm:generation_tokens", "Generation tokens.", names, registry=r).labels(**lbl)
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*names, "source"],
            registry=r,
        )
        self.by_source = {src: by_source.labels(**lbl, source=src) for src in PROMPT_SOURCES}

        def hist(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, names, registry=r, buckets=buckets).labels(**lbl)

        self.hists = {
            "itl": hist(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                ITL_BUCKETS,
            ),
            "iteration_tokens": hist(
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                ITERATION_TOKENS_BUCKETS,
            ),
            "queue": hist(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            "prefill": hist(
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            "decode": hist(
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                REQUEST_LATENCY_BUCKETS,
            ),
            "prefill_kv_computed": hist(
                "vllm:request_prefill_kv_computed_tokens",
                "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                request_tokens_buckets(core.max_model_len),
            ),
        }
        core.stats.observer = lambda name, v: self.hists[name].observe(v)
        self.success = Counter(
            "vllm:request_success", "Successful requests.", [*names, "finished_reason"], registry=r
        ).labels(**lbl, finished_reason="length")
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            registry=r,
            buckets=TTFT_BUCKETS,
        ).labels(**lbl)
        cfg = _cache_config(core)
        Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(cfg), registry=r
        ).labels(**cfg).set(1)
        self.lora_info = (
            Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=r,
            )
            if loras
            else None
        )
        self._counted = (
            self.queries.labels(**lbl),
            self.hits.labels(**lbl),
            self.preempt.labels(**lbl),
            self.prompt,
            self.gen,
            self.by_source["local_compute"],
            self.by_source["local_cache_hit"],
        )
        self._seen = [0] * len(self._counted)

    def render(self) -> bytes:
        s, pool = self.core.sched, self.core.pool
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting))
        self.kv.set(pool.usage())
        st = self.core.stats
        totals = (
            s.queries,
            s.hits,
            s.preemptions,
            st.prompt_tokens,
            st.generation_tokens,
            st.computed_prompt_tokens,
            st.prompt_tokens - st.computed_prompt_tokens,
        )
        for i, (counter, total) in enumerate(zip(self._counted, totals, strict=True)):
            counter.inc(total - self._seen[i])
            self._seen[i] = total
        if self.lora_info is not None:
            running = ",".join(sorted({r.lora for r in s.running if r.lora}))
            waiting = ",".join(sorted({r.lora for r in s.waiting if r.lora}))
            self.lora_info.labels(str(self.max_loras), waiting, running).set(time.time())
        return generate_latest(self.registry)

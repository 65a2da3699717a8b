"""Roofline step-time model: how long one engine step takes on a GPU profile.

A step computes ``n_i`` new tokens for each scheduled request ``i`` whose context (tokens already
in its KV cache) is ``c_i``; a decode is ``n_i = 1``. With ``P`` parameters, ``L`` layers, query
width ``D = heads × head_dim``, ``K`` KV bytes per token and tensor parallelism ``tp``::

    FLOPs = (2·P·Σn_i + 4·L·D·Σ(n_i·c_i + n_i²/2)) / tp      (linear layers + attention)
    bytes = (2·P + K·Σ(c_i + n_i)) / tp                       (bf16 weights once + KV read/written)
    t     = overhead + max(FLOPs / (peak_flops·MFU), bytes / (hbm_bw·MBU))

TP all-reduce time is not modelled (it hides under the overhead at these sizes). KV capacity:
``num_gpu_blocks = (mem·tp·0.9 − 2·P) / (K·block_size)`` (vLLM's default 0.9 memory utilization).
Where the bf16 weights do not fit (L4 with Llama-3.1-70B or Qwen3-32B) it floors at 16 blocks.

Assumed figures (bf16, dense): H100 SXM 989 TFLOP/s, 3.35 TB/s, 80 GB; H200 989 TFLOP/s,
4.8 TB/s, 141 GB; A100 80GB 312 TFLOP/s, 2.04 TB/s; L4 121 TFLOP/s, 0.3 TB/s, 24 GB.
MFU 0.5, MBU 0.8, 2 ms per-step overhead (scheduling, sampling, kernel launches).
Models: Llama-3.1-8B (8.03e9 params, 32 layers, D 4096, 8 KV heads × 128 → K = 128 KiB);
Llama-3.1-70B (70.6e9, 80 layers, D 8192, K = 320 KiB, TP 4); Qwen3-32B (32.8e9, 64 layers,
64 query heads × 128 → D 8192, 8 KV heads → K = 256 KiB, TP 2).

Predicted (``python -m replica.sim.costmodel``), Llama-3.1-8B on one H100: TTFT of a 1,024-token
prompt on an idle engine 36 ms; a batch-1 decode step 8.0 ms, i.e. 125 tokens/s per sequence.
Published, vLLM's own CI performance dashboard (buildkite.com/vllm/performance-benchmark, build
9515, test ``latency_llama8B_tp1``): Llama-3.1-8B on one H200, batch 8, 32 tokens in, 128 out:
833 ms end to end (6.5 ms per step). This model gives 799 ms for that test on ``h200-llama-3.1-8b``.

``cpu-test`` is a CPU profile fitted to the real vLLM-CPU replica with the tiny model
(:data:`CPU_TEST`: 1.4 ms + 17.5 µs per token + 21.5 ns per attention pair + 0.1 ms per
sequence), so cluster-mode studies on it transfer to that engine. Every step time is multiplied by the engine's ``--time-scale``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    flops: float
    bw: float
    mem_bytes: float


@dataclass(frozen=True)
class Model:
    params: float
    layers: int
    attn_width: int  # query heads × head dim
    kv_bytes_per_token: int
    tp: int = 1


GPUS = {
    "h100": Gpu(989e12, 3.35e12, 80e9),
    "h200": Gpu(989e12, 4.8e12, 141e9),
    "a100": Gpu(312e12, 2.04e12, 80e9),
    "l4": Gpu(121e12, 0.3e12, 24e9),
}
MODELS = {
    "llama-3.1-8b": Model(8.03e9, 32, 4096, 131072),
    "llama-3.1-70b": Model(70.6e9, 80, 8192, 327680, tp=4),
    "qwen3-32b": Model(32.8e9, 64, 8192, 262144, tp=2),
}


@dataclass(frozen=True)
class Profile:
    name: str
    gpu: Gpu | None
    model: Model | None
    mfu: float = 0.5
    mbu: float = 0.8
    overhead_s: float = 0.002
    per_token_s: float = 2e-6
    """Linear profiles (no GPU, ``cpu-test``): seconds per computed token; the step also costs
    ``overhead_s``, ``per_seq_s`` per scheduled request and ``per_attn_s`` per attention pair."""
    per_seq_s: float = 2e-5
    per_attn_s: float = 0.0
    """Linear profiles: seconds per (new token, context token) pair, ``n·c + n²/2`` for a request
    computing ``n`` tokens after ``c``: the part of a CPU prefill that grows with its square."""

    def step_time(self, batch: Sequence[tuple[int, int]]) -> float:
        """Seconds for one step; ``batch``: (new tokens, context before them) per request."""
        if self.gpu is None or self.model is None:  # linear (cpu-test)
            tokens, pairs = 0, 0.0
            for n, c in batch:
                tokens += n
                pairs += n * c + n * n / 2
            return (
                self.overhead_s
                + tokens * self.per_token_s
                + pairs * self.per_attn_s
                + len(batch) * self.per_seq_s
            )
        g, m = self.gpu, self.model
        tokens = ctx_tokens = 0
        attn = 0.0
        for n, c in batch:
            tokens += n
            ctx_tokens += c + n
            attn += n * c + n * n / 2
        flops = (2 * m.params * tokens + 4 * m.layers * m.attn_width * attn) / m.tp
        nbytes = (2 * m.params + ctx_tokens * m.kv_bytes_per_token) / m.tp
        return self.overhead_s + max(flops / (g.flops * self.mfu), nbytes / (g.bw * self.mbu))

    def num_gpu_blocks(self, block_size: int, gpu_memory_utilization: float = 0.9) -> int:
        if self.gpu is None or self.model is None:
            return 4096
        g, m = self.gpu, self.model
        free = g.mem_bytes * m.tp * gpu_memory_utilization - 2 * m.params
        return max(16, int(free // (m.kv_bytes_per_token * block_size)))


CPU_TEST = (0.0014, 17.5e-6, 1e-4, 2.15e-8)
"""``cpu-test``: (overhead, per token, per request, per attention pair) seconds, fitted to the
real vLLM-CPU replica serving the tiny model (``replica.tinymodel``) on an otherwise idle 2-core
machine: cold prefills of 512, 1,024 and 1,536 tokens took 12.7, 28.3 and 51.2 ms
(``vllm:request_prefill_time_seconds``) and a decode step alone 1.46 ms
(``vllm:inter_token_latency_seconds``); the fit sits about 5% above those (13.3, 30.7, 53.8 and
1.52 ms), because other load only ever slows the real engine. A purely linear fit cannot hold
both ends: the prefill grows faster than its length. ``tests/sim/test_fidelity.py`` checks the
prediction against a fresh measurement."""


def profile(name: str) -> Profile:
    """``cpu-test`` or ``<gpu>-<model>``, e.g. ``h100-llama-3.1-8b``."""
    if name == "cpu-test":
        return Profile(
            name,
            None,
            None,
            overhead_s=CPU_TEST[0],
            per_token_s=CPU_TEST[1],
            per_seq_s=CPU_TEST[2],
            per_attn_s=CPU_TEST[3],
        )
    gpu, _, model = name.partition("-")
    if gpu not in GPUS or model not in MODELS:
        known = ", ".join(f"{g}-{m}" for g in GPUS for m in MODELS)
        raise ValueError(f"unknown profile {name!r}; known: cpu-test, {known}")
    return Profile(name, GPUS[gpu], MODELS[model])


def latency_test(p: Profile, batch: int, prompt: int, output: int) -> float:
    """End-to-end seconds of ``batch`` identical requests run together (vLLM's latency test)."""
    total = p.step_time([(prompt, 0)] * batch)
    for k in range(1, output):
        total += p.step_time([(1, prompt + k - 1)] * batch)
    return total


if __name__ == "__main__":
    for name in ("h100-llama-3.1-8b", "h200-llama-3.1-8b"):
        p = profile(name)
        step = p.step_time([(1, 1024)])
        print(
            f"{name}: TTFT(1024 tokens, idle) {p.step_time([(1024, 0)]) * 1e3:.1f} ms; "
            f"decode step (batch 1, ctx 1024) {step * 1e3:.1f} ms = {1 / step:.0f} tok/s; "
            f"latency test (batch 8, 32 in, 128 out) {latency_test(p, 8, 32, 128) * 1e3:.0f} ms; "
            f"KV blocks of 16: {p.num_gpu_blocks(16)}"
        )

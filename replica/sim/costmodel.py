"""Roofline step-time model: how long one engine step takes on a GPU profile.

    t(step) = overhead + max(FLOPs / (peak_flops * mfu), bytes / (hbm_bw * mbu))
    FLOPs   = 2 * params * tokens + 4 * layers * hidden * Σ(context of each prefill token)
    bytes   = weight_bytes / tp + Σ(context of each decode request) * kv_bytes_per_token / tp

Assumed figures (bf16): H100 SXM 989 TFLOP/s dense, 3.35 TB/s; H200 989 TFLOP/s, 4.8 TB/s;
A100 80GB 312 TFLOP/s, 2.0 TB/s; L4 121 TFLOP/s, 0.3 TB/s; MFU 0.5, MBU 0.8, 4 ms step overhead.
Llama-3.1-8B: 8.03e9 params, 32 layers, hidden 4096, 8 KV heads × 128 → 128 KiB KV per token.

Predicted, Llama-3.1-8B on one H100 (``python -m replica.sim.costmodel``): a 1,024-token prompt's
prefill ≈ 4 ms + 16.4 TFLOP / 495 TFLOP/s ≈ 37 ms TTFT on an idle engine; a batch-1 decode step
≈ 4 ms + 16 GB / 2.7 TB/s ≈ 10 ms (≈ 100 tokens/s per sequence). vLLM's published H100 figures for
Llama-3-8B (vLLM v0.6.0 performance blog, Sept 2024) report TTFT in the tens of milliseconds at low
load and about 10 ms per output token — the same order as this model.

The ``cpu-test`` profile is deliberately small and fast for tests and laptops.
"""

from __future__ import annotations

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
    hidden: int
    kv_bytes_per_token: int
    tp: int = 1


GPUS = {
    "h100": Gpu(989e12, 3.35e12, 80e9),
    "h200": Gpu(989e12, 4.8e12, 141e9),
    "a100": Gpu(312e12, 2.0e12, 80e9),
    "l4": Gpu(121e12, 0.3e12, 24e9),
}
MODELS = {
    "llama-3.1-8b": Model(8.03e9, 32, 4096, 131072),
    "llama-3.1-70b": Model(70.6e9, 80, 8192, 327680, tp=4),
    "qwen3-32b": Model(32.8e9, 64, 5120, 262144, tp=2),
}


@dataclass(frozen=True)
class Profile:
    name: str
    gpu: Gpu | None
    model: Model | None
    mfu: float = 0.5
    mbu: float = 0.8
    overhead_s: float = 0.004

    def step_time(self, prefill: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        """``prefill``: (new tokens, context before them) per prefilling request;
        ``decode_contexts``: context length of each decoding request."""
        if self.gpu is None or self.model is None:  # cpu-test: fixed costs, fast
            new = sum(n for n, _ in prefill)
            return 0.001 + new * 2e-6 + len(decode_contexts) * 2e-5
        g, m = self.gpu, self.model
        tokens = sum(n for n, _ in prefill) + len(decode_contexts)
        attn = sum(4 * m.layers * m.hidden * (n * ctx + n * n / 2) for n, ctx in prefill)
        flops = (2 * m.params * tokens + attn) / m.tp
        nbytes = (2 * m.params + sum(decode_contexts) * m.kv_bytes_per_token) / m.tp
        return self.overhead_s + max(flops / (g.flops * self.mfu), nbytes / (g.bw * self.mbu))

    def num_gpu_blocks(self, block_size: int, gpu_memory_utilization: float = 0.9) -> int:
        if self.gpu is None or self.model is None:
            return 4096
        g, m = self.gpu, self.model
        free = g.mem_bytes * m.tp * gpu_memory_utilization - 2 * m.params
        return max(16, int(free // (m.kv_bytes_per_token * block_size)))


def profile(name: str) -> Profile:
    """``cpu-test`` or ``<gpu>-<model>``, e.g. ``h100-llama-3.1-8b``."""
    if name == "cpu-test":
        return Profile(name, None, None)
    gpu, _, model = name.partition("-")
    if gpu not in GPUS or model not in MODELS:
        known = ", ".join(f"{g}-{m}" for g in GPUS for m in MODELS)
        raise ValueError(f"unknown profile {name!r}; known: cpu-test, {known}")
    return Profile(name, GPUS[gpu], MODELS[model])


if __name__ == "__main__":
    p = profile("h100-llama-3.1-8b")
    print(
        f"{p.name}: TTFT(1024 tokens, idle) = {p.step_time([(1024, 0)], []) * 1e3:.1f} ms; "
        f"decode step (batch 1, ctx 1024) = {p.step_time([], [1024]) * 1e3:.1f} ms; "
        f"KV blocks of 16 = {p.num_gpu_blocks(16)}"
    )

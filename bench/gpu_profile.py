"""``python -m bench.gpu_profile [--dry-run] [--out DIR]``: the simulator's GPU profile against real kernels.

Issue 25 (b). ``replica/sim/costmodel.py`` predicts an engine step's duration from a roofline
(``Profile.step_time``); nobody had checked it against a GPU. This times the same steps on the
GPU in hand with a Llama-3.1-8B-shaped decoder written in plain torch (32 layers, hidden 4096,
32 query heads and 8 KV heads of 128, SwiGLU 14336, vocab 128256, RMSNorm, RoPE with Llama 3.1's
frequency scaling), random bf16 weights made on the device (nothing downloaded), attention through
``scaled_dot_product_attention`` (the flash kernel on GPU) over a contiguous KV cache:

- **prefill**: one sequence of ``n`` new tokens after ``c`` tokens already in the cache (the
  cached prefix the picker routes for), the new tokens attending causally to the cache and to each
  other (lower-right causal mask);
- **decode**: ``batch`` sequences of ``context`` cached tokens each compute one token, replayed
  from a CUDA graph as vLLM runs its decode batches (the eager time is reported beside it).

Each step ends with the final norm, the LM head on each sequence's last position and a greedy
pick. Timing: CUDA events, warm-up runs, the median of a few repeats. The prediction is the
profile's own ``step_time`` for the batch the simulator's engine would hand it (``(computed
tokens, context before them)`` per request, as ``Engine`` builds it from
``Scheduler.computed_part``). ``ratio`` is measured / predicted; the issue's target is within
20% on prefill and on decode (median ratio in 0.8–1.2). The predicted time includes the profile's
per-step overhead (2 ms: scheduling, sampling, launches), which a bare forward does not pay, so
``ratio_no_overhead`` compares against the roofline part alone.

The profile follows the GPU's name (H200 → ``h200-llama-3.1-8b``, H100 → ``h100-llama-3.1-8b``,
A100, L4; another GPU is compared with the H100 profile and says so). Points whose KV cache and
activations do not fit in free memory are skipped with the figures, as is anything left when the
time budget runs out.

``--dry-run`` (no GPU needed): the same code on CPU, float32, with the tiny model's shapes
(``replica.tinymodel``: 2 layers, hidden 256, 4 heads and 2 KV heads of 64), short prompts and
small batches, compared with the ``cpu-test`` profile. It shows that the kit runs end to end;
its ratios mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from replica.sim.costmodel import Profile, profile

GiB = 1 << 30
TARGET = 0.2
"""Within 20%: the median ratio of a step kind in [1 - TARGET, 1 + TARGET]."""


@dataclass(frozen=True)
class Config:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 500_000.0
    llama3_rope: bool = True
    """Llama 3.1's RoPE frequency scaling (factor 8, low 1, high 4, original 8,192 positions)."""
    eps: float = 1e-5

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the decoder allocates, as ``F.linear`` takes it (out, in); Q, K and V
        are one fused matrix and gate and up another, as vLLM loads them."""
        d = self.hidden
        shapes: dict[str, tuple[int, ...]] = {"embed": (self.vocab, d)}
        for i in range(self.layers):
            shapes[f"layers.{i}.input_norm"] = (d,)
            shapes[f"layers.{i}.qkv"] = (self.q_width + 2 * self.kv_width, d)
            shapes[f"layers.{i}.o"] = (d, self.q_width)
            shapes[f"layers.{i}.post_norm"] = (d,)
            shapes[f"layers.{i}.gate_up"] = (2 * self.intermediate, d)
            shapes[f"layers.{i}.down"] = (d, self.intermediate)
        shapes["norm"] = (d,)
        shapes["lm_head"] = (self.vocab, d)  # untied, as Llama-3.1-8B
        return shapes

    def param_count(self) -> int:
        return sum(math.prod(s) for s in self.weight_shapes().values())

    def kv_bytes(self, batch: int, length: int, elem_bytes: int) -> int:
        """K and V of ``batch`` sequences of ``length`` tokens, all layers."""
        return 2 * self.layers * batch * length * self.kv_width * elem_bytes


LLAMA_3_1_8B = Config("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256)
TINY = Config("tiny (replica.tinymodel's shapes)", 2, 256, 4, 2, 64, 512, 2048, 10_000.0, False)


@dataclass(frozen=True)
class Plan:
    config: Config
    dtype: torch.dtype
    prefill: tuple[tuple[int, int], ...]
    """(new tokens, cached tokens) of one sequence."""
    decode: tuple[tuple[int, int], ...]
    """(batch, context) with one token per sequence."""
    warmup: int
    repeats: int
    long_prefill: int
    """Prefills of at least this many new tokens: one warm-up and three repeats."""


GPU_PLAN = Plan(
    LLAMA_3_1_8B,
    torch.bfloat16,
    prefill=((512, 0), (2048, 0), (8192, 0), (32768, 0), (512, 4096), (512, 16384)),
    decode=tuple((b, c) for b in (1, 8, 32, 128) for c in (1024, 8192)),
    warmup=2,
    repeats=5,
    long_prefill=16384,
)
DRY_PLAN = Plan(
    TINY,
    torch.float32,
    prefill=((32, 0), (128, 0), (32, 64), (32, 192)),
    decode=tuple((b, c) for b in (1, 4) for c in (64, 256)),
    warmup=1,
    repeats=3,
    long_prefill=1 << 30,
)


# --------------------------------------------------------------------------------------- the model
@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class KVCache:
    """Per layer, K and V as ``[batch, kv_heads, length, head_dim]``, filled with noise."""

    def __init__(self, cfg: Config, batch: int, length: int, device: torch.device, dtype: torch.dtype):
        shape = (batch, cfg.kv_heads, length, cfg.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype).normal_() for _ in range(cfg.layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype).normal_() for _ in range(cfg.layers)]


def _inv_freq(cfg: Config) -> torch.Tensor:
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    if cfg.llama3_rope:  # transformers' _compute_llama3_parameters
        factor, low, high, original = 8.0, 1.0, 4.0, 8192.0
        wavelen = 2 * math.pi / inv
        smooth = (original / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > original / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen >= original / high) & (wavelen <= original / low)
        inv = torch.where(is_mid, mid, scaled)
    return inv.to(torch.float32)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Decoder:
    """A Llama decoder over a :class:`KVCache`, random weights made where it runs (``meta``: shapes
    only, nothing allocated)."""

    def __init__(self, cfg: Config, device: torch.device, dtype: torch.dtype, seed: int = 0):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.gqa_native = True
        """``enable_gqa`` in SDPA; False: K and V repeated to the query heads first."""
        torch.manual_seed(seed)
        w: dict[str, torch.Tensor] = {}
        for name, shape in cfg.weight_shapes().items():
            t = torch.empty(shape, device=device, dtype=dtype)
            if len(shape) == 1:
                t.fill_(1.0)
            else:  # unit-variance activations out of each product; embeddings ~ N(0, 1)
                t.normal_(0.0, 1.0 if name == "embed" else shape[1] ** -0.5)
            w[name] = t
        self.weights = w
        self.embed, self.norm, self.lm_head = w["embed"], w["norm"], w["lm_head"]
        self.layers = [
            Layer(*(w[f"layers.{i}.{p}"] for p in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")))
            for i in range(cfg.layers)
        ]
        self.inv_freq = _inv_freq(cfg).to(device)

    def param_count(self) -> int:
        return sum(t.numel() for t in self.weights.values())

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        n = q.shape[2]
        if not self.gqa_native:
            g = self.cfg.heads // self.cfg.kv_heads
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        gqa = self.gqa_native
        if n == 1:  # a decode token sees its whole context
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        if start == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        mask = causal_lower_right(n, start + n)  # new tokens see the cache and their own past
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def forward(self, ids: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        """One step: ``ids`` ``[batch, n]`` at positions ``start..start+n-1`` of every sequence,
        K and V written into ``cache``; returns each sequence's next token (greedy)."""
        cfg = self.cfg
        b, n = ids.shape
        d, hd, qw, kw = cfg.hidden, cfg.head_dim, cfg.q_width, cfg.kv_width
        pos = torch.arange(start, start + n, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        h = F.embedding(ids, self.embed)
        end = start + n
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(h, [d], layer.input_norm, cfg.eps)
            qkv = F.linear(x, layer.qkv)
            q = qkv[..., :qw].view(b, n, cfg.heads, hd).transpose(1, 2)
            k = qkv[..., qw : qw + kw].view(b, n, cfg.kv_heads, hd).transpose(1, 2)
            v = qkv[..., qw + kw :].view(b, n, cfg.kv_heads, hd).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            ck, cv = cache.k[i], cache.v[i]
            ck[:, :, start:end] = k
            cv[:, :, start:end] = v
            a = self._attend(q, ck[:, :, :end], cv[:, :, :end], start)
            h = h + F.linear(a.transpose(1, 2).reshape(b, n, cfg.q_width), layer.o)
            x = F.rms_norm(h, [d], layer.post_norm, cfg.eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        last = F.rms_norm(h[:, -1], [d], self.norm, cfg.eps)
        return F.linear(last, self.lm_head).argmax(dim=-1)


# ------------------------------------------------------------------------------------ measuring
def profile_name(device_name: str | None) -> tuple[str, str]:
    """The costmodel profile to compare with, and why."""
    if device_name is None:
        return "cpu-test", "dry run on CPU: the cpu-test profile (fitted to the tiny model on vLLM-CPU)"
    for pattern, gpu in ((r"H200", "h200"), (r"H100", "h100"), (r"A100", "a100"), (r"\bL4\b", "l4")):
        if re.search(pattern, device_name, re.IGNORECASE):
            return f"{gpu}-llama-3.1-8b", f"{device_name} → {gpu}-llama-3.1-8b"
    return "h100-llama-3.1-8b", f"no profile for {device_name}; compared with h100-llama-3.1-8b"


def predicted(p: Profile, kind: str, a: int, b: int) -> float:
    """What the simulator charges for the step: ``step_time`` of the (computed tokens, context
    before them) pairs its engine passes (``Engine`` via ``Scheduler.computed_part``)."""
    work = [(a, b)] if kind == "prefill" else [(1, b)] * a
    return p.step_time(work)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds per call, after ``warmup`` calls: CUDA events on GPU, ``perf_counter`` on CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out: list[float] = []
    for _ in range(repeats):
        if device.type == "cuda":
            s = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            e = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            s.record()
            fn()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def _graph(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (warmed on a side stream first, as torch asks)."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay  # the bound method keeps the graph (and its memory pool) alive


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _need_bytes(cfg: Config, batch: int, new: int, length: int, elem: int, expand: bool) -> tuple[int, int]:
    """(KV cache, working set) bytes of a step: the cache of ``length`` tokens per sequence, and
    the largest activations of one layer (fused QKV and gate/up outputs, residual, norms), with
    the repeated K/V when GQA is expanded."""
    tokens = batch * new
    act = tokens * (3 * cfg.intermediate + 2 * (cfg.q_width + 2 * cfg.kv_width) + 4 * cfg.hidden) * elem
    act += batch * cfg.vocab * 4
    if expand:
        act += 2 * batch * cfg.heads * length * cfg.head_dim * elem
    return cfg.kv_bytes(batch, length, elem), act


def does_not_fit(cfg: Config, kind: str, a: int, b: int, elem: int, expand: bool, free: int) -> str | None:
    """Why the step does not fit in ``free`` bytes, or None: its KV cache and working set
    (:func:`_need_bytes`) and a margin of 1 GiB and 5% of the free memory (workspaces, graph pool)."""
    batch, new, start = (1, a, b) if kind == "prefill" else (a, 1, b)
    kv, act = _need_bytes(cfg, batch, new, start + new, elem, expand)
    margin = GiB + free // 20
    if kv + act + margin <= free:
        return None
    return (
        f"does not fit: KV cache {kv / GiB:.1f} GiB + activations {act / GiB:.1f} GiB "
        f"+ margin {margin / GiB:.1f} GiB > free {free / GiB:.1f} GiB"
    )


def _probe_attention(model: Decoder) -> str:
    """On GPU, whether the flash kernel takes native GQA for all three masks the steps use;
    if not, K and V are repeated to the query heads (vLLM never does: it costs memory traffic)."""
    if model.device.type != "cuda":
        model.gqa_native = True
        return "SDPA on CPU (math path), native GQA"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg, dev, dt = model.cfg, model.device, model.dtype
    q = torch.randn(1, cfg.heads, 64, cfg.head_dim, device=dev, dtype=dt)
    k = torch.randn(1, cfg.kv_heads, 192, cfg.head_dim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q, k[:, :, :64], v[:, :, :64], is_causal=True, enable_gqa=True)
            F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(64, 192), enable_gqa=True)
            F.scaled_dot_product_attention(q[:, :, :1], k, v, enable_gqa=True)
        _sync(dev)
        model.gqa_native = True
        return "SDPA flash kernel, native GQA"
    except (RuntimeError, ValueError) as e:  # no kernel for it, or SDPA's own input checks
        model.gqa_native = False
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"SDPA, K/V repeated to the query heads (flash with native GQA failed: {first[:200]})"


def _point(kind: str, a: int, b: int) -> dict[str, object]:
    if kind == "prefill":
        return {"kind": kind, "new_tokens": a, "cached_tokens": b, "batch": 1}
    return {"kind": kind, "batch": a, "context": b}


def _label(pt: dict[str, object]) -> str:
    if pt["kind"] == "prefill":
        return f"prefill {pt['new_tokens']} new over {pt['cached_tokens']} cached"
    return f"decode batch {pt['batch']} at context {pt['context']}"


def _measure(model: Decoder, plan: Plan, kind: str, a: int, b: int, use_graph: bool) -> dict[str, object]:
    cfg, dev, dt = model.cfg, model.device, model.dtype
    batch, new, start = (1, a, b) if kind == "prefill" else (a, 1, b)
    cache = KVCache(cfg, batch, start + new, dev, dt)
    ids = torch.randint(0, cfg.vocab, (batch, new), device=dev)
    warmup, repeats = plan.warmup, plan.repeats
    if kind == "prefill" and new >= plan.long_prefill:
        warmup, repeats = 1, 3

    def step() -> torch.Tensor:
        return model.forward(ids, start, cache)

    out: dict[str, object] = {}
    times = _time(step, dev, warmup, repeats)
    if kind == "decode" and use_graph:
        out["measured_eager_s"] = statistics.median(times)
        try:
            times = _time(_graph(step), dev, warmup, repeats)
            out["mode"] = "cuda graph"
        except RuntimeError as e:
            out["mode"] = f"eager (graph capture failed: {str(e).strip()[:200]})"
    else:
        out["mode"] = "eager"
    out["times_s"] = times
    out["measured_s"] = statistics.median(times)
    return out  # the cache and any graph go with this frame


def _summary(points: list[dict[str, object]], kind: str) -> dict[str, object]:
    ratios = [float(p["ratio"]) for p in points if p["kind"] == kind]  # type: ignore[arg-type]
    bare = [float(p["ratio_no_overhead"]) for p in points if p["kind"] == kind]  # type: ignore[arg-type]
    if not ratios:
        return {"points": 0, "median_ratio": None, "within_20pct": False}
    med = statistics.median(ratios)
    return {
        "points": len(ratios),
        "median_ratio": med,
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "within_20pct": abs(med - 1.0) <= TARGET,
        "median_ratio_no_overhead": statistics.median(bare),
    }


def run(out_dir: pathlib.Path, dry: bool, budget_s: float | None = None) -> dict[str, object]:
    """Time the plan's steps, compare with the profile, write ``gpu_profile.json`` and
    ``gpu_profile.md`` into ``out_dir``; returns the JSON document. ``budget_s`` (default 180 s on
    a GPU, none dry) stops starting new points once spent; those left are listed as skipped."""
    t0 = time.monotonic()
    plan = DRY_PLAN if dry else GPU_PLAN
    cfg = plan.config
    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda") if cuda else torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if cuda else None
    budget = budget_s if budget_s is not None else (None if dry else 180.0)
    pname, pnote = profile_name(device_name)
    prof = profile(pname)
    doc: dict[str, object] = {
        "issue": "25 (b): the simulator's GPU profiles against real kernels",
        "dry_run": dry,
        "device": device_name
        or f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "profile": pname,
        "profile_note": pnote,
        "model": {
            **asdict(cfg),
            "params": cfg.param_count(),
            "dtype": str(plan.dtype).removeprefix("torch."),
        },
        "ratio": "measured / predicted; predicted = Profile.step_time of the step (its 2 ms overhead "
        "included); ratio_no_overhead leaves the overhead out",
        "target": f"median ratio within {TARGET:.0%} of 1, for prefill and for decode",
    }
    if dry:
        doc["note"] = (
            "dry run on CPU with tiny shapes: it shows the kit runs end to end; "
            "the ratios are meaningless here"
        )
    points: list[dict[str, object]] = []
    skipped: list[dict[str, object]] = []
    doc["points"], doc["skipped"] = points, skipped
    if not dry and not torch.cuda.is_available():
        doc["error"] = "no CUDA device: the 8B model needs a GPU (run with dry=True for the CPU check)"
        doc["summary"] = {"prefill": _summary([], "prefill"), "decode": _summary([], "decode")}
        _write(out_dir, doc)
        return doc

    elem = torch.finfo(plan.dtype).bits // 8
    with torch.inference_mode():
        model = Decoder(cfg, device, plan.dtype)
        _sync(device)
        doc["weights_gib"] = round(cfg.param_count() * elem / GiB, 2)
        doc["model_init_s"] = round(time.monotonic() - t0, 2)
        doc["attention"] = _probe_attention(model)
        todo = [("prefill", n, c) for n, c in plan.prefill] + [("decode", b, c) for b, c in plan.decode]
        for kind, a, b in todo:
            pt = _point(kind, a, b)
            if budget is not None and time.monotonic() - t0 > budget:
                skipped.append({**pt, "reason": f"time budget of {budget:.0f} s spent"})
                continue
            why = does_not_fit(cfg, kind, a, b, elem, not model.gqa_native, _free_bytes(device))
            if why is not None:
                skipped.append({**pt, "reason": why})
                continue
            try:
                m = _measure(model, plan, kind, a, b, use_graph=cuda)
            except torch.OutOfMemoryError as e:
                skipped.append({**pt, "reason": f"out of memory: {str(e).strip()[:200]}"})
                continue
            except (RuntimeError, ValueError) as e:  # one broken point must not lose the others
                skipped.append({**pt, "reason": f"error: {type(e).__name__}: {str(e).strip()[:300]}"})
                continue
            finally:
                _sync(device)
            batch, new, start = (1, a, b) if kind == "prefill" else (a, 1, b)
            kv = cfg.kv_bytes(batch, start + new, elem)
            pred = predicted(prof, kind, a, b)
            bare = pred - prof.overhead_s
            ms = float(m["measured_s"])  # type: ignore[arg-type]
            pt.update(m)
            pt.update(
                {
                    "kv_cache_gib": round(kv / GiB, 3),
                    "predicted_s": pred,
                    "predicted_no_overhead_s": bare,
                    "ratio": ms / pred,
                    "ratio_no_overhead": ms / bare,
                }
            )
            points.append(pt)
        del model
    if cuda:
        torch.cuda.empty_cache()
    doc["summary"] = {"prefill": _summary(points, "prefill"), "decode": _summary(points, "decode")}
    doc["elapsed_s"] = round(time.monotonic() - t0, 2)
    _write(out_dir, doc)
    return doc


# -------------------------------------------------------------------------------------- output
def _ms(x: object) -> str:
    return f"{float(x) * 1e3:.2f}" if isinstance(x, int | float) else "–"


def _verdict(s: object, dry: bool) -> str:
    assert isinstance(s, dict)
    if not s["points"]:
        return "no points"
    return ("(meaningless in a dry run) " if dry else "") + (
        f"median ratio {s['median_ratio']:.2f} over {s['points']} points "
        f"(range {s['min_ratio']:.2f}–{s['max_ratio']:.2f}; {s['median_ratio_no_overhead']:.2f} "
        f"without the overhead): {'within' if s['within_20pct'] else 'NOT within'} 20%"
    )


def markdown(doc: dict[str, object]) -> str:
    model = doc["model"]
    assert isinstance(model, dict)
    lines = [
        "# GPU profile check (issue 25 b)",
        "",
        f"Device: {doc['device']}; torch {doc['torch']}, CUDA {doc['cuda'] or 'none'}. "
        f"Profile: `{doc['profile']}` ({doc['profile_note']}).",
        f"Model: {model['name']}, {model['params']:,} parameters, random {model['dtype']} "
        f"weights; attention: {doc.get('attention', '–')}.",
        "",
    ]
    if doc.get("note"):
        lines += [f"**{doc['note']}**", ""]
    if doc.get("error"):
        lines += [f"**Error: {doc['error']}**", ""]
    lines += [
        "| step | new tokens | cached / context | batch | measured ms | predicted ms | ratio "
        "| ratio w/o overhead | mode |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    points = doc["points"]
    assert isinstance(points, list)
    for p in points:
        prefill = p["kind"] == "prefill"
        mode = p["mode"]
        if "measured_eager_s" in p:
            mode = f"{mode} (eager {_ms(p['measured_eager_s'])} ms)"
        lines.append(
            f"| {p['kind']} | {p['new_tokens'] if prefill else 1} "
            f"| {p['cached_tokens'] if prefill else p['context']} | {p['batch']} "
            f"| {_ms(p['measured_s'])} | {_ms(p['predicted_s'])} | {p['ratio']:.2f} "
            f"| {p['ratio_no_overhead']:.2f} | {mode} |"
        )
    summary = doc["summary"]
    assert isinstance(summary, dict)
    lines += [
        "",
        f"Ratio = measured / predicted; the target: {doc['target']}.",
        "",
        f"- Prefill: {_verdict(summary['prefill'], bool(doc['dry_run']))}.",
        f"- Decode: {_verdict(summary['decode'], bool(doc['dry_run']))}.",
    ]
    skipped = doc["skipped"]
    assert isinstance(skipped, list)
    if skipped:
        lines += ["", "Skipped:", ""]
        lines += [f"- {_label(s)}: {s['reason']}" for s in skipped]
    if "elapsed_s" in doc:
        lines += ["", f"Ran in {doc['elapsed_s']} s (model made in {doc['model_init_s']} s)."]
    return "\n".join(lines) + "\n"


def _write(out_dir: pathlib.Path, doc: dict[str, object]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_profile.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    (out_dir / "gpu_profile.md").write_text(markdown(doc), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the kit runs")
    p.add_argument("--out", default="gpu-profile", help="folder for gpu_profile.json and .md")
    p.add_argument(
        "--budget-s", type=float, default=None, help="stop starting points after (default 180 on GPU)"
    )
    a = p.parse_args(argv)
    doc = run(pathlib.Path(a.out), a.dry_run, a.budget_s)
    print(markdown(doc), end="")
    return 1 if doc.get("error") else 0


if __name__ == "__main__":
    raise SystemExit(main())

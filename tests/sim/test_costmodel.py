"""The cost model's documented predictions, computed by driving a real ``EngineCore`` (scheduler,
block pool, cost model) in discrete-event time, as the server and the cluster mode do.

Pinned figures (``replica/sim/costmodel.py``'s docstring): Llama-3.1-8B on one H100, a
1,024-token prompt on an idle engine has a TTFT of about 36 ms and a batch-1 decode step takes
about 8.0 ms; vLLM's ``latency_llama8B_tp1`` test (H200, batch 8, 32 in, 128 out) takes about
799 ms on ``h200-llama-3.1-8b`` (vLLM's dashboard: 833 ms).
"""

from __future__ import annotations

import itertools
import math
import re

import pytest

from replica.sim import costmodel
from replica.sim.__main__ import engine_config, parser
from replica.sim.costmodel import GPUS, MODELS, profile
from replica.sim.engine import EngineConfig, EngineCore
from replica.sim.request import Request

_distinct = itertools.count(1000)


def core_for(name: str, *flags: str) -> EngineCore:
    """An engine configured as ``python -m replica.sim --profile NAME FLAGS`` configures it."""
    a = parser().parse_args(["--profile", name, *flags])
    return EngineCore(profile(a.profile), engine_config(a))


def prompt(n: int) -> list[int]:
    """``n`` tokens no other prompt of this module shares (no accidental prefix hits)."""
    first = next(_distinct)
    return [first, *range(1, n)]


def run(core: EngineCore, reqs: list[Request]) -> tuple[dict[int, float], list[float], float]:
    """Submit ``reqs`` at t=0 and step until they finish: (TTFT per request id, step durations, end)."""
    for r in reqs:
        core.sched.add(r)
    now, ttft, steps = 0.0, dict[int, float](), list[float]()
    while not all(r.finished for r in reqs):
        step = core.begin(now)
        assert step is not None, "requests are unfinished but nothing was scheduled"
        now += step.duration
        steps.append(step.duration)
        for r in core.end(step, now):
            ttft.setdefault(r.request_id, now)
    return ttft, steps, now


def test_h100_llama_8b_ttft_of_1024_tokens_on_an_idle_engine_is_about_36_ms() -> None:
    core = core_for("h100-llama-3.1-8b")
    req = Request(prompt(1024), 2, core.pool.block_size)
    ttft, steps, _ = run(core, [req])
    assert len(steps) == 2, "one prefill step (1,024 < the 8,192-token budget), one decode step"
    assert ttft[req.request_id] == pytest.approx(0.036, rel=0.03)
    assert req.num_cached_tokens == 0, "a cold prompt: nothing cached"


def test_h100_llama_8b_batch_1_decode_step_is_about_8_ms() -> None:
    core = core_for("h100-llama-3.1-8b")
    req = Request(prompt(1024), 3, core.pool.block_size)
    _, steps, _ = run(core, [req])
    decode = steps[1:]
    assert len(decode) == 2
    assert decode[0] == pytest.approx(0.0080, rel=0.03)
    assert 1 / decode[0] == pytest.approx(125, rel=0.03), "tokens/s per sequence"
    assert decode[1] > decode[0], "one more token of context to read"


def test_h200_latency_test_batch_8_32_in_128_out_is_about_799_ms() -> None:
    core = core_for("h200-llama-3.1-8b")
    reqs = [Request(prompt(32), 128, core.pool.block_size) for _ in range(8)]
    ttft, steps, end = run(core, reqs)
    assert len(steps) == 128, "all 8 prefill together, then 127 batched decode steps"
    assert len(set(ttft.values())) == 1, "all 8 get their first token from the same step"
    assert end == pytest.approx(0.799, rel=0.02)
    assert end == pytest.approx(costmodel.latency_test(profile("h200-llama-3.1-8b"), 8, 32, 128))
    assert end < 0.833, "below vLLM's published 833 ms (no TP, sampling or detokenization cost)"


def test_h200_decodes_faster_than_h100_by_the_bandwidth_ratio() -> None:
    """Batch-1 decode is memory bound: step - overhead scales as 1 / HBM bandwidth."""
    h100, h200 = profile("h100-llama-3.1-8b"), profile("h200-llama-3.1-8b")
    d100 = h100.step_time([(1, 1024)]) - h100.overhead_s
    d200 = h200.step_time([(1, 1024)]) - h200.overhead_s
    assert d100 / d200 == pytest.approx(4.8 / 3.35)
    assert h100.step_time([(1024, 0)]) == pytest.approx(h200.step_time([(1024, 0)])), (
        "a 1,024-token prefill is compute bound, and both have 989 TFLOP/s"
    )


@pytest.mark.parametrize(("gpu", "model"), list(itertools.product(GPUS, MODELS)))
def test_every_gpu_model_profile_resolves(gpu: str, model: str) -> None:
    name = f"{gpu}-{model}"
    p = profile(name)
    assert p.name == name and p.gpu is GPUS[gpu] and p.model is MODELS[model]
    t = p.step_time([(512, 0), (1, 2048)])
    assert math.isfinite(t) and t > p.overhead_s
    m = MODELS[model]
    free = GPUS[gpu].mem_bytes * m.tp * 0.9 - 2 * m.params
    blocks = p.num_gpu_blocks(16)
    if free > 0:
        assert blocks == max(16, int(free // (m.kv_bytes_per_token * 16)))
    else:  # the bf16 weights do not fit (L4 with 70B or 32B): the floor, as documented
        assert blocks == 16
    core = core_for(name)
    req = Request(prompt(100), 2, core.pool.block_size)
    ttft, _, _ = run(core, [req])
    assert ttft[req.request_id] > 0


def test_profiles_that_fit_hold_more_kv_on_bigger_gpus() -> None:
    for model in MODELS:
        blocks = {g: profile(f"{g}-{model}").num_gpu_blocks(16) for g in GPUS}
        assert blocks["h200"] > blocks["h100"] >= blocks["a100"] >= blocks["l4"], (model, blocks)
    assert profile("h100-llama-3.1-70b").model is MODELS["llama-3.1-70b"]
    assert MODELS["llama-3.1-70b"].tp == 4 and MODELS["qwen3-32b"].tp == 2


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=re.escape("h100-llama-3.1-8b")) as e:
        profile("h100-llama3-8b")
    assert all(f"{g}-{m}" in str(e.value) for g in GPUS for m in MODELS)
    assert "cpu-test" in str(e.value)
    assert profile("cpu-test").gpu is None


@pytest.mark.parametrize("name", ["h100-llama-3.1-8b", "cpu-test"])
def test_time_scale_flag_scales_every_step(name: str) -> None:
    def steps(*flags: str) -> list[float]:
        core = core_for(name, *flags)
        return run(core, [Request(prompt(700), 4, core.pool.block_size)])[1]

    base, fast, slow = steps(), steps("--time-scale", "0.1"), steps("--time-scale", "3")
    assert len(base) == len(fast) == len(slow) == 4
    for b, f, s in zip(base, fast, slow, strict=True):
        assert f == pytest.approx(0.1 * b) and s == pytest.approx(3 * b)


def test_time_scale_is_applied_by_the_engine_not_the_profile() -> None:
    p = profile("h100-llama-3.1-8b")
    core = EngineCore(p, EngineConfig(time_scale=0.5))
    core.sched.add(Request(prompt(64), 1, 16))
    step = core.begin(0.0)
    assert step is not None
    assert step.duration == pytest.approx(0.5 * p.step_time([(64, 0)]))

"""``bench.gpu_profile`` (issue 25 b): the dry run end to end, the decoder's KV-cache arithmetic on
CPU, and its shapes against Llama-3.1-8B without allocating the 16 GB."""

from __future__ import annotations

import json
import pathlib

import pytest

torch = pytest.importorskip("torch")

from bench import gpu_profile as gp  # noqa: E402
from replica.sim.costmodel import MODELS, profile  # noqa: E402


@pytest.mark.timeout(120)
def test_dry_run_writes_both_files_and_every_point(tmp_path: pathlib.Path) -> None:
    doc = gp.run(tmp_path, dry=True)
    assert doc["dry_run"] is True and doc["profile"] == "cpu-test"
    assert "meaningless" in str(doc["note"])
    assert doc["skipped"] == [], doc["skipped"]
    points = doc["points"]
    assert isinstance(points, list)
    kinds = [p["kind"] for p in points]
    assert kinds.count("prefill") == len(gp.DRY_PLAN.prefill)
    assert kinds.count("decode") == len(gp.DRY_PLAN.decode)
    for p in points:
        assert p["measured_s"] > 0 and p["predicted_s"] > 0, p
        assert p["ratio"] == pytest.approx(p["measured_s"] / p["predicted_s"])
        assert p["ratio_no_overhead"] > p["ratio"]
        assert len(p["times_s"]) == gp.DRY_PLAN.repeats
    cached = [p for p in points if p["kind"] == "prefill" and p["cached_tokens"] > 0]
    assert cached, "no prefill over a cached prefix"
    summary = doc["summary"]
    assert isinstance(summary, dict)
    for kind in ("prefill", "decode"):
        s = summary[kind]
        assert s["points"] == kinds.count(kind)
        assert s["min_ratio"] <= s["median_ratio"] <= s["max_ratio"]
        assert isinstance(s["within_20pct"], bool)
    on_disk = json.loads((tmp_path / "gpu_profile.json").read_text())
    assert on_disk["points"] == json.loads(json.dumps(points))
    md = (tmp_path / "gpu_profile.md").read_text()
    assert "`cpu-test`" in md and "meaningless" in md
    assert md.count("| prefill |") + md.count("| decode |") == len(points)
    assert "- Prefill: " in md and "- Decode: " in md


def test_prediction_is_the_profiles_step_time_of_the_engines_batch() -> None:
    p = profile("h200-llama-3.1-8b")
    assert gp.predicted(p, "prefill", 512, 4096) == p.step_time([(512, 4096)])
    assert gp.predicted(p, "decode", 8, 1024) == p.step_time([(1, 1024)] * 8)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H200", "h200-llama-3.1-8b"),
        ("NVIDIA H100 80GB HBM3", "h100-llama-3.1-8b"),
        ("NVIDIA A100-SXM4-80GB", "a100-llama-3.1-8b"),
        ("NVIDIA L4", "l4-llama-3.1-8b"),
        ("NVIDIA L40S", "h100-llama-3.1-8b"),
        (None, "cpu-test"),
    ],
)
def test_profile_follows_the_gpu_name(name: str | None, expected: str) -> None:
    got, why = gp.profile_name(name)
    assert got == expected
    profile(got)  # a profile the simulator knows
    if name == "NVIDIA L40S":
        assert "no profile" in why


def test_model_shapes_are_llama_3_1_8b_without_allocating() -> None:
    cfg, sim = gp.LLAMA_3_1_8B, MODELS["llama-3.1-8b"]
    assert cfg.param_count() == 8_030_261_248  # Llama-3.1-8B's published count
    assert cfg.param_count() == pytest.approx(sim.params, rel=1e-3)
    assert cfg.layers == sim.layers and cfg.q_width == sim.attn_width
    assert cfg.kv_bytes(1, 1, 2) == sim.kv_bytes_per_token  # bf16 K and V of one token
    model = gp.Decoder(cfg, torch.device("meta"), torch.bfloat16)  # shapes only
    assert model.param_count() == cfg.param_count()
    assert model.layers[0].qkv.shape == (4096 + 2 * 1024, 4096)
    assert model.layers[0].gate_up.shape == (2 * 14336, 4096)
    assert model.lm_head.shape == (128256, 4096)


@pytest.mark.parametrize("native", [True, False])
def test_steps_over_the_cache_match_one_whole_prefill(native: bool) -> None:
    """A prefill after a cached prefix (lower-right causal mask) and a decode step give what one
    prefill of the whole sequence gives; with GQA native or K/V repeated. The last layer's keys
    depend on the earlier layers' attention at every position (the greedy tokens barely do on
    random weights): an upper-left mask fails this by units."""
    cfg = gp.TINY
    model = gp.Decoder(cfg, torch.device("cpu"), torch.float32)
    model.gqa_native = native
    ids = torch.randint(0, cfg.vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = gp.KVCache(cfg, 2, 48, model.device, model.dtype)
        want = model.forward(ids, 0, whole)
        split = gp.KVCache(cfg, 2, 48, model.device, model.dtype)
        model.forward(ids[:, :32], 0, split)
        assert torch.equal(model.forward(ids[:, 32:], 32, split), want)
        assert torch.allclose(split.k[-1], whole.k[-1], atol=1e-4)
        steps = gp.KVCache(cfg, 2, 48, model.device, model.dtype)
        model.forward(ids[:, :46], 0, steps)
        model.forward(ids[:, 46:47], 46, steps)
        assert torch.equal(model.forward(ids[:, 47:], 47, steps), want)
        assert torch.allclose(steps.k[-1], whole.k[-1], atol=1e-4)
        assert torch.allclose(steps.v[-1], whole.v[-1], atol=1e-4)


def test_spent_budget_skips_every_point_and_says_so(tmp_path: pathlib.Path) -> None:
    doc = gp.run(tmp_path, dry=True, budget_s=0.0)
    assert doc["points"] == []
    skipped = doc["skipped"]
    assert isinstance(skipped, list) and len(skipped) == len(gp.DRY_PLAN.prefill) + len(gp.DRY_PLAN.decode)
    assert all("time budget" in s["reason"] for s in skipped)
    summary = doc["summary"]
    assert isinstance(summary, dict) and summary["decode"]["points"] == 0
    md = (tmp_path / "gpu_profile.md").read_text()
    assert "- Decode: no points." in md and "time budget" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_without_a_gpu_the_full_run_reports_an_error_and_allocates_nothing(tmp_path: pathlib.Path) -> None:
    doc = gp.run(tmp_path, dry=False)
    assert "no CUDA device" in str(doc["error"]) and doc["points"] == []
    assert "Error: no CUDA device" in (tmp_path / "gpu_profile.md").read_text()
    assert gp.main(["--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("gpu_gib", [80, 141])
def test_gpu_plan_fits_an_h100_and_an_h200_but_batch_128_at_8k(gpu_gib: int) -> None:
    """``run``'s fit rule on the GPU plan, free memory taken as the card's less the bf16 weights:
    every prefill fits; batch 128 at context 8k (128 GiB of KV) does not, on either card."""
    cfg = gp.GPU_PLAN.config
    free = int(gpu_gib * 1e9 * 0.97) - cfg.param_count() * 2
    todo = [("prefill", n, c) for n, c in gp.GPU_PLAN.prefill]
    todo += [("decode", b, c) for b, c in gp.GPU_PLAN.decode]
    out = [(k, a, b) for k, a, b in todo if gp.does_not_fit(cfg, k, a, b, 2, False, free)]
    assert out == [("decode", 128, 8192)]
    assert "KV cache 128.0 GiB" in str(gp.does_not_fit(cfg, "decode", 128, 8192, 2, False, free))

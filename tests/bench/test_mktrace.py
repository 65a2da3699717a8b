"""``python -m bench.mktrace``: a generated shared-prefix workload as a Mooncake trace, and the
cluster-mode ablation it feeds (``--config-file`` with bench/configs/cost-variants.yaml)."""

from __future__ import annotations

import pathlib

import pytest

from bench import cluster, mktrace
from bench import mooncake_trace as trace
from picker.core.config import load_file
from replica.sim.costmodel import profile

ROOT = pathlib.Path(__file__).resolve().parents[2]


ARGS = ["shared-prefix", "--groups", "3", "--prompts", "4", "--system", "1024", "--question", "100"]
ARGS += ["--output", "7", "--rate", "10"]


def test_shared_prefix_trace_structure(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "gsp.jsonl"
    assert mktrace.main([*ARGS, "-o", str(out)]) == 0
    rows = trace.read(str(out))
    assert len(rows) == 12 and all(r.input_length == 1124 and r.output_length == 7 for r in rows)
    assert [r.arrival_s for r in rows] == sorted(r.arrival_s for r in rows)
    heads = {r.hash_ids[:2] for r in rows}
    assert len(heads) == 3, "three groups, each two shared 512-token blocks"
    tails = [r.hash_ids[2] for r in rows]
    assert len(set(tails)) == 12 and not set(tails) & {h for head in heads for h in head}
    again = tmp_path / "again.jsonl"
    mktrace.main([*ARGS, "-o", str(again)])
    assert out.read_text() == again.read_text(), "seeded: the same trace twice"


def test_shared_prefix_trace_rejects_a_system_prompt_off_the_block_grid() -> None:
    with pytest.raises(ValueError, match="multiple of 512"):
        list(mktrace.shared_prefix_rows(2, 2, 1000, 10, 4, 5.0))


def test_ablation_profiles_load_and_the_default_cost_keeps_groups_whole(tmp_path: pathlib.Path) -> None:
    """Cluster mode routes with profiles from the picker's YAML: at 80% load the default ``cost``
    keeps every group on one replica (the ideal hit rate) where ``cost-v0`` (load guard
    abs_slack 8, no miss penalty) splits some."""
    rows = [
        trace.Row(
            i,
            float(d["timestamp"]) / 1000,
            int(d["input_length"]),
            int(d["output_length"]),
            tuple(d["hash_ids"]),
        )
        for i, d in enumerate(mktrace.shared_prefix_rows(16, 16, 2048, 128, 128, rate=40.0))
    ]
    cfg = load_file(str(ROOT / "bench/configs/cost-variants.yaml"))
    got = {
        p: cluster.simulate(rows, 4, p, profile("h100-llama-3.1-8b"), router_cfg=cfg)
        for p in ("cost", "cost-v0", "round-robin")
    }
    assert got["cost"].hit_rate == pytest.approx(got["cost"].ideal_hit_rate, abs=0.005)
    assert got["cost-v0"].hit_rate < got["cost"].hit_rate - 0.02
    assert got["round-robin"].hit_rate < got["cost-v0"].hit_rate
    assert got["cost"].ttft_p90 < 0.5 * got["round-robin"].ttft_p90

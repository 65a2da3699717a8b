"""``python -m bench.mktrace``: a generated shared-prefix workload as a Mooncake trace, and the
cluster-mode ablation it feeds (``--config-file`` with bench/configs/cost-variants.yaml)."""

from __future__ import annotations

import itertools
import pathlib

import pytest

from bench import ceilings, cluster, mktrace
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


def _rows(path: pathlib.Path) -> list[trace.Row]:
    return trace.read(str(path))


def test_scale_makes_disjoint_interleaved_copies(tmp_path: pathlib.Path) -> None:
    """K copies: each copy's hash ids renamed into its own range (no block shared across copies,
    every block shared within one as in the original), arrivals interleaved, seeded."""
    src = tmp_path / "src.jsonl"
    mktrace.main([*ARGS, "-o", str(src)])
    out = tmp_path / "k3.jsonl"
    assert mktrace.main(["scale", "--trace", str(src), "--copies", "3", "-o", str(out)]) == 0
    orig, rows = _rows(src), _rows(out)
    assert len(rows) == 3 * len(orig)
    assert [r.arrival_s for r in rows] == sorted(r.arrival_s for r in rows)
    stride = 1 + max(h for r in orig for h in r.hash_ids)
    by_copy: dict[int, list[trace.Row]] = {}
    for r in rows:
        copies = {h // stride for h in r.hash_ids}
        assert len(copies) == 1, "a row's ids all come from one copy"
        by_copy.setdefault(copies.pop(), []).append(r)
    assert sorted(by_copy) == [0, 1, 2]
    for c, part in by_copy.items():
        assert [tuple(h - c * stride for h in r.hash_ids) for r in part] == [r.hash_ids for r in orig]
        assert [r.input_length for r in part] == [r.input_length for r in orig]
        shift = part[0].arrival_s - orig[0].arrival_s
        assert all(abs(p.arrival_s - o.arrival_s - shift) < 1e-9 for p, o in zip(part, orig, strict=True))
    copy_order = [next(iter(r.hash_ids)) // stride for r in rows]
    assert copy_order != sorted(copy_order), "the copies interleave"
    again = tmp_path / "again.jsonl"
    mktrace.main(["scale", "--trace", str(src), "--copies", "3", "-o", str(again)])
    assert out.read_text() == again.read_text(), "seeded: the same trace twice"
    assert mktrace.scale_rows([], 4) == []
    with pytest.raises(ValueError, match="copies"):
        mktrace.scale_rows([], 0)


def test_scale_keeps_the_per_copy_ceilings() -> None:
    """K copies on K times the capacity: the ideal and LRU ceilings stay those of one copy."""
    one = list(mktrace.shared_prefix_rows(8, 8, 2048, 128, 16, rate=20.0))
    seqs = lambda rows: [(int(r["input_length"]), list(r["hash_ids"])) for r in rows]  # noqa: E731
    four = mktrace.scale_rows(one, 4, seed=1)
    assert ceilings.ideal_hit_rate(seqs(four), 512) == pytest.approx(ceilings.ideal_hit_rate(seqs(one), 512))
    for cap in (24, 64):
        lru1 = ceilings.lru_hit_rate(seqs(one), 512, cap)
        assert ceilings.lru_hit_rate(seqs(four), 512, 4 * cap) == pytest.approx(lru1, abs=0.05)


def test_multi_turn_contexts_grow_and_share_the_previous_turn(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "mt.jsonl"
    args = ["multi-turn", "--conversations", "40", "--turns", "4", "--groups", "3", "--system", "1024"]
    args += ["--user", "300", "--output", "50", "--rate", "5", "--think", "2", "--max-context", "4000"]
    assert mktrace.main([*args, "-o", str(out)]) == 0
    rows = _rows(out)
    assert [r.arrival_s for r in rows] == sorted(r.arrival_s for r in rows)
    assert all(1024 < r.input_length <= 4000 for r in rows)
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in rows)
    assert len({r.hash_ids[:2] for r in rows}) == 3, "three system prompts"
    # Turns of one conversation: same first own block; each extends the previous turn's ids.
    convs: dict[int, list[trace.Row]] = {}
    for r in rows:
        convs.setdefault(r.hash_ids[2], []).append(r)
    assert len(convs) == 40
    assert max(len(c) for c in convs.values()) > 1
    for turns in convs.values():
        for a, b in itertools.pairwise(turns):
            assert b.input_length > a.input_length + a.output_length
            assert b.hash_ids[: len(a.hash_ids)] == a.hash_ids
    open_at = [sum(c[0].arrival_s <= t <= c[-1].arrival_s for c in convs.values()) for t in (2.0, 4.0, 6.0)]
    assert max(open_at) >= 10, f"many conversations open at once: {open_at}"
    again = tmp_path / "again.jsonl"
    mktrace.main([*args, "-o", str(again)])
    assert out.read_text() == again.read_text(), "seeded: the same trace twice"
    with pytest.raises(ValueError, match="multiple of 512"):
        mktrace.multi_turn_rows(2, 2, 1, 1000, 10, 4, 1.0, 1.0, 4000)


def test_ceilings_line(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    mktrace.main([*ARGS, "--replicas", "2", "-o", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err
    assert err.startswith("12 requests; ideal 0.") and "LRU" in err and "2 × h100-llama-3.1-8b" in err

"""Cluster mode and trace conversion on small hand-made traces."""

from __future__ import annotations

import json
import pathlib

import pytest

from bench import mooncake_trace as trace
from bench.cluster import Cluster, main, scale_outputs, simulate
from replica.sim import tokenizer
from replica.sim.costmodel import profile


def write_trace(path: pathlib.Path, rows: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rows_sharing_k_hash_ids_share_exactly_k_blocks(tmp_path: pathlib.Path) -> None:
    rows = trace.read(
        write_trace(
            tmp_path / "t.jsonl",
            [
                {"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
                {"timestamp": 5, "input_length": 1300, "output_length": 1, "hash_ids": [1, 2, 9]},
            ],
        )
    )
    (ta, xa), (tb, xb) = (trace.tokens_and_text(r) for r in rows)
    assert len(ta) == 1536 and len(tb) == 1300 and len(xa) == 1536 * 4 and len(xb) == 1300 * 4
    shared = next(i for i, (a, b) in enumerate(zip(ta, tb, strict=False)) if a != b)
    assert shared == 2 * 512
    shared_text = next(i for i, (a, b) in enumerate(zip(xa, xb, strict=False)) if a != b)
    assert 2 * 512 * 4 <= shared_text < 3 * 512 * 4, shared_text
    assert trace.ideal_hit_rate(rows) == 1024 / (1536 + 1300)


def test_cost_policy_finds_the_shared_prefixes(tmp_path: pathlib.Path) -> None:
    groups = [[100 * g + i for i in range(6)] for g in range(3)]  # 3 groups on 4 replicas: RR scatters
    raw = [
        {
            "timestamp": 200 * k,
            "input_length": 3072 + 100,
            "output_length": 4,
            "hash_ids": [*groups[k % 3], 1000 + k],
        }
        for k in range(32)
    ]
    rows = trace.read(write_trace(tmp_path / "t.jsonl", raw))
    cost = simulate(rows, 4, "cost", profile("h100-llama-3.1-8b"))
    rr = simulate(rows, 4, "round-robin", profile("h100-llama-3.1-8b"))
    assert cost.errors == rr.errors == 0 and cost.requests == 32
    assert cost.hit_rate > 0.9 * cost.ideal_hit_rate, cost
    assert cost.hit_rate > rr.hit_rate, (cost, rr)
    out = tmp_path / "r.json"
    assert (
        main(
            ["--trace", str(tmp_path / "t.jsonl"), "--replicas", "2", "--policy", "cost", "--json", str(out)]
        )
        == 0
    )
    assert json.loads(out.read_text())[0]["requests"] == 32


def test_trace_tokens_are_the_tokenizer_encoding_of_the_text(tmp_path: pathlib.Path) -> None:
    rows = trace.read(
        write_trace(
            tmp_path / "t.jsonl",
            [
                {"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [5, 6, 7]},
                {"timestamp": 1, "input_length": 700, "output_length": 3, "hash_ids": [5]},
            ],
        )
    )
    for row in rows:
        toks, text = trace.tokens_and_text(row)
        assert tokenizer.encode(text) == toks, "HTTP replicas (text) and cluster mode (ids) see one prompt"
    (a, _), (b, _) = (trace.tokens_and_text(r) for r in rows)
    assert a[:512] == b[:512] and a[512:700] != b[512:700], "hash id 5 is shared, the tails are not"


def test_cluster_reports_the_single_lru_ceiling_of_all_replicas_kv(tmp_path: pathlib.Path) -> None:
    """80 distinct 2,048-token prompts, then the same 80 again: 10,240 blocks of 16 tokens, more
    than two ``cpu-test`` replicas hold (2 × 4,096), so one LRU of that size keeps none of the
    first pass by the time it comes back, while an infinite cache hits every second-pass prompt
    but its last block (the last token is always computed)."""
    raw = [
        {
            "timestamp": 50 * k,
            "input_length": 2048,
            "output_length": 1,
            "hash_ids": [4 * g + i for i in range(4)],
        }
        for k, g in enumerate([*range(80), *range(80)])
    ]
    rows = trace.read(write_trace(tmp_path / "t.jsonl", raw))
    res = simulate(rows, 2, "cost", profile("cpu-test"))
    assert res.errors == 0 and res.requests == 160
    assert res.lru_capacity_blocks == 2 * 4096
    assert res.ideal_hit_rate == (80 * 127 * 16) / (160 * 2048)
    assert res.lru_hit_rate == 0.0
    assert res.hit_rate == 0.0, "the engines' LRU caches forget as the single LRU does"


def test_cluster_runs_are_reproducible_with_a_seed(tmp_path: pathlib.Path) -> None:
    """Cold prompts on idle replicas score equal: the picker breaks the tie at random, from a
    seeded generator, so the same seed sends every request to the same replica."""
    raw = [
        {"timestamp": 30 * k, "input_length": 600 + 7 * k, "output_length": 3, "hash_ids": [k % 5, 100 + k]}
        for k in range(40)
    ]
    rows = trace.read(write_trace(tmp_path / "t.jsonl", raw))

    def placement(seed: int) -> list[int]:
        c = Cluster(8, "cost", profile("h100-llama-3.1-8b"), seed=seed)
        c.run(rows)
        return [r.core.sched.queries for r in c.replicas.values()]

    assert placement(7) == placement(7)
    assert len({tuple(placement(s)) for s in range(6)}) > 1, "the seed does pick among the ties"
    a, b = (simulate(rows, 8, "cost", profile("h100-llama-3.1-8b"), seed=7) for _ in range(2))
    assert {**a.__dict__, "wall_seconds": 0} == {**b.__dict__, "wall_seconds": 0}
    assert 0 < a.hit_rate <= a.lru_hit_rate <= a.ideal_hit_rate


def _pd_rows(tmp_path: pathlib.Path, n: int = 24) -> list[trace.Row]:
    raw = [
        {
            "timestamp": 100 * k,
            "input_length": 2048,
            "output_length": 16,
            "hash_ids": [5000 + 4 * k + i for i in range(4)],
        }
        for k in range(n)
    ]
    return trace.read(write_trace(tmp_path / "pd.jsonl", raw))


def test_pd_always_prefills_on_the_prefill_replica_and_decodes_with_loaded_kv(tmp_path: pathlib.Path) -> None:
    rows = _pd_rows(tmp_path)
    prof = profile("h100-llama-3.1-8b")
    fast = simulate(rows, 2, "cost", prof, pd=(1, 1), decider="always", link_bytes_per_s=50e9)
    assert fast.disaggregated == 1.0 and fast.errors == 0 and fast.pd == "1P1D"
    c = Cluster(2, "cost", prof, pd=(1, 1))
    assert [s.endpoint.role for s in c.pool] == ["prefill", "decode"]
    # The KV transfer is on the TTFT path: 2048 tokens x 128 KiB at 1 MB/s is 268 s.
    slow = simulate(rows, 2, "cost", prof, pd=(1, 1), decider="always", link_bytes_per_s=1e6)
    assert slow.ttft_p50 - fast.ttft_p50 > 200, (slow.ttft_p50, fast.ttft_p50)
    never = simulate(rows, 2, "cost", prof, pd=(1, 1), decider="never")
    assert never.disaggregated == 0.0 and never.errors == 0


def test_pd_cli_compares_splits_and_deciders(tmp_path: pathlib.Path, capsys: object) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 50 * k, "input_length": 1024, "output_length": 8, "hash_ids": [k, k + 1]}
            for k in range(16)
        ],
    )
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "--trace",
                path,
                "--replicas",
                "4",
                "--pd=-,1P3D",
                "--pd-decider",
                "cost,never",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert [(r["pd"], r["decider"]) for r in results] == [("", ""), ("1P3D", "cost"), ("1P3D", "never")]
    assert all(r["itl_p90"] > 0 for r in results)


def test_flow_control_holds_sheds_and_answers_every_request(tmp_path: pathlib.Path) -> None:
    """A burst far past two replicas' capacity: with flow control every request is served or
    shed (sheddable, 2 s objective), none is left queued or in flight, and the served keep their
    objective far better than without."""
    import dataclasses

    from bench.cluster import Tag
    from picker.core.config import RouterConfig
    from picker.core.flowcontrol import FlowControlConfig

    raw = [
        {"timestamp": 10 * k, "input_length": 6000, "output_length": 4, "hash_ids": [k % 4, 100 + k]}
        for k in range(120)
    ]
    rows = trace.read(write_trace(tmp_path / "t.jsonl", raw))
    cfg = RouterConfig(objectives={"batch": -1})

    def tag(r: trace.Row) -> Tag:
        return Tag(objective="batch", fairness_id=f"t{r.index % 2}", slo_ttft_ms=2000.0)

    def run(on: bool) -> Cluster:
        fc = dataclasses.replace(FlowControlConfig(), enabled=on)
        c = Cluster(2, "cost", profile("h100-llama-3.1-8b"), router_cfg=cfg, flow_control=fc, tags=tag)
        c.run(rows)
        return c

    on, off = run(True), run(False)
    outcomes = {r.outcome for r in on.records}
    assert outcomes <= {"served", "shed_predicted_slo_miss"} and "served" in outcomes, outcomes
    [fc] = on.flows.values()
    assert len(fc.queue) == 0
    assert all(s.load.in_flight_requests == 0 for s in on.router.pool)
    late = lambda c: sum(1 for r in c.records if r.ttft is not None and r.ttft > 2.0)  # noqa: E731
    assert late(on) < late(off), (late(on), late(off))
    assert not off.flows and {r.outcome for r in off.records} == {"served"}


def test_several_pickers_with_flow_control_share_load_over_the_peer_channel(tmp_path: pathlib.Path) -> None:
    """Two pickers, each its own queue, past two replicas' capacity. Over the modelled peer
    channel (``peers``) each hears the other's load late, so it over-admits sometimes, but far
    less than with scrapes alone; with one shared pool (``inflight``) its view is the truth, so
    never. Every request is answered, and once the channel drains each picker's view of its
    peer's load is empty, as the peer's own is."""
    import dataclasses

    from bench.cluster import Tag
    from picker.core.config import RouterConfig
    from picker.core.flowcontrol import FlowControlConfig

    raw = [
        {"timestamp": 10 * k, "input_length": 6000, "output_length": 4, "hash_ids": [k % 4, 100 + k]}
        for k in range(200)
    ]
    rows = trace.read(write_trace(tmp_path / "t.jsonl", raw))
    cfg = RouterConfig(objectives={"batch": -1})

    def tag(r: trace.Row) -> Tag:
        return Tag(objective="batch", slo_ttft_ms=2000.0)

    def run(share: str) -> Cluster:
        fc = dataclasses.replace(FlowControlConfig(), enabled=True)
        c = Cluster(
            2,
            "cost",
            profile("h100-llama-3.1-8b"),
            router_cfg=cfg,
            flow_control=fc,
            tags=tag,
            pickers=2,
            share=frozenset({share} if share else ()),
        )
        c.run(rows)
        return c

    peers, alone, shared = run("peers"), run(""), run("inflight")
    for c in (peers, alone, shared):
        assert {r.outcome for r in c.records} <= {"served", "shed_predicted_slo_miss"}
        assert all(len(fc.queue) == 0 for fc in c.flows.values())
        assert c.admitted > 0 and c.samples > 0
    assert shared.over_admitted == 0
    assert peers.over_admitted < alone.over_admitted, (peers.over_admitted, alone.over_admitted)
    assert peers.unheard_max > 0 and all(n == 0 for row in peers.unheard for n in row)
    for r in peers.pickers:
        assert all(s.peer_load.in_flight_requests == 0 == s.peer_load.pending_prefill_tokens for s in r.pool)


def test_output_scale_makes_a_decode_heavier_trace(tmp_path: pathlib.Path) -> None:
    """``--output-scale k`` keeps prompts and arrivals and multiplies output lengths: the run
    lasts longer by the extra decode steps."""
    rows = _pd_rows(tmp_path, 4)
    scaled = [scale_outputs(r, 8) for r in rows]
    assert [r.output_length for r in scaled] == [128] * 4
    assert [(r.arrival_s, r.input_length, r.hash_ids) for r in scaled] == [
        (r.arrival_s, r.input_length, r.hash_ids) for r in rows
    ]
    assert scale_outputs(rows[0], 0.001).output_length == 1
    path = str(tmp_path / "pd.jsonl")
    base, heavy = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["--trace", path, "--replicas", "2", "--json", str(base)]) == 0
    assert main(["--trace", path, "--replicas", "2", "--output-scale", "8", "--json", str(heavy)]) == 0
    a, b = (json.loads(f.read_text())[0] for f in (base, heavy))
    assert b["sim_seconds"] > a["sim_seconds"] and a["errors"] == b["errors"] == 0


def test_the_ttft_floor_is_a_request_alone_on_an_idle_engine_with_every_block_cached(
    tmp_path: pathlib.Path,
) -> None:
    """Requests 1,000 s apart on one replica (each alone, nothing evicted): each TTFT is exactly
    its floor, a cold 20,000-token prompt in three chunks of 8,192 and a repeat of it from the
    cache alike. On a loaded fleet no request gets below its floor."""
    from bench.ceilings import ttft_floor
    from replica.sim.scheduler import SchedulerConfig

    prof = profile("h100-llama-3.1-8b")
    raw = [
        {"timestamp": 0, "input_length": 20_000, "output_length": 2, "hash_ids": list(range(40))},
        {
            "timestamp": 1000,
            "input_length": 12_000,
            "output_length": 2,
            "hash_ids": [*range(10), *range(100, 114)],
        },
        {"timestamp": 2000, "input_length": 20_000, "output_length": 2, "hash_ids": list(range(40))},
    ]
    c = Cluster(1, "cost", prof)
    c.run(trace.read(write_trace(tmp_path / "t.jsonl", raw)))
    floors = ttft_floor(c.sent, c.block_size, prof.step_time, SchedulerConfig().max_num_batched_tokens)
    assert [r.ttft for r in c.records] == pytest.approx(floors, rel=1e-9)  # now - arrival
    cold = prof.step_time([(8192, 0)]) + prof.step_time([(8192, 8192)]) + prof.step_time([(3616, 16384)])
    assert floors[0] == cold and floors[2] < floors[1] < floors[0]

    rows = trace.read("bench/data/mooncake_synthetic_trace.jsonl", 120)
    loaded = Cluster(2, "cost", prof)
    loaded.run(rows, 0.5)
    floors = ttft_floor(
        loaded.sent, loaded.block_size, prof.step_time, SchedulerConfig().max_num_batched_tokens
    )
    gaps = [r.ttft - f for r, f in zip(loaded.records, floors, strict=True) if r.ttft is not None]
    assert len(gaps) == len(floors) and min(gaps) >= -1e-9 and max(gaps) > 0.1, (min(gaps), max(gaps))
    res = simulate(rows[:60], 2, "cost", [prof, profile("a100-llama-3.1-8b")], 0.5)
    assert 0 < res.ttft_floor_p90 <= res.ttft_p90

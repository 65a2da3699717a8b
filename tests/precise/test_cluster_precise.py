"""Cluster mode in precise prefix mode: KV events (through the wire encoding and the picker's
decoder) keep every picker's index equal to the engines' caches; several pickers agree."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random

import pytest

from bench import mooncake_trace as trace
from bench.cluster import Cluster, main, simulate
from picker.core.config import PrefixConfig, RouterConfig
from replica.sim.costmodel import profile

pytestmark = pytest.mark.precise
PROF = profile("h100-llama-3.1-8b")


def rows(tmp_path: pathlib.Path, n: int = 120, groups: int = 6, seed: int = 0) -> list[trace.Row]:
    """Requests sharing one of ``groups`` 4-block (2,048-token) prefixes, plus unique blocks,
    arriving every 40 ms: bursts of one prefix arrive faster than a prefill ends."""
    rng = random.Random(seed)
    raw = []
    for k in range(n):
        g = rng.randrange(groups)
        ids = [*(100 * g + i for i in range(4)), *(10_000 + 10 * k + i for i in range(rng.randrange(1, 3)))]
        raw.append({"timestamp": 40 * k, "input_length": 512 * len(ids), "output_length": 8, "hash_ids": ids})
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in raw))
    return trace.read(str(path))


def precise_cfg(**kw: object) -> RouterConfig:
    return RouterConfig(prefix=PrefixConfig(mode="precise", **kw))  # type: ignore[arg-type]


def test_index_equals_every_engine_cache_after_a_run_with_evictions(tmp_path: pathlib.Path) -> None:
    c = Cluster(4, "cost", PROF, router_cfg=precise_cfg(), kv_blocks=700, pickers=2)
    c.run(rows(tmp_path))
    evicted = 0
    for key, rep in c.replicas.items():
        truth = set(rep.core.pool.index)
        evicted += sum(1 for b in rep.core.pool.blocks if b.block_hash is None)
        for r in c.pickers:
            assert r.precise is not None
            assert r.precise.engine_hashes(key) == truth, f"picker index for {key} is the engine's cache"
            r.precise.check()
    q = sum(r.core.sched.queries for r in c.replicas.values())
    assert q > 4 * 700 * 16, "more prompt tokens than the pool's KV cache: it evicted"


def test_precise_beats_approximate_and_approaches_the_lru_ceiling(tmp_path: pathlib.Path) -> None:
    rs = rows(tmp_path, n=160)
    approx = simulate(rs, 4, "cost", PROF, router_cfg=RouterConfig())
    precise = simulate(rs, 4, "cost", PROF, router_cfg=RouterConfig(), prefix_mode="precise")
    assert approx.errors == precise.errors == 0
    assert precise.hit_rate >= 0.95 * precise.lru_hit_rate, precise
    assert precise.hit_rate >= approx.hit_rate - 0.01, (precise, approx)


def test_two_pickers_agree_when_they_share_picks_and_in_flight(tmp_path: pathlib.Path) -> None:
    """Both pickers get every KV event. Asked at the same moment, they make the same decision on
    at least 99% of requests when they also share their picks (speculative entries) and in-flight
    counts, and route as well as one picker. Measured on this bursty stream (events 50 ms late):
    events alone agree on about 94%, events + in-flight about 97.5%, all three 100%."""
    rs = rows(tmp_path, n=160)
    one = simulate(rs, 4, "cost", PROF, prefix_mode="precise")
    events_only = simulate(rs, 4, "cost", PROF, prefix_mode="precise", pickers=2)
    both = simulate(
        rs, 4, "cost", PROF, prefix_mode="precise", pickers=2, share=frozenset({"inflight", "picks"})
    )
    assert both.agreement >= 0.99, both
    assert both.hit_rate >= one.hit_rate - 0.01, (both, one)
    assert events_only.agreement < both.agreement, "sharing is what makes them agree"
    approx = simulate(rs, 4, "cost", PROF, pickers=2)
    assert approx.agreement < 0.5, "approximate pickers, sharing nothing, mostly disagree"


def test_speculative_entries_keep_a_burst_together(tmp_path: pathlib.Path) -> None:
    """With events 1 s late, a burst of one new prefix sticks to one replica only thanks to the
    speculative entry the pick leaves (TTL 2 s): without it the burst scatters."""
    rs = rows(tmp_path, n=80, groups=2)
    slow = dataclasses.replace(RouterConfig(), prefix=PrefixConfig(mode="precise"))
    with_spec = simulate(rs, 4, "cost", PROF, router_cfg=slow, prefix_mode="precise", event_delay_s=1.0)
    no_spec_cfg = dataclasses.replace(slow, prefix=PrefixConfig(mode="precise", speculative_ttl_s=0.0))
    without = simulate(rs, 4, "cost", PROF, router_cfg=no_spec_cfg, prefix_mode="precise", event_delay_s=1.0)
    assert with_spec.hit_rate > without.hit_rate, (with_spec, without)


def test_cli_compares_modes_and_pickers(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows(tmp_path, n=40)
    out = tmp_path / "r.json"
    args = ["--trace", str(tmp_path / "t.jsonl"), "--replicas", "2", "--prefix-mode", "approximate,precise"]
    assert main([*args, "--pickers", "2", "--share", ",inflight", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [(r["prefix_mode"], r["share"]) for r in got] == [
        ("approximate", ""),
        ("approximate", "inflight"),
        ("precise", ""),
        ("precise", "inflight"),
    ]
    assert all(r["pickers"] == 2 and 0 <= r["agreement"] <= 1 for r in got)
    assert "agree" in capsys.readouterr().out

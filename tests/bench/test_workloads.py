"""Workload generators: deterministic, and with the prefix structure each one promises."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from bench import workloads
from replica.sim import tokenizer
from replica.sim.blocks import chain_hashes


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_generators_are_deterministic_and_seeded() -> None:
    for make in (
        lambda seed: workloads.shared_prefix(4, 3, 64, 8, 4, seed=seed),
        lambda seed: workloads.no_sharing(5, 32, 4, seed=seed),
        lambda seed: workloads.multi_turn(3, 3, 16, 8, 8, seed=seed),
    ):
        assert make(0) == make(0)
        assert make(0).requests != make(1).requests


def test_shared_prefix_groups_share_exactly_the_system_prompt() -> None:
    w = workloads.shared_prefix(
        groups=3, prompts_per_group=4, system_prompt_len=64, question_len=8, output_len=5
    )
    assert len(w.requests) == 12
    assert all(len(r.prompt) == (64 + 8) * 4 and r.max_tokens == 5 for r in w.requests)
    by_group: dict[str, list[str]] = {}
    for r in w.requests:
        by_group.setdefault(r.group, []).append(r.prompt)
    assert sorted(len(v) for v in by_group.values()) == [4, 4, 4]
    for prompts in by_group.values():
        system = prompts[0][: 64 * 4]
        assert all(p.startswith(system) for p in prompts)
        assert len(set(prompts)) == 4, "questions must differ within a group"
    systems = {v[0][: 64 * 4] for v in by_group.values()}
    assert len(systems) == 3
    assert [r.group for r in w.requests] != sorted(r.group for r in w.requests), "order must be shuffled"


def test_no_sharing_prompts_share_no_cache_block() -> None:
    w = workloads.no_sharing(20, 64, 4)
    firsts = {chain_hashes(tokenizer.encode(r.prompt), 16)[0] for r in w.requests}
    assert len(firsts) == 20


def test_multi_turn_history_grows_and_turns_wait_for_the_previous_one() -> None:
    sessions, turns = 3, 4
    w = workloads.multi_turn(sessions, turns, system_len=16, user_len=8, answer_len=8)
    assert len(w.requests) == sessions * turns
    for t in range(1, turns):
        for s in range(sessions):
            cur, prev = w.requests[t * sessions + s], w.requests[(t - 1) * sessions + s]
            assert cur.after == (t - 1) * sessions + s
            assert cur.prompt.startswith(prev.prompt) and len(cur.prompt) > len(prev.prompt)
            assert len(cur.prompt) % 4 == 0, "history must stay token-aligned"
    assert all(w.requests[s].after is None for s in range(sessions))


def _trace(tmp: pathlib.Path, rows: list[dict[str, object]]) -> str:
    path = tmp / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_mooncake_rows_sharing_k_hash_ids_share_k_blocks_of_512_tokens(tmp_path: pathlib.Path) -> None:
    rows: list[dict[str, object]] = [
        {"timestamp": 0, "input_length": 2000, "output_length": 7, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 1500, "input_length": 1800, "output_length": 3, "hash_ids": [1, 2, 9, 10]},
        {"timestamp": 3000, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 4000, "input_length": 700, "output_length": 2, "hash_ids": [5, 6]},
    ]
    w = workloads.mooncake(_trace(tmp_path, rows))
    assert [r.at for r in w.requests] == [0.0, 1.5, 3.0, 4.0]
    assert [r.max_tokens for r in w.requests] == [7, 3, 1, 2]
    toks = [tokenizer.encode(r.prompt) for r in w.requests]
    assert [len(t) for t in toks] == [2000, 1800, 1536, 700], "input_length is honoured"
    for (i, j), k in {(0, 1): 2, (0, 2): 3, (1, 2): 2, (0, 3): 0}.items():
        hi, hj = chain_hashes(toks[i], 16), chain_hashes(toks[j], 16)
        shared = common_prefix(hi, hj)
        assert shared == k * 512 // 16, f"rows {i},{j}: {shared} shared blocks, want {k * 32}"
        # text: k blocks of 2048 characters, then the next block's first token may coincide
        assert k * 2048 <= common_prefix(w.requests[i].prompt, w.requests[j].prompt) < k * 2048 + 8


def test_mooncake_workload_is_deterministic(tmp_path: pathlib.Path) -> None:
    rows: list[dict[str, object]] = [
        {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [3, 4]}
    ]
    path = _trace(tmp_path, rows)
    assert workloads.mooncake(path) == workloads.mooncake(path)

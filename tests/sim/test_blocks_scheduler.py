"""Block pool invariants (hypothesis) and hand-worked scheduler cases for the simulator."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from replica.sim.blocks import BlockPool, chain_hashes
from replica.sim.request import Request
from replica.sim.scheduler import Scheduler, SchedulerConfig

BS = 4


def req(tokens: list[int], max_tokens: int = 1) -> Request:
    return Request(tokens, max_tokens, BS)


def run_to_end(s: Scheduler, limit: int = 1000) -> list[list[tuple[Request, int]]]:
    steps = []
    for t in range(limit):
        out = s.schedule()
        if not out:
            break
        s.update(out, float(t))
        s.pool.check()
        steps.append(out)
    return steps


def test_chain_hashes_depend_on_prefix_lora_and_salt() -> None:
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(a) == 2, "only full blocks are hashed"
    assert chain_hashes([1, 2, 3, 4, 0, 0, 0, 0], BS)[0] == a[0]
    assert chain_hashes([9, 2, 3, 4, 5, 6, 7, 8], BS)[1] != a[1], "a block's hash covers its parents"
    assert chain_hashes([1, 2, 3, 4], BS, lora="x") != a[:1]
    assert chain_hashes([1, 2, 3, 4], BS, salt="s") != a[:1]


def test_budget_excludes_cached_tokens() -> None:
    s = Scheduler(BlockPool(64, BS), SchedulerConfig(max_num_batched_tokens=100))
    prefix = list(range(32))
    s.add(req([*prefix, 100, 101]))
    run_to_end(s)
    second = req([*prefix, 200, 201])
    s.add(second)
    [(r, n)] = s.schedule()
    assert r is second and second.num_cached_tokens == 32 and n == 2, "only the uncached tail is charged"


def test_admission_counts_only_uncached_blocks() -> None:
    pool = BlockPool(10, BS)  # 9 usable: block 0 is the null block
    s = Scheduler(pool, SchedulerConfig(max_num_batched_tokens=1000))
    prefix = list(range(28))  # 7 blocks
    s.add(req([*prefix, 1]))
    run_to_end(s)
    assert pool.num_free == 9, "finished request released its blocks (they stay cached)"
    big = req(
        [*prefix, 2, 3, 4, 5, 6], max_tokens=2
    )  # 33 tokens = 9 blocks: 7 hit (taken off the free queue) + 2 new
    s.add(big)
    out = s.schedule()
    assert out == [(big, 5)] and big.num_cached_tokens == 28 and pool.num_free == 0
    s.update(out, 1.0)
    too_big = req([*prefix, 7, 8, 9, 10, 11, 12, 13, 14, 15])  # 37 tokens = 10 blocks > 9 usable
    s.add(too_big)
    assert s.schedule() == [(big, 1)], "the whole sequence must fit before admission (vLLM default)"


def test_full_hit_recomputes_the_last_token() -> None:
    s = Scheduler(BlockPool(16, BS), SchedulerConfig())
    tokens = list(range(8))
    s.add(req(tokens))
    run_to_end(s)
    again = req(tokens)
    s.add(again)
    [(_, n)] = s.schedule()
    assert again.num_cached_tokens == 4 and n == 4, "the last block is dropped from a full hit"


def test_chunked_prefill() -> None:
    s = Scheduler(BlockPool(64, BS), SchedulerConfig(max_num_batched_tokens=10))
    r = req(list(range(25)))
    s.add(r)
    chunks = [n for step in run_to_end(s) for q, n in step if q is r]
    assert chunks[:3] == [10, 10, 5], chunks


def test_preemption_when_blocks_run_out() -> None:
    pool = BlockPool(5, BS)  # 4 usable blocks = 16 token slots
    s = Scheduler(pool, SchedulerConfig(max_num_batched_tokens=100))
    a, b = req(list(range(6)), max_tokens=8), req(list(range(50, 56)), max_tokens=8)
    s.add(a)
    s.add(b)
    s.update(s.schedule(), 0.0)  # both prefilled (2 blocks each), one token each
    s.update(s.schedule(), 1.0)  # 7 tokens each: both fit in 2 blocks
    s.update(s.schedule(), 2.0)  # 8 tokens each: still 2 blocks each, pool full
    out = s.schedule()  # a needs a third block: b, the last running, is preempted
    assert [r for r, _ in out] == [a] and s.preemptions == 1 and list(s.waiting) == [b]
    assert b.num_computed == 0 and b.num_output == 3 and not b.blocks
    s.update(out, 3.0)
    assert s.schedule() == [(a, 1)], "no admission in a step after a preemption... and b does not fit"
    steps = run_to_end(s)
    readmit = next(n for step in steps for r, n in step if r is b)
    assert readmit == 9, "b recomputes its prompt and 3 outputs (a's growth evicted b's freed blocks)"
    assert a.finished and b.finished and pool.num_free == 4
    assert (s.queries, s.hits) == (12, 0), "prefix-cache counters skip readmissions after preemption"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20), st.integers(1, 4)), min_size=1, max_size=25),
    st.integers(10, 40),
)
def test_block_pool_invariants_hold(requests: list[tuple[int, int, int]], blocks: int) -> None:
    pool = BlockPool(blocks, BS)
    s = Scheduler(pool, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4))
    for prefix, length, out in requests:
        s.add(req([prefix] * 8 + list(range(length)), max_tokens=out))
    for t in range(2000):
        scheduled = s.schedule()
        if not scheduled and not s.waiting:
            break
        s.update(scheduled, float(t))
        pool.check()
        assert all(b.ref_cnt >= 0 for b in pool.blocks)
        for r in s.running:  # every cached block a request holds carries the tokens it hashed
            for i, b in enumerate(r.blocks[: r.num_cached_blocks]):
                assert b.block_hash == r.hashes[i] and b.tokens == tuple(r.tokens[i * BS : (i + 1) * BS])
    assert pool.num_free == blocks - 1, "everything finished and was released"


def _pressure_stream(s: Scheduler, cfg_now: list[float]) -> None:
    """Two alternating prefix families arriving in bursts, more than the cache holds at once."""
    for k in range(24):
        fam = k % 2
        r = req([100 + fam] * 32 + [k] * 4, max_tokens=2)
        r.arrival = cfg_now[0]
        s.add(r)


def _drive(cfg: SchedulerConfig, blocks: int = 14) -> tuple[Scheduler, float]:
    s = Scheduler(BlockPool(blocks, BS), cfg)
    now = [0.0]
    _pressure_stream(s, now)
    worst_wait = 0.0
    for _ in range(2000):
        out = s.schedule(now[0])
        for r, _n in out:
            if r.num_computed == r.num_cached_tokens:  # just admitted
                worst_wait = max(worst_wait, now[0] - r.arrival)
        if not out and not s.waiting:
            break
        s.update(out, now[0])
        now[0] += 0.01
    return s, worst_wait


def test_cache_aware_admission_raises_hits_within_the_aging_bound() -> None:
    fcfs, _ = _drive(SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=2))
    aware, worst = _drive(
        SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=2, cache_aware=True, aging_s=0.5)
    )
    assert aware.hits > fcfs.hits, (aware.hits, fcfs.hits)
    _, worst_fcfs = _drive(SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=2))
    assert worst <= worst_fcfs + 0.5 + 0.05, (worst, worst_fcfs)


def test_a_shared_prefix_is_computed_once() -> None:
    """vLLM caches blocks when it schedules them, so followers admitted in the same step already
    hit the leader's prefix."""
    s = Scheduler(BlockPool(64, BS), SchedulerConfig(max_num_batched_tokens=160))
    for k in range(4):
        s.add(req([7] * 32 + [k], max_tokens=1))
    run_to_end(s)
    assert s.hits == 3 * 32, "three followers hit the prefix the first one computed"


def test_a_request_with_loaded_kv_computes_only_its_last_token_and_caches_the_prompt() -> None:
    """P/D's decode side: the prompt's KV came from a prefill replica (``kv_loaded``)."""
    s = Scheduler(BlockPool(32, BS), SchedulerConfig(max_num_batched_tokens=64))
    r = req(list(range(1, 14)), max_tokens=3)
    r.kv_loaded = True
    s.add(r)
    first = s.schedule()
    assert first == [(r, 1)], "one token: a decode step, not a prefill"
    assert s.computed_part(r, 1) == (1, 12)
    assert (s.queries, s.hits) == (0, 0), "loaded KV is no prefix-cache query"
    s.update(first, 1.0)
    assert r.num_output == 1 and r.first_token_at == 1.0
    s.update(s.schedule(), 2.0)
    assert (r.prev_token_at, r.last_token_at) == (1.0, 2.0)
    hit = s.pool.lookup(chain_hashes(list(range(1, 14)), BS), list(range(1, 14)), 3)
    assert len(hit) == 3, "the loaded prompt's blocks are cached here now"
    run_to_end(s)
    local = req(list(range(1, 14)))
    s.add(local)
    s.schedule()
    assert local.num_cached_tokens == 12, "a later request hits the loaded prefix"

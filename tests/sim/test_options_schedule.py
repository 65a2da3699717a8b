"""Each scheduler option of the simulator, under contention, changes the schedule as its docstring
says. Assertions are on the schedule itself: which request ran in which step, for how many tokens,
and with how many cached tokens at admission. No timing."""

from __future__ import annotations

from replica.sim.blocks import BlockPool
from replica.sim.request import Request
from replica.sim.scheduler import Scheduler, SchedulerConfig

BS = 4
PREFIX = [7] * 32  # 8 blocks

Log = list[list[tuple[str, int]]]


def req(tokens: list[int], arrival: float = 0.0, max_tokens: int = 1) -> Request:
    return Request(tokens, max_tokens, BS, arrival=arrival)


def run(s: Scheduler, names: dict[int, str], now: float = 0.0, limit: int = 200) -> Log:
    """Every step's (request name, tokens scheduled), until nothing is left."""
    log: Log = []
    for t in range(limit):
        out = s.schedule(now)
        if not out:
            assert not s.waiting, "requests left waiting with nothing scheduled"
            return log
        log.append([(names[r.request_id], n) for r, n in out])
        s.update(out, float(t))
        s.pool.check()
    raise AssertionError("the schedule did not finish")


def followers(cfg: SchedulerConfig) -> tuple[Log, dict[str, Request]]:
    """A leader and three followers sharing a 32-token prefix nobody has computed, all waiting."""
    s = Scheduler(BlockPool(64, BS), cfg)
    reqs = {f"r{i}": req([*PREFIX, 100 + i, 101 + i]) for i in range(4)}
    for r in reqs.values():
        s.add(r)
    return run(s, {r.request_id: k for k, r in reqs.items()}), reqs


def test_a_block_is_a_hit_as_soon_as_it_is_scheduled() -> None:
    log, reqs = followers(SchedulerConfig(max_num_batched_tokens=64))
    assert log[0] == [("r0", 34), ("r1", 2), ("r2", 2), ("r3", 2)], log[0]
    assert [reqs[f"r{i}"].num_cached_tokens for i in range(4)] == [0, 32, 32, 32]


def test_a_chunk_cap_duplicates_a_shared_prefix() -> None:
    cap = SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    plain, p_reqs = followers(cap)
    assert plain[0] == [("r0", 8), ("r1", 8), ("r2", 8), ("r3", 8)], "capped: all four start at once"
    assert [p_reqs[f"r{i}"].num_cached_tokens for i in range(1, 4)] == [8, 16, 24], (
        "each follower hits the chunks scheduled before it, then computes blocks the leader "
        "computes again in its own later chunks"
    )
    assert sum(k for step in plain for _, k in step) > 34 + 3 * 2, "more than the prefix once"


def test_the_chunk_cap_applies_only_beside_other_requests() -> None:
    s = Scheduler(
        BlockPool(64, BS), SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    )
    alone = req(list(range(40)))
    s.add(alone)
    assert run(s, {alone.request_id: "a"})[0] == [("a", 40)], "alone, the whole budget"


def test_cache_aware_admission_serves_the_cached_prefix_first_until_the_aging_bound() -> None:
    def admitted_order(cache_aware: bool, now: float) -> tuple[list[str], int]:
        s = Scheduler(
            BlockPool(64, BS),
            SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, cache_aware=cache_aware, aging_s=1.0),
        )
        warm = req([*PREFIX, 1])
        s.add(warm)
        run(s, {warm.request_id: "warm"})
        cold, hot = req(list(range(200, 236))), req([*PREFIX, 2, 3])
        s.add(cold)
        s.add(hot)
        log = run(s, {cold.request_id: "cold", hot.request_id: "hot"}, now=now)
        return [step[0][0] for step in log], hot.num_cached_tokens

    assert admitted_order(False, 0.5) == (["cold", "hot"], 32), "FCFS: the cold head first"
    assert admitted_order(True, 0.5) == (["hot", "cold"], 32), "the cached prefix jumps the queue"
    assert admitted_order(True, 1.0) == (["cold", "hot"], 32), "past aging_s the FCFS head goes first"


def test_charging_cached_tokens_walks_the_hit_through_the_budget() -> None:
    def follower(charge: bool) -> tuple[Log, Request, list[tuple[int, int]]]:
        s = Scheduler(
            BlockPool(64, BS), SchedulerConfig(max_num_batched_tokens=10, charge_cached_tokens=charge)
        )
        lead = req([*PREFIX, 1])
        s.add(lead)
        run(s, {lead.request_id: "lead"})
        f = req([*PREFIX, 2, 3])
        s.add(f)
        work: list[tuple[int, int]] = []
        log: Log = []
        while out := s.schedule():
            work += [s.computed_part(r, n) for r, n in out]
            log.append([("f", n) for _, n in out])
            s.update(out, 0.0)
        return log, f, work

    log, f, work = follower(False)
    assert log == [[("f", 2)]] and f.num_cached_tokens == 32 and work == [(2, 32)]
    log, f, work = follower(True)
    assert log == [[("f", 10)], [("f", 10)], [("f", 10)], [("f", 4)]], "cached tokens take budget"
    assert f.num_cached_tokens == 32, "still a hit"
    assert work == [(0, 0), (0, 0), (0, 0), (2, 32)], "only the 2 uncached tokens are computed"

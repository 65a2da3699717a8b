"""Scheduling plugins on hand-built endpoint states (table-driven, one case per row)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest

from picker.core.config import build_profile
from picker.core.endpoints.types import Endpoint, EndpointMetrics, EndpointModel, EndpointState, Health, Load
from picker.core.errors import NoEndpoints, Overloaded
from picker.core.request import InferenceRequest
from picker.core.scheduling.cost import TIE_MARGIN, CostScorer
from picker.core.scheduling.filters import LoadGuardFilter, NotSaturatedFilter, ReadyFilter
from picker.core.scheduling.pickers import MaxScorePicker, RandomPicker, RoundRobinPicker
from picker.core.scheduling.profile import BUILTIN_POLICIES, Profile
from picker.core.scheduling.registry import make_filter, make_picker, make_scorer
from picker.core.scheduling.scorers import (
    InFlightTokensScorer,
    KVCacheScorer,
    LeastLoadedScorer,
    LoraAffinityScorer,
    PrefixScorer,
    QueueScorer,
    SessionAffinityScorer,
)
from picker.core.scheduling.types import Cycle


def ep(port: int, **kw: Any) -> EndpointState:
    """An endpoint on 10.0.0.1:<port>; metric fields (waiting, kv_usage, ...) go to its metrics,
    load fields (in_flight_requests, pending_prefill_tokens, ...) to its load."""
    metric_names, load_names = set(EndpointMetrics.__dataclass_fields__), set(Load.__dataclass_fields__)
    metrics = EndpointMetrics(**{k: v for k, v in kw.items() if k in metric_names})
    load = Load(**{k: v for k, v in kw.items() if k in load_names})
    state_kw = {k: v for k, v in kw.items() if k not in metric_names | load_names}
    return EndpointState(Endpoint("10.0.0.1", port), metrics=metrics, load=load, **state_kw)


def cycle(
    matches: dict[str, int] | None = None,
    n_blocks: int = 10,
    prompt_tokens: int = 160,
    lora: str = "",
    session: str = "",
    priority: int = 0,
) -> Cycle:
    req = InferenceRequest(model="m", routing_text="", lora=lora, session_id=session)
    return Cycle(req, prompt_tokens, 16.0, n_blocks, matches or {}, 0.0, priority)


def ports(endpoints: list[EndpointState]) -> list[int]:
    return [e.endpoint.port for e in endpoints]


# ---- filters -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("healths", "kept"),
    [
        ([Health.READY, Health.UNREACHABLE, Health.DEGRADED, Health.UNKNOWN], [1, 3, 4]),
        ([Health.UNREACHABLE], []),
    ],
)
def test_ready_filter(healths: list[Health], kept: list[int]) -> None:
    eps = [ep(i + 1, health=h) for i, h in enumerate(healths)]
    assert ports(ReadyFilter().filter(cycle(), eps)) == kept


@pytest.mark.parametrize(
    ("metrics", "kept"),
    [
        ([{"waiting": 0}, {"waiting": 63}, {"waiting": 64}], [1, 2]),
        ([{"kv_usage": 0.99, "waiting": 0}, {"kv_usage": 0.99, "waiting": 1}], [1]),
        ([{"kv_usage": 0.5, "waiting": 10}, {"kv_usage": 0.98, "waiting": 2}], [1]),
    ],
)
def test_not_saturated_filter(metrics: list[dict[str, float]], kept: list[int]) -> None:
    eps = [ep(i + 1, **m) for i, m in enumerate(metrics)]
    assert ports(NotSaturatedFilter().filter(cycle(), eps)) == kept


def test_not_saturated_sheds_only_sheddable_requests_when_all_saturated() -> None:
    eps = [ep(1, waiting=64), ep(2, kv_usage=1.0, waiting=1)]
    with pytest.raises(Overloaded, match="all 2 endpoints are saturated") as info:
        NotSaturatedFilter().filter(cycle(priority=-1), eps)
    assert info.value.status == 429
    for prio in (0, 5):  # not sheddable: the least-loaded endpoint
        assert ports(NotSaturatedFilter().filter(cycle(priority=prio), eps)) == [2]
    assert ports(NotSaturatedFilter(shed=False).filter(cycle(), eps)) == [1, 2], "no shed: keep all"
    assert NotSaturatedFilter().filter(cycle(), []) == []


@pytest.mark.parametrize(
    ("loads", "kept"),
    [
        ([0, 32, 33], [1, 2]),  # limit max(0 * 1.5, 0 + 32) = 32
        ([20, 52, 53], [1, 2]),  # limit max(30, 52) = 52
        ([100, 150, 151], [1, 2]),  # limit max(150, 132) = 150
        ([5, 5, 5], [1, 2, 3]),
    ],
)
def test_load_guard_filter_by_in_flight(loads: list[int], kept: list[int]) -> None:
    eps = [ep(i + 1, in_flight_requests=n) for i, n in enumerate(loads)]
    assert ports(LoadGuardFilter().filter(cycle(), eps)) == kept


def test_load_guard_uses_scraped_load_when_larger() -> None:
    eps = [ep(1, running=3, waiting=40), ep(2, in_flight_requests=2)]
    assert ports(LoadGuardFilter().filter(cycle(), eps)) == [2]
    single = [ep(1, waiting=1000)]
    assert LoadGuardFilter().filter(cycle(), single) == single, "never filters the last candidate"


# ---- scorers -------------------------------------------------------------------------------------


def test_prefix_scorer() -> None:
    eps = [ep(1), ep(2), ep(3)]
    got = PrefixScorer().score(cycle({"10.0.0.1:1": 10, "10.0.0.1:2": 5}, n_blocks=10), eps)
    assert got == {"10.0.0.1:1": 1.0, "10.0.0.1:2": 0.5, "10.0.0.1:3": 0.0}
    assert PrefixScorer().score(cycle(n_blocks=0), eps) == dict.fromkeys(got, 0.0)


@pytest.mark.parametrize(
    ("scorer", "states", "expected"),
    [
        (QueueScorer(), [{"waiting": 0}, {"waiting": 5}, {"waiting": 10}], [1.0, 0.5, 0.0]),
        (QueueScorer(), [{"waiting": 3}, {"waiting": 3}], [1.0, 1.0]),
        (KVCacheScorer(), [{"kv_usage": 0.25}, {"kv_usage": 1.5}, {"kv_usage": -1}], [0.75, 0.0, 1.0]),
        (InFlightTokensScorer(), [{"in_flight_tokens": 100}, {"in_flight_tokens": 300}], [1.0, 0.0]),
        (
            LeastLoadedScorer(),
            [{"in_flight_requests": 4}, {"running": 2, "waiting": 6}, {"in_flight_requests": 0}],
            [0.5, 0.0, 1.0],
        ),
    ],
)
def test_load_scorers(scorer: Any, states: list[dict[str, Any]], expected: list[float]) -> None:
    eps = [ep(i + 1, **s) for i, s in enumerate(states)]
    got = scorer.score(cycle(), eps)
    assert [got[e.key] for e in eps] == pytest.approx(expected)


def test_lora_affinity_scorer() -> None:
    eps = [
        ep(1, running_loras=frozenset({"a"}), max_lora=2),
        ep(2, waiting_loras=frozenset({"a"}), running_loras=frozenset({"b", "c"}), max_lora=2),
        ep(3, running_loras=frozenset({"b"}), max_lora=2),
        ep(4, running_loras=frozenset({"b", "c"}), max_lora=2),
    ]
    got = LoraAffinityScorer().score(cycle(lora="a"), eps)
    assert [got[e.key] for e in eps] == [1.0, 0.8, 0.5, 0.0]
    assert LoraAffinityScorer().score(cycle(), eps) == {}, "base model: no preference (all count as equal)"


def test_session_affinity_scorer_remembers_bounded() -> None:
    s = SessionAffinityScorer(max_sessions=2)
    eps = [ep(1), ep(2)]
    assert s.score(cycle(session="x"), eps) == {}, "unknown session: no preference"
    s.picked(cycle(session="x"), eps[1])
    assert s.score(cycle(session="x"), eps) == {"10.0.0.1:2": 1.0}
    s.picked(cycle(session="y"), eps[0])
    s.picked(cycle(session="z"), eps[0])
    assert s.score(cycle(session="x"), eps) == {}, "oldest session forgotten"
    s.picked(cycle(), eps[0])
    assert len(s._last) == 2, "requests without a session are not remembered"


# ---- the cost scorer -----------------------------------------------------------------------------
# est(e) = (max(pending, waiting * u(e)) + prompt - cached) / rate(e) + base(e) + per_seq(e) *
#          max(running, in_flight), with the endpoint's calibrated model; before calibration the
#          defaults: u 512 tokens, rate 10,000 tokens/s, base 0.005 s, per_seq 0.0005 s.
# Prompt 8192 tokens, A holds 256 blocks * 16 tokens = 4096 of them, B none:
#   est(A) = (q_A + 4096) / 1e4 + 0.005,  est(B) = 8192 / 1e4 + 0.005,
# so A wins exactly while its queued work q_A < 4096 tokens: pending 4095 → A, 4097 → B; by the
# waiting queue, 7 * 512 = 3584 → A, 9 * 512 = 4608 → B (8 * 512 = 4096 is the tie).

A, B = "10.0.0.1:1", "10.0.0.1:2"
HOT = {A: 256}


def _cost_pick(
    a: EndpointState, b: EndpointState, rate: float = 0.0, scorer: CostScorer | None = None
) -> int:
    cyc = cycle(HOT, n_blocks=512, prompt_tokens=8192)
    if rate:
        a.model.prefill_rate = b.model.prefill_rate = rate
    scores = (scorer or CostScorer()).score(cyc, [a, b])
    assert max(scores.values()) == 1.0
    if min(scores[A], scores[B]) >= 1.0 - 2 * TIE_MARGIN:  # a tie: the holder of more of the prompt wins it
        assert scores[A] > scores[B], "A holds the prompt's prefix, B nothing"
        return 0
    return 1 if scores[A] > scores[B] else 2


# A holds 4,096 of the 8,192 prompt tokens. With the default miss_penalty 1 each uncached token is
# charged twice, so A's saving is 2 x 4,096 = 8,192 tokens of prefill (0.8192 s at 10,000 tok/s).
# Costs within one engine step (0.005 s, 50 tokens here) of the cheapest tie (0).
@pytest.mark.parametrize(
    ("a_state", "winner"),
    [
        ({}, 1),
        ({"pending_prefill_tokens": 8141}, 1),
        ({"pending_prefill_tokens": 8192}, 0),
        ({"pending_prefill_tokens": 8243}, 2),
        ({"waiting": 15}, 1),  # 15 * 512 = 7,680 queued tokens
        ({"waiting": 17}, 2),  # 8,704
        ({"running": 8}, 1),  # the decode term: 8 * 0.0005 = 0.004 s < the 0.8192 s saved
        ({"in_flight_requests": 1628}, 1),  # 1628 * 0.0005 = 0.814 s < 0.8192 s - 0.005
        ({"in_flight_requests": 1650}, 2),  # 0.825 s > 0.8192 s + 0.005
    ],
)
def test_cost_crossover(a_state: dict[str, Any], winner: int) -> None:
    assert _cost_pick(ep(1, **a_state), ep(2)) == winner


@pytest.mark.parametrize(("pending", "winner"), [(4045, 1), (4096, 0), (4147, 2)])
def test_cost_without_miss_penalty_ranks_by_ttft_alone(pending: int, winner: int) -> None:
    """miss_penalty 0: the crossover is the plain TTFT tie, q_A = 4,096 tokens."""
    scorer = CostScorer(miss_penalty=0.0)
    assert _cost_pick(ep(1, pending_prefill_tokens=pending), ep(2), scorer=scorer) == winner


def test_miss_penalty_changes_the_score_not_the_estimate() -> None:
    """The explain API's TTFT estimate stays the plain estimate whatever the penalty."""
    cyc = cycle(HOT, n_blocks=512, prompt_tokens=8192)
    a, b = ep(1), ep(2)
    assert CostScorer(miss_penalty=3.0).estimates(cyc, [a, b]) == CostScorer(miss_penalty=0.0).estimates(
        cyc, [a, b]
    )
    assert (
        CostScorer(miss_penalty=3.0).score(cyc, [a, b])[B]
        < CostScorer(miss_penalty=0.0).score(cyc, [a, b])[B]
    )


@pytest.mark.parametrize(("rate", "pending", "winner"), [(1000.0, 8186, 1), (1000.0, 8198, 2)])
def test_cost_crossover_does_not_depend_on_the_rate(rate: float, pending: int, winner: int) -> None:
    """Queued and uncached work are divided by the same rate on equally fast endpoints: the
    crossover stays at q_A = 8,192 tokens whatever the rate."""
    assert _cost_pick(ep(1, pending_prefill_tokens=pending), ep(2), rate) == winner


def test_cost_uses_each_endpoints_calibrated_model() -> None:
    """Same uncached tokens, same load: the endpoint calibrated as slower gets the higher
    estimate, by its own rate and its own step time."""
    cyc = cycle({}, n_blocks=512, prompt_tokens=8192)
    slow = ep(1, running=4, model=EndpointModel(1024.0, 0.02, 0.004, 300.0))
    fast = ep(2, running=4, model=EndpointModel(4096.0, 0.01, 0.001, 300.0))
    est = CostScorer().estimates(cyc, [slow, fast])
    assert est[A] == pytest.approx(8192 / 1024 + 0.02 + 4 * 0.004)
    assert est[B] == pytest.approx(8192 / 4096 + 0.01 + 4 * 0.001)
    scores = CostScorer().score(cyc, [slow, fast])
    assert scores[B] == 1.0 > scores[A]


def test_a_hot_prefix_spills_by_a_margin_in_seconds() -> None:
    """The holder keeps the prefix until its TTFT exceeds the cold endpoint's by the miss's own
    prefill time there (miss_penalty 1): with a slow holder that comes after fewer queued tokens."""
    ties = []
    for holder_rate in (10_000.0, 7_000.0):
        a = ep(1, model=EndpointModel(holder_rate, 0.005, 0.0005, 512.0))
        b = ep(2)
        # cost(A) = (q + 2 * 4096) / rA + step; cost(B) = ttft(B) + margin = 2 * 8192 / 1e4 + step
        q_tie = (2 * 8192 / 10_000.0) * holder_rate - 2 * 4096
        ties.append(q_tie)
        for q, winner in ((q_tie - 60, 1), (q_tie, 0), (q_tie + 60, 2)):
            a.load.pending_prefill_tokens = int(q)
            assert _cost_pick(a, b) == winner, (holder_rate, q)
    assert ties[1] < ties[0] / 2, "the slower holder spills after far less queued work"


@pytest.mark.parametrize(
    ("pending", "slo_ms", "winner"),
    [
        (10_000, 0.0, 2),  # no objective: A's cost 1.82 s > B's 1.64 s, the prefix spills
        (10_000, 2000.0, 1),  # ttft(A) = 1.41 s meets 2 s: the holder keeps it
        (10_000, 1000.0, 2),  # 1.41 s misses 1 s; B (0.82 s) meets it: the rule above
        (15_854, 2000.0, 1),  # ttft(A) = 1.9994 s: still meets it
        (15_860, 2000.0, 2),  # 2.0000 s + a token: misses it
        (20_000, 2000.0, 2),  # 2.41 s: misses it; B meets it
    ],
)
def test_a_ttft_objective_keeps_the_deepest_holder_that_meets_it(
    pending: int, slo_ms: float, winner: int
) -> None:
    """With a TTFT objective, among the endpoints predicted to meet it the one holding the most
    of the prompt wins, whatever the cold endpoint's lower TTFT; an endpoint that misses it is
    ranked as without the objective."""
    cyc = cycle(HOT, n_blocks=512, prompt_tokens=8192)
    cyc = dataclasses.replace(cyc, request=dataclasses.replace(cyc.request, slo_ttft_ms=slo_ms))
    a, b = ep(1, pending_prefill_tokens=pending), ep(2)
    scores = CostScorer().score(cyc, [a, b])
    assert max(scores.values()) == 1.0
    assert (1 if scores[A] > scores[B] else 2) == winner
    assert CostScorer().estimates(cyc, [a, b]) == CostScorer().estimates(
        dataclasses.replace(cyc, request=dataclasses.replace(cyc.request, slo_ttft_ms=0.0)), [a, b]
    ), "the TTFT estimates are the objective's input, unchanged"


def test_a_ttft_objective_ranks_the_others_after_the_holder_in_cost_order() -> None:
    """The endpoints left out of the objective's preferred set keep their own order below it."""
    cyc = cycle(HOT, n_blocks=512, prompt_tokens=8192)
    cyc = dataclasses.replace(cyc, request=dataclasses.replace(cyc.request, slo_ttft_ms=2000.0))
    a, b, c = ep(1, pending_prefill_tokens=10_000), ep(2), ep(3, pending_prefill_tokens=4000)
    scores = CostScorer().score(cyc, [a, b, c])
    assert scores[A] == 1.0 > scores[B] > scores["10.0.0.1:3"]


def test_a_tie_goes_to_the_endpoint_holding_more_of_the_prompt() -> None:
    """A miss cheaper than one engine step ties the costs; the holder still wins every pick
    (a second copy at random wastes cache), and with nothing cached the tie stays random."""
    fast = EndpointModel(900_000.0, 0.0014, 0.00007, 196.0)  # the fast simulator, calibrated
    endpoints = [ep(1, model=fast), ep(2, model=dataclasses.replace(fast))]
    picker = MaxScorePicker(seed=1)
    held = cycle({B: 12}, n_blocks=12, prompt_tokens=195)
    scores = CostScorer(miss_penalty=2.0).score(held, endpoints)
    assert scores[B] == 1.0 and 1.0 - scores[A] == pytest.approx(TIE_MARGIN), "a tie, ordered"
    assert {picker.pick(scores, endpoints, 1)[0].key for _ in range(50)} == {B}
    cold = CostScorer(miss_penalty=2.0).score(cycle({}, n_blocks=12, prompt_tokens=195), endpoints)
    assert cold == {A: 1.0, B: 1.0}
    assert Counter(picker.pick(cold, endpoints, 1)[0].key for _ in range(200))[A] in range(70, 131)


def test_cost_rejects_bad_params() -> None:
    with pytest.raises(ValueError, match="miss_penalty"):
        make_scorer("cost", {"miss_penalty": -1})
    with pytest.raises(ValueError, match="unknown params"):
        make_scorer("cost", {"decode_step_s": 0.001})  # calibrated now, not a parameter


def test_cost_estimate_by_hand() -> None:
    cyc = cycle(HOT, n_blocks=512, prompt_tokens=8192)
    a = ep(1, waiting=2, running=3, in_flight_requests=5, model=EndpointModel(2000.0, 0.005, 0.0005, 512.0))
    # queued = max(0, 2 * 512) = 1024; uncached = 8192 - 4096; running = max(3, 5)
    expected = (1024 + 4096) / 2000 + 5 * 0.0005 + 0.005
    assert CostScorer().estimate(cyc, a) == pytest.approx(expected)
    assert CostScorer().estimates(cyc, [a])[A] == pytest.approx(expected)


# ---- pickers -------------------------------------------------------------------------------------


def test_max_score_orders_by_score() -> None:
    eps = [ep(1), ep(2), ep(3)]
    scores = {"10.0.0.1:1": 0.1, "10.0.0.1:2": 0.9, "10.0.0.1:3": 0.5}
    assert ports(MaxScorePicker(seed=1).pick(scores, eps, 3)) == [2, 3, 1]
    assert ports(MaxScorePicker(seed=1).pick(scores, eps, 1)) == [2]


def test_max_score_tie_break_is_random() -> None:
    eps = [ep(1), ep(2), ep(3)]
    scores = {"10.0.0.1:1": 1.0, "10.0.0.1:2": 1.0, "10.0.0.1:3": 0.2}
    picker = MaxScorePicker(seed=7)
    firsts = Counter(picker.pick(scores, eps, 2)[0].endpoint.port for _ in range(400))
    assert set(firsts) == {1, 2}, f"both tied endpoints win sometimes, got {firsts}"
    assert min(firsts.values()) > 100, f"ties split roughly evenly, got {firsts}"
    assert all(ports(picker.pick(scores, eps, 3))[2] == 3 for _ in range(50))
    alone = Counter(picker.pick(scores, eps, 1)[0].endpoint.port for _ in range(400))
    assert set(alone) == {1, 2} and min(alone.values()) > 100, f"one pick breaks ties too: {alone}"


def test_round_robin_cycles_in_key_order() -> None:
    eps = [ep(3), ep(1), ep(2)]
    rr = RoundRobinPicker()
    firsts = [rr.pick({}, eps, 1)[0].endpoint.port for _ in range(6)]
    assert firsts == [1, 2, 3, 1, 2, 3]
    assert ports(rr.pick({}, eps, 3)) == [1, 2, 3]


def test_random_picker_distinct() -> None:
    eps = [ep(1), ep(2), ep(3)]
    got = RandomPicker(seed=3).pick({}, eps, 5)
    assert sorted(ports(got)) == [1, 2, 3]


# ---- registry and profiles -----------------------------------------------------------------------


def test_registry_rejects_unknown_names_and_params() -> None:
    with pytest.raises(ValueError, match=r"unknown scorer plugin 'nope'; known: .*prefix"):
        make_scorer("nope")
    with pytest.raises(ValueError, match="unknown filter plugin 'x'"):
        make_filter("x")
    with pytest.raises(ValueError, match="unknown picker plugin 'best'"):
        make_picker("best")
    with pytest.raises(ValueError, match=r"filter 'not-saturated': unknown params \['max_wait'\]"):
        make_filter("not-saturated", {"max_wait": 3})
    with pytest.raises(ValueError, match=r"unknown params \['_rng'\]"):
        make_picker("max-score", {"_rng": None})


def test_registry_applies_params() -> None:
    f = make_filter("not-saturated", {"max_waiting": 3})
    assert isinstance(f, NotSaturatedFilter) and f.max_waiting == 3
    c = make_scorer("cost", {"miss_penalty": 0.5})
    assert isinstance(c, CostScorer) and c.miss_penalty == 0.5


@pytest.mark.parametrize("name", sorted(BUILTIN_POLICIES))
def test_builtin_policies_build_and_pick(name: str) -> None:
    profile = build_profile(name, BUILTIN_POLICIES[name])
    eps = [ep(1), ep(2, health=Health.UNREACHABLE), ep(3)]
    result = profile.run(cycle(), eps, 2)
    assert 2 not in ports(result.chosen) and len(result.chosen) == 2


def test_profile_clamps_weights_and_records_timings() -> None:
    timings: list[str] = []
    spec = {"scorers": [{"type": "prefix", "weight": 3}, {"type": "queue", "weight": 2}]}
    profile = build_profile("p", spec)
    profile.timer = lambda name, dt: timings.append(name)
    eps = [ep(1, waiting=10), ep(2)]
    result = profile.run(cycle({A: 10}, n_blocks=10), eps, 1)
    assert result.scores == {A: 3.0, B: 2.0}
    assert ports(result.chosen) == [1] and timings == ["prefix", "queue"]


def test_profile_clamps_scores_out_of_range_and_nan() -> None:
    class Odd:
        def score(self, cycle: Cycle, endpoints: Any) -> dict[str, float]:
            return {A: -0.5, B: 7.0, "10.0.0.1:3": float("nan")}

    profile = Profile("p", [], [("odd", Odd(), 2.0)], ("max-score", MaxScorePicker(seed=1)))
    result = profile.run(cycle(), [ep(1), ep(2), ep(3)], 1)
    assert result.scores == {A: 0.0, B: 2.0, "10.0.0.1:3": 0.0}
    assert ports(result.chosen) == [2]


def test_profile_raises_when_filters_leave_nothing() -> None:
    profile = build_profile("cost", BUILTIN_POLICIES["cost"])
    with pytest.raises(NoEndpoints, match="filter 'ready' left none"):
        profile.run(cycle(), [ep(1, health=Health.UNREACHABLE)], 1)
    with pytest.raises(Overloaded):
        profile.run(cycle(priority=-1), [ep(1, waiting=100), ep(2, waiting=100)], 1)


def test_profile_rejects_misspelt_keys() -> None:
    with pytest.raises(ValueError, match="wieght"):
        build_profile("p", {"scorers": [{"type": "prefix", "wieght": 3}]})
    with pytest.raises(ValueError, match="scorer"):
        build_profile("p", {"scorer": [{"type": "prefix"}]})

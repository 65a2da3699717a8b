"""The pruned pick (``CostScorer.score_top`` through ``Profile.run``) against the exhaustive one,
over random fleets (hypothesis): the same scores for every endpoint it scores, every endpoint
left out unable to win, and, with the same seed, the same pick."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from picker.core.config import build_profile
from picker.core.endpoints.types import (
    Endpoint,
    EndpointMetrics,
    EndpointModel,
    EndpointState,
    Load,
    PeerLoad,
)
from picker.core.request import InferenceRequest
from picker.core.scheduling.cost import PRUNE_MIN, CostScorer
from picker.core.scheduling.pickers import MaxScorePicker
from picker.core.scheduling.profile import BUILTIN_POLICIES, Profile
from picker.core.scheduling.types import Cycle

SPEEDS = [(10_000.0, 0.005, 0.0005), (4_000.0, 0.012, 0.001), (25_000.0, 0.003, 0.0002)]
"""(prefill_rate, step_base_s, step_per_seq_s): an H100-, an L4- and a faster profile."""


@st.composite
def fleets(draw: Any) -> tuple[list[EndpointState], Cycle]:
    """A fleet of ``PRUNE_MIN`` to 3 × that endpoints, mixed speeds (each a little off its
    profile, as calibration leaves them), random loads, and a prompt held to random depths."""
    n = draw(st.integers(PRUNE_MIN, 3 * PRUNE_MIN))
    block_tokens = draw(st.sampled_from([16.0, 64.0, 21.3]))
    n_blocks = draw(st.integers(1, 512))
    prompt = int(n_blocks * block_tokens) + draw(st.integers(0, 15))
    holders = draw(st.integers(0, n))  # how many hold some of the prompt
    shared = draw(st.booleans())  # holders at a few common depths (ties) or anywhere
    idle = draw(st.booleans())  # many identical idle endpoints: exact cost ties
    eps, matches = [], {}
    for i in range(n):
        rate, base, per_seq = SPEEDS[draw(st.integers(0, len(SPEEDS) - 1))]
        if not idle:
            rate *= draw(st.floats(0.8, 1.2))
            base *= draw(st.floats(0.8, 1.2))
        busy = not idle and draw(st.booleans())
        e = EndpointState(
            Endpoint("10.0.0.1", 8000 + i),
            metrics=EndpointMetrics(
                waiting=float(draw(st.integers(0, 8))) if busy else 0.0,
                running=float(draw(st.integers(0, 64))) if busy else 0.0,
            ),
            load=Load(
                in_flight_requests=draw(st.integers(0, 16)) if busy else 0,
                pending_prefill_tokens=draw(st.integers(0, 40_000)) if busy else 0,
                pending_requests=draw(st.integers(0, 4)) if busy else 0,
            ),
            peer_load=PeerLoad(pending_prefill_tokens=draw(st.integers(0, 5_000)) if busy else 0),
            model=EndpointModel(
                prefill_rate=rate, step_base_s=base, step_per_seq_s=per_seq, uncached_per_request=512.0
            ),
        )
        eps.append(e)
        if i < holders:
            depth = draw(
                st.sampled_from([n_blocks, n_blocks // 2, 1]) if shared else st.integers(0, n_blocks)
            )
            matches[e.key] = depth
    order = draw(st.permutations(range(n)))
    eps = [eps[i] for i in order]
    session = draw(st.sampled_from(["", "s1"]))
    req = InferenceRequest(model="m", routing_text="", session_id=session)
    return eps, Cycle(req, prompt, block_tokens, n_blocks, matches, 0.0)


@settings(max_examples=200, deadline=None)
@given(fleets(), st.sampled_from([0.0, 1.0, 2.0]), st.sampled_from([0.0, 1e-7, 0.2, 0.5, 0.99]))
def test_score_top_keeps_every_endpoint_that_can_win(
    fleet: tuple[list[EndpointState], Cycle], penalty: float, slack: float
) -> None:
    eps, cyc = fleet
    scorer = CostScorer(miss_penalty=penalty)
    full = scorer.score(cyc, eps)
    top = scorer.score_top(cyc, eps, slack)
    assert top == {k: full[k] for k in top}, "a pruned score differs from the exhaustive one"
    best = max(full.values())
    assert best == 1.0
    left_out = {k: v for k, v in full.items() if k not in top}
    assert all(v < best - slack for v in left_out.values()), f"left out within {slack} of the best"


@settings(max_examples=200, deadline=None)
@given(fleets(), st.integers(0, 2**32 - 1), st.booleans())
def test_pruned_profile_picks_as_the_exhaustive_one(
    fleet: tuple[list[EndpointState], Cycle], seed: int, precise: bool
) -> None:
    """The shipped ``cost`` profile (cost 10, LoRA and session affinity 1 each), with session
    affinity pointing at a random endpoint: the same winners (the endpoints at the highest total,
    with the same totals), and with the same seed the same endpoint."""
    eps, cyc = fleet
    spec = BUILTIN_POLICIES["cost"]
    picks = []
    for prune in (False, True):
        profile = build_profile("cost", spec)
        if precise:  # the precise mode's penalty (Router's precise profiles)
            cost = profile.scorer("cost")
            assert isinstance(cost, CostScorer)
            cost.miss_penalty = 2.0
        profile = Profile(
            profile.name, profile.filters, profile.scorers, ("max-score", MaxScorePicker(seed=seed))
        )
        if cyc.request.session_id:  # affinity to an endpoint the cost alone may not pick
            session = profile.scorer("session-affinity")
            assert session is not None and hasattr(session, "picked")
            session.picked(cyc, eps[seed % len(eps)])
        result = profile.run(cyc, list(eps), 1, commit=False, prune=prune)
        top = max(result.scores.values())
        picks.append((result.chosen[0].key, {k: v for k, v in result.scores.items() if v == top}))
    (full_pick, full_winners), (pruned_pick, pruned_winners) = picks
    assert pruned_winners == full_winners
    assert pruned_pick == full_pick


def test_profile_prunes_only_behind_a_dominant_cost_scorer() -> None:
    """Pruning needs the cost scorer to outweigh the others together (slack < 1)."""
    assert build_profile("cost", BUILTIN_POLICIES["cost"])._top == (0, 0.2, PRUNE_MIN)
    even = {"scorers": [{"type": "cost", "weight": 1}, {"type": "prefix", "weight": 1}]}
    assert build_profile("even", even)._top is None
    assert build_profile("ll", BUILTIN_POLICIES["least-loaded"])._top is None


def test_a_large_fleet_costs_only_the_endpoints_that_can_win() -> None:
    """512 idle endpoints, one holding the whole prompt and eight holding half of it: the holder
    of the whole prompt wins alone, and the non-holders are never costed."""
    eps = [EndpointState(Endpoint("10.0.0.1", 8000 + i)) for i in range(512)]
    matches = {eps[7].key: 100, **{eps[i].key: 50 for i in range(100, 108)}}
    cyc = Cycle(InferenceRequest(model="m", routing_text=""), 1600, 16.0, 100, matches, 0.0)
    top = CostScorer().score_top(cyc, eps, 0.2)
    assert top == {eps[7].key: 1.0}
    result = build_profile("cost", BUILTIN_POLICIES["cost"]).run(cyc, eps, 1, commit=False)
    assert [e.key for e in result.chosen] == [eps[7].key] and result.candidates == 512

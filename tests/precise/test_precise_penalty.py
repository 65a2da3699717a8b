"""``prefix.precise_miss_penalty``: precise cycles run each profile with its default-penalty ``cost``
scorers charging the precise penalty; explicit penalties, approximate mode and approximate cycles
keep theirs."""

from __future__ import annotations

import pytest

from picker.core import config as picker_config
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint
from picker.core.prefix.precise import State, Sync
from picker.core.request import InferenceRequest
from picker.core.router import Router
from picker.core.scheduling.cost import CostScorer

pytestmark = pytest.mark.precise
EPS = [Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)]
MINE = {
    "mine": {"scorers": [{"type": "cost", "params": {"miss_penalty": 0.5}}], "picker": {"type": "max-score"}}
}


def router(mode: str) -> Router:
    pool = Pool()
    pool.set_endpoints(EPS)
    cfg = picker_config.load({"prefix": {"mode": mode, "block_size": 16}, "profiles": MINE})
    r = Router(cfg, pool)
    for s in pool:
        r.syncs[s.key] = Sync(State.SYNCED, expected=0)
    return r


def penalty(r: Router, name: str, precise: bool) -> float:
    profile = (r.precise_profiles if precise else r.profiles)[name]
    return next(s.miss_penalty for _, s, _ in profile.scorers if isinstance(s, CostScorer))


def test_precise_cycles_charge_the_precise_penalty() -> None:
    r = router("precise")
    assert penalty(r, "cost", precise=True) == 2.0 and penalty(r, "cost", precise=False) == 1.0
    assert penalty(r, "mine", precise=True) == 0.5, "an explicit penalty is the operator's"
    assert r.precise_profiles["round-robin"] is r.profiles["round-robin"]
    assert router("approximate").precise_profiles == {}


def test_the_profile_used_depends_on_the_cycle() -> None:
    r = router("precise")
    seen: list[float] = []
    for profiles in (r.profiles, r.precise_profiles):
        scorer = next(s for _, s, _ in profiles["cost"].scorers if isinstance(s, CostScorer))
        orig = scorer.score

        def spy(cycle, endpoints, scorer=scorer, orig=orig):  # type: ignore[no-untyped-def]
            seen.append(scorer.miss_penalty)
            return orig(cycle, endpoints)

        scorer.score = spy  # type: ignore[method-assign]
    r.route(InferenceRequest(model="m", routing_text="x" * 400, prompt_token_ids=list(range(64))))
    r.route(InferenceRequest(model="m", routing_text="x" * 400))  # no token ids: approximate
    assert seen == [2.0, 1.0]

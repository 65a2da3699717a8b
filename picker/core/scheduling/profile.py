"""The cycle runner: filters → weighted scorers → picker. It owns the shared steps (clamping,
weighting, stopping when filters leave nothing, timing each plugin); plugins own none of them."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from picker.core.endpoints.types import EndpointState
from picker.core.errors import NoEndpoints
from picker.core.scheduling.types import Cycle, Filter, Picker, PostPick, Scorer, TopScorer

PluginTimer = Callable[[str, float], None]


@dataclass(frozen=True, slots=True)
class Result:
    chosen: list[EndpointState]
    """Primary first, then fallbacks; never empty."""
    scores: dict[str, float]
    """Weighted total per candidate that survived the filters."""
    per_scorer: dict[str, dict[str, float]]
    candidates: int


@dataclass
class Profile:
    name: str
    filters: Sequence[tuple[str, Filter]]
    scorers: Sequence[tuple[str, Scorer, float]]
    picker: tuple[str, Picker]
    timer: PluginTimer | None = field(default=None, repr=False)
    _post_pick: list[PostPick] = field(init=False, repr=False)
    _top: tuple[int, float, int] | None = field(init=False, repr=False)
    """(index, slack, fewest candidates) of the scorer that may prune (:meth:`run`), or None."""

    def __post_init__(self) -> None:
        # isinstance() against a runtime Protocol is slow: decide once, not per cycle.
        self._post_pick = [s for _, s, _ in self.scorers if isinstance(s, PostPick)]
        self._top = None
        weights = [w for _, _, w in self.scorers]
        if weights and min(weights) >= 0 and max(weights) > 0:
            i = weights.index(max(weights))
            slack = (sum(weights) - weights[i]) / weights[i]
            top = self.scorers[i][1]
            if slack < 1.0 and isinstance(top, TopScorer):
                self._top = (i, slack, top.prune_min)

    def run(
        self, cycle: Cycle, endpoints: list[EndpointState], k: int, commit: bool = True, prune: bool = True
    ) -> Result:
        """One cycle. With ``commit=False`` (explain) no plugin learns of the pick.

        With ``prune`` (and one endpoint to pick) a :class:`TopScorer` that outweighs the other
        scorers together (their weights sum to ``slack`` times its weight, ``slack < 1``) scores
        only the endpoints within ``slack`` of its best: one it leaves out scores below
        ``best - slack`` there, so its total is below ``weight * best``, the least total of the
        endpoint it scores best. The pick is the same; ``Result.scores`` then holds only the
        endpoints scored (an endpoint left out counts 0, and cannot win)."""
        assert k >= 1, f"must pick at least one endpoint, asked for {k}"
        timer, clock = self.timer, time.perf_counter
        for name, f in self.filters:
            t0 = clock()
            endpoints = f.filter(cycle, endpoints)
            if timer:
                timer(name, clock() - t0)
            if not endpoints:
                raise NoEndpoints(f"no ready endpoint (filter {name!r} left none)")
        top = self._top if prune and k == 1 and self._top and len(endpoints) >= self._top[2] else None
        totals: dict[str, float] = {} if top else dict.fromkeys([e.key for e in endpoints], 0.0)
        per_scorer: dict[str, dict[str, float]] = {}
        if top:  # the pruning scorer first: its endpoints are the only ones totalled
            name, s, _ = self.scorers[top[0]]
            t0 = clock()
            per_scorer[name] = cast(TopScorer, s).score_top(cycle, endpoints, top[1])
            if timer:
                timer(name, clock() - t0)
            totals = dict.fromkeys(per_scorer[name], 0.0)
        for i, (name, s, weight) in enumerate(self.scorers):
            if top and i == top[0]:
                scores = per_scorer[name]
            else:
                t0 = clock()
                scores = s.score(cycle, endpoints)
                if timer:
                    timer(name, clock() - t0)
            per_scorer[name] = scores
            for key, v in scores.items():
                if key in totals:  # clamped to [0, 1] (NaN counts as 0)
                    totals[key] += weight * (v if 0.0 <= v <= 1.0 else 1.0 if v > 1.0 else 0.0)
        pname, picker = self.picker
        chosen = picker.pick(totals, endpoints, k)
        assert chosen, f"picker {pname!r} returned nothing from {len(endpoints)} candidates"
        for plugin in self._post_pick if commit else ():
            plugin.picked(cycle, chosen[0])
        return Result(chosen=chosen, scores=totals, per_scorer=per_scorer, candidates=len(endpoints))

    def scorer(self, name: str) -> Scorer | None:
        return next((s for n, s, _ in self.scorers if n == name), None)


BUILTIN_POLICIES: Mapping[str, Mapping[str, object]] = {
    # Ours: minimum estimated TTFT, with a load guard against hot-prefix pile-up.
    "cost": {
        "filters": [{"type": "ready"}, {"type": "not-saturated"}, {"type": "load-guard"}],
        "scorers": [
            {"type": "cost", "weight": 10},
            {"type": "lora-affinity", "weight": 1},
            {"type": "session-affinity", "weight": 1},
        ],
        "picker": {"type": "max-score"},
    },
    "round-robin": {
        "filters": [{"type": "ready"}],
        "scorers": [],
        "picker": {"type": "round-robin"},
    },
    "least-loaded": {
        "filters": [{"type": "ready"}],
        "scorers": [{"type": "least-loaded", "weight": 1}],
        "picker": {"type": "max-score"},
    },
}

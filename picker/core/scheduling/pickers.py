"""Pickers: turn weighted scores into an ordered choice (primary, then fallbacks)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from picker.core.endpoints.types import EndpointState


@dataclass
class MaxScorePicker:
    """Highest score first; ties broken at random so equal endpoints share load."""

    seed: int | None = None
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def pick(
        self, scores: Mapping[str, float], endpoints: Sequence[EndpointState], k: int
    ) -> list[EndpointState]:
        rnd = self._rng.random
        if k == 1 and len(scores) < len(endpoints) and scores and max(scores.values()) > 0:
            # Sparse scores (a pruned profile, ``Profile.run``): only the scored can win. One draw
            # per endpoint all the same, so a seed makes the same picks as the pass below.
            draws = [rnd() for _ in range(len(endpoints))]
            scored = [i for i, e in enumerate(endpoints) if e.key in scores]
            return [endpoints[max(scored, key=lambda i: (scores[endpoints[i].key], draws[i]))]]
        if k == 1:  # the usual case (no fallbacks): one pass, no sort
            return [max(endpoints, key=lambda e: (scores.get(e.key, 0.0), rnd()))]
        ranked = sorted(endpoints, key=lambda e: (scores.get(e.key, 0.0), rnd()), reverse=True)
        return ranked[:k]


@dataclass
class RoundRobinPicker:
    """Ignores scores; cycles through the candidates in key order."""

    _next: int = field(default=0, repr=False)

    def pick(
        self, scores: Mapping[str, float], endpoints: Sequence[EndpointState], k: int
    ) -> list[EndpointState]:
        ordered = sorted(endpoints, key=lambda e: e.key)
        start = self._next % len(ordered)
        self._next += 1
        rotated = ordered[start:] + ordered[:start]
        return rotated[:k]


@dataclass
class RandomPicker:
    seed: int | None = None
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def pick(
        self, scores: Mapping[str, float], endpoints: Sequence[EndpointState], k: int
    ) -> list[EndpointState]:
        return self._rng.sample(list(endpoints), min(k, len(endpoints)))

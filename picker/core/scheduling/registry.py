"""The one table of plugins by name. A factory lays YAML ``params`` over the plugin dataclass's
defaults; unknown parameters are an error, not silently ignored."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from picker.core.scheduling.cost import CostScorer
from picker.core.scheduling.filters import LoadGuardFilter, NotSaturatedFilter, ReadyFilter
from picker.core.scheduling.pd import AlwaysDecider, CostDecider, Decider, NeverDecider, TokenThresholdDecider
from picker.core.scheduling.pickers import MaxScorePicker, RandomPicker, RoundRobinPicker
from picker.core.scheduling.scorers import (
    InFlightTokensScorer,
    KVCacheScorer,
    LeastLoadedScorer,
    LoraAffinityScorer,
    PrefixScorer,
    QueueScorer,
    SessionAffinityScorer,
)
from picker.core.scheduling.types import Filter, Picker, Scorer

FILTERS: dict[str, type[Any]] = {
    "ready": ReadyFilter,
    "not-saturated": NotSaturatedFilter,
    "load-guard": LoadGuardFilter,
}
SCORERS: dict[str, type[Any]] = {
    "prefix": PrefixScorer,
    "queue": QueueScorer,
    "kv-cache": KVCacheScorer,
    "in-flight-tokens": InFlightTokensScorer,
    "least-loaded": LeastLoadedScorer,
    "lora-affinity": LoraAffinityScorer,
    "session-affinity": SessionAffinityScorer,
    "cost": CostScorer,
}
PICKERS: dict[str, type[Any]] = {
    "max-score": MaxScorePicker,
    "round-robin": RoundRobinPicker,
    "random": RandomPicker,
}

DECIDERS: dict[str, type[Any]] = {
    "cost": CostDecider,
    "token-threshold": TokenThresholdDecider,
    "always": AlwaysDecider,
    "never": NeverDecider,
}
"""P/D deciders (:mod:`picker.core.scheduling.pd`), ``pd.decider`` in the config."""


def _build(table: Mapping[str, type[Any]], kind: str, name: str, params: Mapping[str, Any] | None) -> Any:
    cls = table.get(name)
    if cls is None:
        raise ValueError(f"unknown {kind} plugin {name!r}; known: {', '.join(sorted(table))}")
    allowed = {f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}
    unknown = set(params or {}) - allowed
    if unknown:
        raise ValueError(f"{kind} {name!r}: unknown params {sorted(unknown)}; allowed: {sorted(allowed)}")
    return cls(**dict(params or {}))


def make_filter(name: str, params: Mapping[str, Any] | None = None) -> Filter:
    f: Filter = _build(FILTERS, "filter", name, params)
    return f


def make_scorer(name: str, params: Mapping[str, Any] | None = None) -> Scorer:
    s: Scorer = _build(SCORERS, "scorer", name, params)
    return s


def make_picker(name: str, params: Mapping[str, Any] | None = None) -> Picker:
    p: Picker = _build(PICKERS, "picker", name, params)
    return p


def make_decider(name: str, params: Mapping[str, Any] | None = None) -> Decider:
    d: Decider = _build(DECIDERS, "decider", name, params)
    return d


Factory = Callable[[str, Mapping[str, Any] | None], Any]

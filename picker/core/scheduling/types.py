"""Extension points of the scheduler: one ``Protocol`` each, one method each.

- A :class:`Filter` narrows the candidate list; it never reorders or adds.
- A :class:`Scorer` returns a score in [0, 1] per endpoint key (higher is better). The runner
  clamps and weights; a scorer never sees another scorer's output.
- A :class:`Picker` orders the best candidates: primary first, then fallbacks.
- A :class:`PostPick` plugin (optional) learns the outcome of a cycle, e.g. session affinity.

Plugins do no I/O: everything they need is in :class:`Cycle` and the endpoint states.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from picker.core.endpoints.types import EndpointState
from picker.core.request import InferenceRequest


@dataclass(frozen=True, slots=True)
class Cycle:
    """One scheduling cycle's inputs, computed once by the router before any plugin runs."""

    request: InferenceRequest
    prompt_tokens: int
    """Estimated prompt tokens (routing text bytes / chars-per-token, or the token-id count)."""
    block_tokens: float
    """Estimated tokens per prefix-hash block."""
    n_blocks: int
    matches: Mapping[str, int]
    """Endpoint key → leading prefix blocks the index says that endpoint has."""
    now: float
    priority: int = 0
    """The request's objective priority (config ``objectives``); negative means sheddable."""

    def cached_tokens(self, key: str) -> int:
        return min(self.prompt_tokens, int(self.matches.get(key, 0) * self.block_tokens))


class Filter(Protocol):
    def filter(self, cycle: Cycle, endpoints: list[EndpointState]) -> list[EndpointState]: ...


class Scorer(Protocol):
    def score(self, cycle: Cycle, endpoints: Sequence[EndpointState]) -> dict[str, float]:
        """Scores in [0, 1] by endpoint key; an endpoint left out scores 0."""
        ...


@runtime_checkable
class TopScorer(Protocol):
    """A scorer that can leave out endpoints that cannot win (optional; :class:`Profile` uses it
    when this scorer outweighs all the others together)."""

    prune_min: int
    """Below this many candidates pruning saves nothing: ``Profile`` calls ``score``."""

    def score_top(self, cycle: Cycle, endpoints: Sequence[EndpointState], slack: float) -> dict[str, float]:
        """``score``'s values for a subset of ``endpoints`` holding every endpoint whose score is
        at least the best score minus ``slack``."""
        ...


class Picker(Protocol):
    def pick(
        self, scores: Mapping[str, float], endpoints: Sequence[EndpointState], k: int
    ) -> list[EndpointState]:
        """Return at most ``k`` distinct endpoints, best first. ``endpoints`` is never empty."""
        ...


@runtime_checkable
class PostPick(Protocol):
    def picked(self, cycle: Cycle, chosen: EndpointState) -> None: ...


Plugin = Filter | Scorer | Picker

"""Objective priorities: the ``x-llm-d-inference-objective`` header (or its alias ``x-gateway-inference-objective``) names an objective, whose
priority decides whether the request may be shed (negative: 429 when the pool is saturated).

Two sources, one answer per name:
- config ``objectives`` (``{name: priority}``), always;
- where the cluster has GIE's InferenceObjective CRD (``inference.networking.x-k8s.io/v1alpha2``),
  the objects whose ``spec.poolRef`` names this picker's pool, watched by Kubernetes discovery.

**An object wins over a config entry of the same name**: the cluster's declared intent is what
GIE's own picker follows; config covers names with no object and clusters with no CRD. A name in
neither gets ``default_priority``.

The header is chosen by the client, by GIE's design: any client may name any objective, and so
claim its priority. Where that matters, the gateway must strip or set the header (the chart's
``gateway.objectiveHeader: strip``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable


class Objectives:
    """Name → priority. The CRD entries have one writer, the objective watch
    (:meth:`replace` and :meth:`put`/:meth:`remove`, on the event loop); the router reads."""

    def __init__(self, config: Mapping[str, int], default: int = 0) -> None:
        self._config = dict(config)
        self.default = default
        self._crd: dict[str, int] = {}

    def priority(self, name: str) -> int:
        prio = self._crd.get(name)
        if prio is None:
            prio = self._config.get(name, self.default)
        return prio

    def replace(self, crd: Mapping[str, int]) -> None:
        """The full set of objects (a list, or a re-list after 410)."""
        self._crd = dict(crd)

    def put(self, name: str, priority: int) -> None:
        self._crd[name] = priority

    def remove(self, name: str) -> None:
        self._crd.pop(name, None)

    @property
    def from_crd(self) -> Mapping[str, int]:
        return self._crd


@runtime_checkable
class ObjectiveSource(Protocol):
    """A discovery provider that can also feed objective priorities (Kubernetes, pool mode)."""

    def attach_objectives(self, objectives: Objectives) -> None: ...

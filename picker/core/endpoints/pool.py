"""The pool: the one table of live endpoint state that scheduling reads.

Providers replace the endpoint set; listeners (the prefix index, the scraper, telemetry) learn of
additions and removals so that no per-endpoint data outlives its endpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from picker.core.endpoints.types import NOT_ROUTABLE, Endpoint, EndpointState

Listener = Callable[[EndpointState], None]


class Pool:
    def __init__(self) -> None:
        self._states: dict[str, EndpointState] = {}
        self._on_add: list[Listener] = []
        self._on_remove: list[Listener] = []
        self.synced = False
        """True once a provider has pushed its first complete endpoint set (even an empty one):
        the picker's readiness. Written only by :meth:`set_endpoints`."""

    def on_add(self, fn: Listener) -> None:
        self._on_add.append(fn)

    def on_remove(self, fn: Listener) -> None:
        self._on_remove.append(fn)

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        wanted = {ep.key: ep for ep in endpoints}
        self.synced = True
        for key in [k for k in self._states if k not in wanted]:
            state = self._states.pop(key)
            for fn in self._on_remove:
                fn(state)
        for key, ep in wanted.items():
            current = self._states.get(key)
            if current is None:
                state = EndpointState(endpoint=ep)
                self._states[key] = state
                for fn in self._on_add:
                    fn(state)
            elif current.endpoint != ep:  # same ip:port, new name: keep the live state
                current.endpoint = ep

    def get(self, key: str) -> EndpointState | None:
        return self._states.get(key)

    def __iter__(self) -> Iterator[EndpointState]:
        return iter(list(self._states.values()))

    def __len__(self) -> int:
        return len(self._states)

    def routable(self) -> list[EndpointState]:
        return [s for s in self._states.values() if s.health not in NOT_ROUTABLE]  # s.routable, inline

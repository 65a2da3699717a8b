"""One KV-event :class:`~picker.feeds.events.Subscriber` per endpoint of the pool.

The pool's add/remove listeners start and stop them: an endpoint ``ip:port`` is subscribed at
``tcp://ip:{kv_events_port}`` (and replayed from ``tcp://ip:{kv_events_replay_port}`` when that
port is set), the same ports on every replica, as vLLM's ``--kv-events-config`` sets them; an
endpoint on the r-th of ``rank_ports`` (data-parallel rank r's serving port) at those ports + r,
where vLLM's rank r publishes. A
removed endpoint's task is cancelled and its entries forgotten; an endpoint that stops answering
its scrapes (``suspect``) has its entries dropped, as a restarted replica's cache is empty.

``syncs`` (endpoint key → :class:`~picker.core.prefix.precise.Sync`) is the router's view of which
endpoints are routed precisely. Writer of the dict: this class (on pool changes); each ``Sync`` is
written by its own subscriber task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq.asyncio

from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import EndpointState
from picker.core.prefix.precise import PreciseIndex, State, Sync
from picker.feeds.drain import Inbox
from picker.feeds.events import Subscriber

log = logging.getLogger(__name__)


class Subscribers:
    def __init__(
        self,
        index: PreciseIndex,
        syncs: dict[str, Sync],
        port: int,
        replay_port: int = 0,
        topic: str = "",
        refill_s: float = 30.0,
        rank_ports: tuple[int, ...] = (),
        inbox: Inbox | None = None,
    ) -> None:
        assert 0 < port < 65536, f"kv events port must be a TCP port, got {port}"
        self.rank_of = {p: r for r, p in enumerate(rank_ports)}
        self.index, self.syncs, self.port, self.replay_port = index, syncs, port, replay_port
        self.topic, self.refill_s, self.inbox = topic, refill_s, inbox
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ctx: zmq.asyncio.Context | None = None

    def attach(self, pool: Pool) -> None:
        """Subscribe to the pool's endpoints, now and as they come and go. Needs a running loop."""
        self._ctx = zmq.asyncio.Context()
        pool.on_add(self.add)
        pool.on_remove(self.remove)
        for state in pool:
            self.add(state)

    def add(self, state: EndpointState) -> None:
        key = state.key
        if key in self._tasks:
            return
        host = _host(state.endpoint.address)
        rank = self.rank_of.get(state.endpoint.port, 0)
        replay = f"tcp://{host}:{self.replay_port + rank}" if self.replay_port else None
        sub = Subscriber(
            key,
            self.index,
            f"tcp://{host}:{self.port + rank}",
            replay,
            self.topic,
            self.refill_s,
            self._ctx,
            inbox=self.inbox,
        )
        self.syncs[key] = sub.sync
        task = asyncio.get_running_loop().create_task(sub.run(), name=f"kv-events {key}")
        task.add_done_callback(lambda t: _log_end(key, t))
        self._tasks[key] = task

    def suspect(self, key: str) -> None:
        """``key`` stopped answering its scrapes: it may have restarted with an empty cache and a
        new event stream from seq 0. Its entries are dropped and its stream taken afresh (a
        continuing stream then reads as a gap: replayed, or approximate for ``refill_s``)."""
        sync = self.syncs.get(key)
        if sync is None or (sync.state is State.WAITING and sync.expected is None):
            return
        self.index.forget(key)
        sync.state, sync.expected = State.WAITING, None

    def remove(self, state: EndpointState) -> None:
        task = self._tasks.pop(state.key, None)
        if task is not None:
            task.cancel()
        self.syncs.pop(state.key, None)
        self.index.remove(state.key)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._ctx is not None:
            self._ctx.term()


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _log_end(key: str, task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s: KV-event subscriber died: %r", key, task.exception())

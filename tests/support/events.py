"""KV events for tests: a :class:`picker.feeds.events.Subscriber` run as a task over loopback
ZMQ, and a wait for its stream to go quiet."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import zmq.asyncio

from picker.core.prefix.precise import PreciseIndex
from picker.feeds.events import Subscriber


@contextlib.asynccontextmanager
async def subscriber(
    key: str, port: int, replay: int | None, refill_s: float = 30.0
) -> AsyncIterator[Subscriber]:
    """A subscriber for endpoint ``key`` into a fresh :class:`PreciseIndex`, reading the publisher
    on ``port`` and its replay socket on ``replay`` (both 127.0.0.1; ``replay`` None: none), all
    topics, ``refill_s`` as :class:`Subscriber`'s, in its own ZMQ context; its task is cancelled
    and the context closed on exit."""
    ctx = zmq.asyncio.Context()
    replay_url = f"tcp://127.0.0.1:{replay}" if replay is not None else None
    sub = Subscriber(key, PreciseIndex(), f"tcp://127.0.0.1:{port}", replay_url, "", refill_s, ctx)
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ctx.term()


async def quiet(sub: Subscriber, quiet_s: float) -> None:
    """Wait until no KV-event batch arrives for ``quiet_s`` seconds."""
    last = sub.sync.expected
    while True:
        await asyncio.sleep(quiet_s)
        if sub.sync.expected == last:
            return
        last = sub.sync.expected

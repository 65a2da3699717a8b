"""Reading a ZMQ socket from the event loop: one plain callback per wake-up that takes every
message already queued, not one awaited future and task step per message.

The socket's ``ZMQ_FD`` is registered with ``loop.add_reader``. ZMQ signals that descriptor on
an edge (some messages arrived), not while messages are queued, so each wake-up reads with
``NOBLOCK`` until ``zmq.Again``: at most ``max_per_wake`` messages, then the rest in a later
round of the loop (``call_soon``), so a flood cannot starve the loop. Any other operation on the
socket (connect, disconnect) may swallow an edge: call :meth:`Drain.drain` after it.

``take`` handles one message; returning False pauses the reading (the socket queues meanwhile,
up to its high-water mark) until :meth:`Drain.resume`, for a message whose handling must await.

State: ``paused`` and the loop registration, written only by this object's methods, which run
on the loop's thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq

MAX_PER_WAKE = 256


class Drain:
    def __init__(
        self,
        sock: zmq.Socket[bytes],
        take: Callable[[list[bytes]], bool],
        max_per_wake: int = MAX_PER_WAKE,
    ) -> None:
        assert max_per_wake > 0, f"max_per_wake must be positive, got {max_per_wake}"
        self.sock, self.take, self.max_per_wake = sock, take, max_per_wake
        self.paused = False
        self.wakes = 0
        """Callbacks that found at least one message (a counter for the benchmark)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1

    def start(self) -> None:
        """Register with the running loop and take what is queued already."""
        self._loop = asyncio.get_running_loop()
        fd = self.sock.getsockopt(zmq.FD)
        assert isinstance(fd, int), f"ZMQ_FD is an int, got {fd!r}"
        self._fd = fd
        self._loop.add_reader(self._fd, self.drain)
        self.drain()

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None

    def resume(self) -> None:
        self.paused = False
        self.drain()

    def drain(self) -> None:
        """Take the queued messages (see the module doc)."""
        if self.paused or self._loop is None:
            return
        taken = 0
        while taken < self.max_per_wake:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            taken += 1
            if not self.take(frames):
                self.paused = True
                break
        else:
            self._loop.call_soon(self.drain)
        self.wakes += taken > 0

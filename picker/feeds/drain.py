"""Reading the picker's ZMQ sockets (KV events, peer messages) from the event loop: lazily, in
batches, and always before a pick.

:class:`Drain` reads one socket: each call takes every message already queued with ``NOBLOCK``
until ``zmq.Again``, at most ``max_per_wake``; past that the rest is taken in later rounds of the
loop (``call_soon``), so a flood cannot starve the loop. ``take`` handles one message; returning
False pauses the reading (the socket queues meanwhile, up to its high-water mark) until
:meth:`Drain.resume`, for a message whose handling must await; raising drops that message only (logged,
counted in ``failed``): the reading goes on, and a pick that read it is not failed by it. Any other
operation on the socket (connect, disconnect) may swallow an edge of its ``ZMQ_FD``: call
:meth:`Drain.drain` after it.

Who calls :meth:`Drain.drain`:

- without an :class:`Inbox` (tests, tools): the loop, whenever the socket's ``ZMQ_FD`` signals
  (``loop.add_reader``), that is about once per message at moderate rates;
- with an :class:`Inbox` (the picker): the inbox, which is not woken per message. Every socket's
  ``ZMQ_FD`` sits in one selector of its own, whose descriptor the loop watches while no read is
  scheduled. A message that arrives ``interval_s`` or more after the previous read is read at
  once (sparse traffic: one wake-up per message, as without an inbox); one that arrives sooner
  is read ``interval_s`` after the previous read, unwatched meanwhile, and the reads go on on that
  timer while each finds more than one message (dense traffic: one wake-up per interval for all
  sockets together, however many messages). An idle picker is never woken. The router calls
  :meth:`Inbox.catch_up` before every pick: that read is free (the loop is awake anyway) and
  puts the inbox back to watching.

Invariant (the index is exact at pick time): :meth:`Inbox.catch_up` takes from every socket every
message ZMQ had received when it was called, so a pick scores on every KV event and peer message
that reached the picker before it began. The only exceptions: a socket that had more than
``max_per_wake`` queued (a flood: the rest follows in the next loop rounds; counted in
``Inbox.short``) and a paused one (a KV-event gap being replayed). Why reading the selector is
enough: ZMQ signals a socket's ``ZMQ_FD`` when a message reaches a pipe its reader had found
empty, and every read here ends on ``zmq.Again`` (an empty pipe) unless it stops at the cap, in
which case the socket is read again unconditionally (``Drain.behind``).

State: a drain's ``paused``, ``behind`` and registration, written only by its own methods; the
inbox's selector, timer and counters, written only by its methods. All run on the loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import selectors
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)
MAX_PER_WAKE = 256
TRIGGERS = ("pick", "message", "timer")
INTERVAL_S = 0.05
"""Default :attr:`Inbox.interval_s` (``--message-interval``), in seconds. A routing picker reads
before each pick anyway, so the interval bounds only what a non-routing picker's view lags by (its
metrics, a peer's heartbeat: 0.25 s, or a dead replica's outcome: the scrape bound is 0.6 s).
Reads per second at 25 and 50 ms: bench/results/peer_messages.md."""


class Drain:
    def __init__(
        self,
        sock: zmq.Socket[bytes],
        take: Callable[[list[bytes]], bool],
        max_per_wake: int = MAX_PER_WAKE,
        inbox: Inbox | None = None,
    ) -> None:
        assert max_per_wake > 0, f"max_per_wake must be positive, got {max_per_wake}"
        self.sock, self.take, self.max_per_wake, self.inbox = sock, take, max_per_wake, inbox
        self.paused = False
        self.behind = False
        """The last read stopped at ``max_per_wake`` with messages left."""
        self.wakes = 0
        """Reads that found at least one message (a counter for the benchmark)."""
        self.failed = 0
        """Messages whose ``take`` raised (logged and dropped)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fd = -1

    def start(self) -> None:
        """Register with the inbox (or the running loop) and take what is queued already."""
        self._loop = asyncio.get_running_loop()
        fd = self.sock.getsockopt(zmq.FD)
        assert isinstance(fd, int), f"ZMQ_FD is an int, got {fd!r}"
        self.fd = fd
        if self.inbox is not None:
            self.inbox.add(self)
        else:
            self._loop.add_reader(self.fd, self.drain)
        self.drain()

    def stop(self) -> None:
        if self._loop is not None:
            if self.inbox is not None:
                self.inbox.remove(self)
            else:
                self._loop.remove_reader(self.fd)
            self._loop = None

    def resume(self) -> None:
        self.paused = False
        self.drain()

    def drain(self) -> int:
        """Take the queued messages (see the module doc). Returns how many."""
        if self.paused or self._loop is None:
            return 0
        taken = 0
        self.behind = False
        while taken < self.max_per_wake:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            taken += 1
            try:
                keep_on = self.take(frames)
            except Exception:  # a handler's bug: that message is lost, never the reading or a pick
                self.failed += 1
                log.exception("a received message could not be handled; dropped")
                continue
            if not keep_on:
                self.paused = True
                break
        else:
            self.behind = True
            self._loop.call_soon(self.drain)
        self.wakes += taken > 0
        return taken


class Inbox:
    """Reads its drains' sockets before each pick and otherwise at most every ``interval_s``
    (module doc). Use from the loop's thread only; :meth:`start` before the first pick."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        assert interval_s > 0, f"the inbox interval must be positive, got {interval_s}"
        self.interval_s = interval_s
        self._sel = selectors.DefaultSelector()
        self._drains: set[Drain] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watching = False
        self._timer: asyncio.TimerHandle | None = None
        self._last = float("-inf")
        self._stopped = False
        """Set by :meth:`stop`: later catch-ups (a pick still finishing at shutdown) read nothing."""
        self.reads = dict.fromkeys(TRIGGERS, 0)
        """Reads of every socket, by what started them: ``pick`` (:meth:`catch_up`), ``message``
        (one arrived after a quiet interval) or ``timer`` (dense traffic)."""
        self.messages = 0
        """Messages those reads took."""
        self.woken = 0
        """Times the loop was woken because a message arrived while nothing was pending."""
        self.short = 0
        """Reads that left a socket behind (more than ``max_per_wake`` queued: a flood)."""

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._watch()

    def stop(self) -> None:
        if self._loop is not None:
            if self._watching:
                self._loop.remove_reader(self._sel.fileno())
            if self._timer is not None:
                self._timer.cancel()
            self._watching, self._timer, self._loop = False, None, None
        self._stopped = True
        self._sel.close()

    def add(self, drain: Drain) -> None:
        self._sel.register(drain.fd, selectors.EVENT_READ, drain)
        self._drains.add(drain)

    def remove(self, drain: Drain) -> None:
        self._drains.discard(drain)
        registered = self._sel.get_map()
        if registered is not None and drain.fd in registered:  # None: the inbox was stopped
            self._sel.unregister(drain.fd)

    def catch_up(self, trigger: str = "pick") -> None:
        """Take every message the sockets hold now (the module doc's invariant); nothing once
        stopped."""
        if self._stopped:
            return
        self._read(trigger)
        self._watch()

    def _read(self, trigger: str) -> int:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        ready: set[Drain] = {key.data for key, _ in self._sel.select(0)}
        ready.update(d for d in self._drains if d.behind)  # ZMQ signals no new edge for those
        taken = sum(drain.drain() for drain in ready)
        self.short += any(d.behind for d in ready)
        self.reads[trigger] += 1
        self.messages += taken
        if self._loop is not None:
            self._last = self._loop.time()
        return taken

    def _watch(self) -> None:
        if self._loop is not None and not self._watching:
            self._loop.add_reader(self._sel.fileno(), self._woken)
            self._watching = True

    def _woken(self) -> None:
        """A message arrived while the sockets were watched. Sparse traffic (the last read is
        ``interval_s`` old): read now and watch again, one wake-up per message. Dense: read
        ``interval_s`` after the last read, unwatched meanwhile, and keep reading on that timer
        while each read finds more than one message (:meth:`_tick`): one wake-up per interval."""
        assert self._loop is not None, "woken before start"
        self._loop.remove_reader(self._sel.fileno())
        self._watching = False
        self.woken += 1
        due = self._last + self.interval_s
        if self._loop.time() >= due:
            self.catch_up("message")
        else:
            self._timer = self._loop.call_at(due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None, "a timer after stop"
        self._timer = None
        if self._read("timer") > 1:  # batching paid: stay on the timer (one message: a wake-up each)
            self._timer = self._loop.call_later(self.interval_s, self._tick)
        else:
            self._watch()

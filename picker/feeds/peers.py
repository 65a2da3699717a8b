"""Picker replicas tell each other their picks, so their indexes agree between KV events.

Every replica's KV-event subscribers give it the same confirmed index; what differs between
replicas is what each has just sent and the replicas have not yet reported: the speculative
entries (precise mode) and, in approximate mode, the whole index. Each replica therefore
publishes each pick (endpoint, the prompt's KV-block keys, its text-block hashes) on a ZMQ PUB
socket, and subscribes to every other replica's: a peer's pick is recorded as if it were its own
(a speculative entry; an approximate-index entry).

They also report their in-flight work, per endpoint: the requests each has in flight there and
their pending prefill tokens. Every pick carries its sender's report (taken after the pick is
charged), and every ``load_interval_s`` (50 ms) each picker sends a report of its own only when its
work changed since the last report it sent (a request finished), or ``load_heartbeat_s`` (0.25 s)
after it: a busy picker sends about one message per pick and per finish, and an idle one 4 a
second. Only a picker with work in flight looks every 50 ms; one without wakes for its heartbeats. A receiver sums
the latest report of every peer heard from in the last ``load_ttl_s`` (1 s: a dead peer's load
fades) into ``EndpointState.peer_load``, which
the cost scorer and the load guard add to the picker's own.

Wire: ZMQ PUB, multipart ``[b"pick", msgpack([sender id, endpoint key, keys, hashes, report])]``
(``report`` optional: a 4-element pick from an older picker is taken without it; an older picker
drops a 5-element one, so during a rolling upgrade peers miss each other's picks, not KV events) and
``[b"load", msgpack([sender id, report])]``, ``report`` being
``{endpoint key: [requests, pending prefill tokens]}``. A pick
names an endpoint of the receiver's pool and at most ``MAX_BLOCKS`` keys and hashes of 60-bit
ints, or it is dropped (counted in ``bad``).

Smaller picks: the leading keys that the chosen endpoint already holds by its KV events are left
out, since every peer has them from the same events (in precise mode, with a shared prefix, that is
most of a prompt: 64 of 68 keys on the shared-prefix benchmark). Such a pick goes on its own topic,
``[b"tail", msgpack([sender id, endpoint key, skipped, keys after the skipped, hashes, report])]``
(``skipped`` > 0); a pick that skips nothing is sent as ``pick`` above. The receiver records the
keys it is given as speculative entries, as for a whole pick: the skipped ones it holds confirmed
already, or will as soon as it reads the same events (a pick is sent after the events it relies on
reached the sender; a peer reading them a moment later can under-count that endpoint's prefix in
between, never over-count it). Mixed versions: a picker older than this does not subscribe to
``tail`` (the topic does not start with ``pick`` or ``load``, its filters), so it never mis-reads
one: it misses the picks that skip keys, as it would have missed a newer format anyway. Our SUB sockets connect out to the configured peer
addresses only, so a pod that can reach our port cannot inject picks: it would have to be a peer.
Sending never blocks (PUB drops at its high-water mark).

They also share the scraping of the replicas' ``/metrics`` (:class:`~picker.feeds.scrape.ScrapeShare`):
each endpoint is scraped by one picker, its owner by rendezvous hashing (the highest
``xxh64(ident|endpoint)``) over this picker and the peers heard sharing scrapes in the last
``share_ttl_s`` (1 s), and the owner sends every outcome (the metrics the router reads, or the
failure) to the others, batched for ``share_flush_s`` (20 ms, one message per scrape round), or
an empty batch ``load_heartbeat_s`` after its last: the heartbeat that keeps it an owner. A peer
silent for ``share_ttl_s`` is dropped, and the endpoints it owned are scraped at once by their
next owners. Alone, a picker owns every endpoint and scrapes as without peers.

Wire, scrapes: ``[b"scrape", msgpack([sender id, [[endpoint key, age s, reason, metrics], ...]])]``,
``metrics`` being :func:`~picker.feeds.scrape.metrics_to_wire`'s list (``None`` for a failed scrape,
``reason`` then naming the failure; ``""`` otherwise) and ``age`` the seconds between the scrape and
the send (the receiver dates it by its own clock). Mixed versions: a picker older than this
subscribes to ``pick`` and ``load`` only, so the publisher filters ``scrape`` out before sending it
any; it never sends one either, so the newer pickers never count it as an owner: it scrapes every
endpoint itself, and they split the scrapes among themselves. A malformed batch is dropped whole.
A peer's outcome can take an endpoint out of routing: peers are trusted as for picks (only the
configured addresses are subscribed to).

Receiving: every message queued when the socket is read is taken in one event-loop callback
(:class:`~picker.feeds.drain.Drain`), not a task step each; with an inbox (the picker's), the socket
is read before each pick and otherwise at most every ``interval_s``, not woken per message.

Discovery: the static ``peers`` addresses, plus, with ``peer_dns`` (``host:port``, e.g. a headless
Service naming every picker pod), whatever that name resolves to, re-resolved every
``dns_interval_s`` (5 s): a new address is connected, a vanished one disconnected, so a restarted or
added picker pod (a new IP) is heard within one interval and scaling needs no restart. Our own
address may be among them: our own messages are recognised by ``ident`` and skipped.

State: ``bad`` / ``received`` / ``picks`` / ``own`` / ``skipped`` counters, ``_loads`` (peer → (heard at, report)),
``_sharers`` (peer → heard at, the scrape owners) and ``discovered`` (addresses connected through
``peer_dns``), written by :meth:`run` and its tasks only; ``_pending`` (our outcomes not sent yet),
written by :meth:`share` and emptied by :meth:`flush_scrapes`; the ``peer_load`` of the pool's
endpoint states, written only here. Peers' scrape outcomes are handed to the
:class:`~picker.feeds.scrape.Scraper`, the one writer of the endpoints' metrics and health.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgpack
import xxhash
import zmq

from picker.core.router import Router
from picker.feeds.drain import Drain, Inbox
from picker.feeds.scrape import Outcome, Scraper, metrics_from_wire, metrics_to_wire

log = logging.getLogger(__name__)
TOPIC = b"pick"
TAIL = b"tail"
"""Topic of picks without the chosen endpoint's confirmed leading keys (module doc); like
``SCRAPE``, it must not start with ``pick`` or ``load``."""
LOAD = b"load"
SCRAPE = b"scrape"
"""Topic of shared scrapes: it must not start with ``pick`` or ``load``, which older pickers
subscribe to (a SUB filter matches a prefix)."""
MAX_SHARED = 4096
"""Outcomes in one shared-scrape batch; more and the batch is dropped."""
MAX_IDENT = 256
MAX_AGE_S = 60.0
MAX_BLOCKS = 1 << 16
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
_INT60 = (1 << 60) - 1
Resolver = Callable[[str], Awaitable[set[str]]]


async def resolve(host: str) -> set[str]:
    """Every IPv4/IPv6 address ``host`` names (the event loop's getaddrinfo: a worker thread)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return {str(info[4][0]) for info in infos}


def zmq_address(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


class Peers:
    def __init__(
        self,
        router: Router,
        bind: str,
        peers: Sequence[str],
        ident: str = "",
        clock: Callable[[], float] = time.monotonic,
        load_interval_s: float = 0.05,
        load_ttl_s: float = 1.0,
        load_heartbeat_s: float = 0.25,
        peer_dns: str = "",
        dns_interval_s: float = 5.0,
        resolver: Resolver = resolve,
        share_ttl_s: float = 1.0,
        share_flush_s: float = 0.02,
        inbox: Inbox | None = None,
        scraper: Scraper | None = None,
    ) -> None:
        self.router, self.peers, self.clock, self.inbox = router, list(peers), clock, inbox
        self.peer_dns, self.dns_interval_s, self.resolver = peer_dns, dns_interval_s, resolver
        if peer_dns:
            host, _, port = peer_dns.rpartition(":")
            if not (host and port.isdigit()):
                raise ValueError(f"peer DNS name must be host:port, got {peer_dns!r}")
        self.discovered: set[str] = set()
        assert 0 < load_heartbeat_s < load_ttl_s, (
            f"load heartbeat {load_heartbeat_s} s must be shorter than the load TTL {load_ttl_s} s, or idle peers fade"
        )
        self.load_interval_s, self.load_ttl_s, self.load_heartbeat_s = (
            load_interval_s,
            load_ttl_s,
            load_heartbeat_s,
        )
        self._last_report: tuple[float, dict[str, list[int]]] | None = None
        """(sent at, report) of our last load report; written by :meth:`publish_load` and
        :meth:`publish` only."""
        self._hurry: asyncio.Future[None] | None = None
        """What :meth:`_report_loads` waits on (its timer, or a pick: :meth:`publish`)."""
        self._idle_pace = False
        """Whether that wait is longer than ``load_interval_s`` (no work was in flight)."""
        self._loads: dict[str, tuple[float, dict[str, list[int]]]] = {}
        assert load_heartbeat_s < share_ttl_s, (
            f"the heartbeat {load_heartbeat_s} s must be shorter than the share TTL {share_ttl_s} s, "
            "or live owners are dropped"
        )
        self.share_ttl_s, self.share_flush_s = share_ttl_s, share_flush_s
        self.scraper = scraper
        """With it, the scrapes are shared (module doc): this channel registers as its
        :class:`~picker.feeds.scrape.ScrapeShare` (:meth:`Scraper.share_with`) and applies the
        peers' outcomes to it; without, none are shared."""
        self._sharers: dict[str, float] = {}
        self._pending: dict[str, tuple[Outcome, float]] = {}
        self._flush_at: asyncio.TimerHandle | None = None
        self._shared_at = float("-inf")
        """When our last scrape batch (or heartbeat) went out."""
        self.ident = ident or f"{os.getpid()}-{os.urandom(4).hex()}"
        self._ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)
        for address in bind.split(","):  # e.g. a pod-wide tcp address and a worker's ipc one
            self._pub.bind(address)
        self.received = 0
        self.picks = 0
        self.own = 0
        self.bad = 0
        self.skipped = 0
        """Keys our picks left out, the endpoint holding them by its events (module doc)."""
        router.add_pick_listener(self.publish)
        if scraper is not None:
            scraper.share_with(self)

    def publish(self, endpoint: str, keys: Sequence[int] | None, hashes: Sequence[int]) -> None:
        """Tell the peers about one pick, with our load report (non-blocking; dropped if the socket
        is full)."""
        report = self._report()
        self._last_report = (self.clock(), report)
        keys = keys or ()
        skip = self.router.confirmed_depth(endpoint, keys)
        if skip:
            topic = TAIL
            body = msgpack.packb(
                [self.ident, endpoint, skip, list(keys[skip:]), list(hashes), report], use_bin_type=True
            )
        else:
            topic = TOPIC
            body = msgpack.packb([self.ident, endpoint, list(keys), list(hashes), report], use_bin_type=True)
        self.skipped += skip
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([topic, body], flags=zmq.NOBLOCK)
        if self._idle_pace and self._hurry is not None and not self._hurry.done():
            self._hurry.set_result(None)  # work in flight now: reports at its pace

    def apply(self, body: bytes) -> bool:
        """Record one peer pick. Returns False for a malformed or foreign one (dropped)."""
        try:
            ident, endpoint, keys, hashes, *rest = msgpack.unpackb(body, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            log.debug("bad peer message: %s", exc)
            return False
        return self._record(ident, endpoint, keys, hashes, rest)

    def apply_tail(self, body: bytes) -> bool:
        """Record one peer pick that left out its endpoint's confirmed leading keys (module doc).
        Returns False for a malformed or foreign one (dropped)."""
        try:
            ident, endpoint, skipped, keys, hashes, report = msgpack.unpackb(body, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            log.debug("bad peer message: %s", exc)
            return False
        if not (type(skipped) is int and 0 < skipped <= MAX_BLOCKS):
            return False
        return self._record(ident, endpoint, keys, hashes, [report])

    def _record(self, ident: Any, endpoint: Any, keys: Any, hashes: Any, rest: list[Any]) -> bool:
        """A pick's checks and entries (``rest``: its load report, if any)."""
        if ident == self.ident:  # our own, heard back through the peer name
            self.own += 1
            return True
        if not (isinstance(endpoint, str) and self.router.pool.get(endpoint) is not None):
            return False
        if not (_ints(keys) and _ints(hashes)) or len(rest) > 1:
            return False
        if rest and not self._take_load(ident, rest[0]):
            return False
        self.router.record_remote_pick(endpoint, keys, hashes)
        return True

    # --- shared scrapes ------------------------------------------------------------------
    def owns(self, key: str) -> bool:
        """Whether we scrape ``key``: the highest rendezvous score among the live sharers and us."""
        if self.scraper is None or not self._sharers:
            return True
        mine = xxhash.xxh64_intdigest(f"{self.ident}|{key}".encode())
        return all(xxhash.xxh64_intdigest(f"{i}|{key}".encode()) < mine for i in self._sharers)

    def sharers(self) -> list[str]:
        """The peers we split the scrapes with (not us)."""
        return sorted(self._sharers)

    def share(self, key: str, outcome: Outcome, scraped_at: float) -> None:
        """Queue one of our scrapes for the peers; a batch goes out ``share_flush_s`` after its
        first outcome (the other endpoints' scrapes of the same round join it)."""
        self._pending[key] = (outcome, scraped_at)
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(self.share_flush_s, self.flush_scrapes)

    def flush_scrapes(self) -> None:
        """Send the queued outcomes (possibly none: a heartbeat), non-blocking."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        now = self.clock()
        entries = [
            [key, max(0.0, now - at), o.reason, None if o.metrics is None else metrics_to_wire(o.metrics)]
            for key, (o, at) in self._pending.items()
        ]
        self._pending.clear()
        self._shared_at = now
        body = msgpack.packb([self.ident, entries], use_bin_type=True)
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([SCRAPE, body], flags=zmq.NOBLOCK)

    def apply_scrapes(self, body: bytes) -> bool:
        """Take one peer's batch of scrape outcomes (all, or none if any is malformed)."""
        try:
            ident, entries = msgpack.unpackb(body, raw=False)
            if not (isinstance(ident, str) and len(ident) <= MAX_IDENT):
                raise ValueError("sender id is not a short string")
            if not (isinstance(entries, list) and len(entries) <= MAX_SHARED):
                raise ValueError("outcomes are not a bounded list")
            if ident == self.ident:
                self.own += 1
                return True
            outcomes = [_outcome(e) for e in entries]
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            log.debug("bad shared scrape: %s", exc)
            return False
        now = self.clock()
        self._sharers[ident] = now
        if self.scraper is not None:
            for key, age, outcome in outcomes:
                self.scraper.apply_remote(key, outcome, now - age)
        return True

    def _expire_sharers(self, now: float) -> None:
        gone = [i for i, t in self._sharers.items() if now - t > self.share_ttl_s]
        for ident in gone:
            del self._sharers[ident]
            log.info("peer picker %s silent for %.1f s: its scrapes are taken over", ident, self.share_ttl_s)
        if gone and self.scraper is not None:
            self.scraper.rebalance()

    def _report(self) -> dict[str, list[int]]:
        return {
            s.key: [s.load.in_flight_requests, s.load.pending_prefill_tokens]
            for s in self.router.pool
            if s.load.in_flight_requests or s.load.pending_prefill_tokens
        }

    def publish_load(self) -> bool:
        """Report this picker's own in-flight work per endpoint (non-blocking), if it changed since
        the last report sent (alone or with a pick) or that is ``load_heartbeat_s`` old. Returns
        whether a report was sent."""
        report = self._report()
        now, last = self.clock(), self._last_report
        if last is not None and last[1] == report and now - last[0] < self.load_heartbeat_s:
            return False
        self._last_report = (now, report)
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([LOAD, msgpack.packb([self.ident, report])], flags=zmq.NOBLOCK)
        return True

    def apply_load(self, body: bytes) -> bool:
        """Take one peer's load report. Returns False for a malformed one (dropped)."""
        try:
            ident, report = msgpack.unpackb(body, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException):
            return False
        return ident == self.ident or self._take_load(ident, report)

    def _take_load(self, ident: Any, report: Any) -> bool:
        """Store a peer's report (``False``, nothing stored, if it is malformed)."""
        if (
            not (isinstance(ident, str) and isinstance(report, dict))
            or len(report) > len(self.router.pool) + 1
        ):
            return False
        clean: dict[str, list[int]] = {}
        for key, v in report.items():
            if not (isinstance(key, str) and isinstance(v, list) and len(v) == 2 and _ints(v)):
                return False
            clean[key] = v
        self._loads[ident] = (self.clock(), clean)
        self.refresh_loads()
        return True

    def refresh_loads(self) -> None:
        """Sum the live peers' reports into the endpoint states (dead peers' reports dropped)."""
        now = self.clock()
        for ident in [i for i, (t, _) in self._loads.items() if now - t > self.load_ttl_s]:
            del self._loads[ident]
        reqs: dict[str, int] = {}
        pending: dict[str, int] = {}
        for _, report in self._loads.values():
            for key, (r, p) in report.items():
                reqs[key] = reqs.get(key, 0) + r
                pending[key] = pending.get(key, 0) + p
        for s in self.router.pool:
            s.peer_load.in_flight_requests = reqs.get(s.key, 0)
            s.peer_load.pending_prefill_tokens = pending.get(s.key, 0)

    async def _report_loads(self) -> None:
        """Send our load reports and heartbeats, and expire silent peers (module doc), until
        cancelled: every ``load_interval_s`` while we have work in flight, else only when a
        heartbeat is due (an idle picker is not woken 20 times a second for nothing)."""
        loop = asyncio.get_running_loop()
        while True:
            self.publish_load()
            self.refresh_loads()
            if self.scraper is not None:
                now = self.clock()
                self._expire_sharers(now)
                if now - self._shared_at >= self.load_heartbeat_s and self._flush_at is None:
                    self.flush_scrapes()
            self._hurry = loop.create_future()
            pause = self._next_report_s()
            self._idle_pace = pause > self.load_interval_s
            timer = loop.call_later(pause, _resolve, self._hurry)
            try:
                await self._hurry
            finally:
                timer.cancel()

    def _next_report_s(self) -> float:
        """Seconds until :meth:`_report_loads` must look again: ``load_interval_s`` while our last
        report had work in it, else until the next heartbeat (load or scrapes) or expiry is due."""
        last = self._last_report
        if last is None or last[1]:
            return self.load_interval_s
        now = self.clock()
        due = last[0] + self.load_heartbeat_s - now
        if self.scraper is not None:
            due = min(due, self._shared_at + self.load_heartbeat_s - now)
        if self._sharers:  # a silent owner is dropped on time, not up to a heartbeat late
            due = min(due, min(self._sharers.values()) + self.share_ttl_s - now)
        if self._loads:  # as is a dead peer's load
            due = min(due, min(t for t, _ in self._loads.values()) + self.load_ttl_s - now)
        return max(self.load_interval_s, due)

    async def _discover(self, sub: zmq.Socket[bytes], drain: Drain) -> None:
        """Keep ``sub`` connected to every address ``peer_dns`` resolves to (module doc)."""
        host, _, port = self.peer_dns.rpartition(":")
        while True:
            try:
                now = {zmq_address(ip, int(port)) for ip in await self.resolver(host.strip("[]"))}
            except OSError as exc:  # NXDOMAIN while no picker pod is ready yet: keep what we have
                log.debug("peer DNS %s: %s", host, exc)
            else:
                for address in sorted(now - self.discovered - set(self.peers)):
                    sub.connect(address)
                for address in sorted(self.discovered - now):
                    with contextlib.suppress(zmq.ZMQError):
                        sub.disconnect(address)
                if now != self.discovered:
                    log.info("peer pickers via %s: %s", self.peer_dns, ", ".join(sorted(now)) or "none")
                self.discovered = now - set(self.peers)
                drain.drain()  # (dis)connecting may have swallowed the socket's edge
            await asyncio.sleep(self.dns_interval_s)

    def take(self, frames: list[bytes]) -> bool:
        """Handle one received message (counted in ``received``, and ``bad`` if dropped)."""
        if len(frames) != 2:
            ok = False
        elif frames[0] == LOAD:
            ok = self.apply_load(frames[1])
        elif frames[0] == SCRAPE:
            ok = self.apply_scrapes(frames[1])
        else:
            own = self.own
            ok = self.apply_tail(frames[1]) if frames[0] == TAIL else self.apply(frames[1])
            self.picks += ok and self.own == own
        self.received += 1
        self.bad += not ok
        return True

    async def run(self) -> None:
        """Receive from the peers (every message queued at a wake-up in one callback:
        :class:`~picker.feeds.drain.Drain`) and send our load reports, until cancelled."""
        sub: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.setsockopt(zmq.SUBSCRIBE, TAIL)
        sub.setsockopt(zmq.SUBSCRIBE, LOAD)
        sub.setsockopt(zmq.SUBSCRIBE, SCRAPE)
        for p in self.peers:
            sub.connect(p)
        drain = Drain(sub, self.take, inbox=self.inbox)
        drain.start()
        helpers = [asyncio.create_task(self._report_loads())]
        if self.peer_dns:
            helpers.append(asyncio.create_task(self._discover(sub, drain)))
        try:
            await asyncio.gather(*helpers)
        finally:
            drain.stop()
            for task in helpers:
                task.cancel()
            sub.close(linger=0)

    def close(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
        self._pub.close(linger=0)
        self._ctx.term()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _ints(xs: Any) -> bool:
    return (
        isinstance(xs, list)
        and len(xs) <= MAX_BLOCKS
        and all(isinstance(x, int) and 0 <= x <= _INT60 for x in xs)
    )


def _outcome(entry: Any) -> tuple[str, float, Outcome]:
    """One ``[endpoint key, age s, reason, metrics]`` of a shared batch, checked (``ValueError``)."""
    if not (isinstance(entry, list) and len(entry) == 4):
        raise ValueError("an outcome is not [key, age, reason, metrics]")
    key, age, reason, raw = entry
    if not (isinstance(key, str) and len(key) <= MAX_IDENT):
        raise ValueError("endpoint key is not a short string")
    if not (type(age) in (int, float) and 0 <= age <= MAX_AGE_S):
        raise ValueError(f"age is not 0..{MAX_AGE_S} s")
    if not (isinstance(reason, str) and len(reason) <= MAX_IDENT and (raw is None) == bool(reason)):
        raise ValueError("a failed scrape names its reason, a successful one none")
    return key, float(age), Outcome(None if raw is None else metrics_from_wire(raw), reason)

"""Picker replicas tell each other their picks, so their indexes agree between KV events.

Every replica's KV-event subscribers give it the same confirmed index; what differs between
replicas is what each has just sent and the replicas have not yet reported: the speculative
entries (precise mode) and, in approximate mode, the whole index. Each replica therefore
publishes each pick (endpoint, the prompt's KV-block keys, its text-block hashes) on a ZMQ PUB
socket, and subscribes to every other replica's: a peer's pick is recorded as if it were its own
(a speculative entry; an approximate-index entry).

Wire: ZMQ PUB, multipart ``[b"pick", msgpack([sender id, endpoint key, keys, hashes])]``. A pick
names an endpoint of the receiver's pool and at most ``MAX_BLOCKS`` keys and hashes of 60-bit
ints, or it is dropped (counted in ``bad``). Our SUB sockets connect out to the configured peer
addresses only, so a pod that can reach our port cannot inject picks: it would have to be a peer.
Sending never blocks (PUB drops at its high-water mark).

State: ``bad`` / ``received`` counters, written by :meth:`run` only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from picker.router import Router

log = logging.getLogger(__name__)
TOPIC = b"pick"
MAX_BLOCKS = 1 << 16
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
_INT60 = (1 << 60) - 1


class Peers:
    def __init__(
        self,
        router: Router,
        bind: str,
        peers: Sequence[str],
        ident: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router, self.peers, self.clock = router, list(peers), clock
        self.ident = ident or f"{os.getpid()}-{os.urandom(4).hex()}"
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)
        self._pub.bind(bind)
        self.received = 0
        self.bad = 0
        router.on_pick = self.publish

    def publish(self, endpoint: str, keys: Sequence[int] | None, hashes: Sequence[int]) -> None:
        """Tell the peers about one pick (non-blocking; dropped if the socket is full)."""
        body = msgpack.packb([self.ident, endpoint, list(keys or ()), list(hashes)], use_bin_type=True)
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([TOPIC, body], flags=zmq.NOBLOCK)

    def apply(self, body: bytes) -> bool:
        """Record one peer pick. Returns False for a malformed or foreign one (dropped)."""
        try:
            ident, endpoint, keys, hashes = msgpack.unpackb(body, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            log.debug("bad peer message: %s", exc)
            return False
        if ident == self.ident:
            return True
        if not (isinstance(endpoint, str) and self.router.pool.get(endpoint) is not None):
            return False
        if not (_ints(keys) and _ints(hashes)):
            return False
        if keys and self.router.precise is not None:
            self.router.precise.speculate(endpoint, keys, self.clock())
        if hashes:
            self.router.index.record(endpoint, hashes)
        return True

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        for p in self.peers:
            sub.connect(p)
        try:
            while True:
                frames = await sub.recv_multipart()
                ok = len(frames) == 2 and self.apply(frames[1])
                self.received += 1
                self.bad += not ok
        finally:
            sub.close(linger=0)

    def close(self) -> None:
        self._pub.close(linger=0)
        self._ctx.term()


def _ints(xs: Any) -> bool:
    return (
        isinstance(xs, list)
        and len(xs) <= MAX_BLOCKS
        and all(isinstance(x, int) and 0 <= x <= _INT60 for x in xs)
    )

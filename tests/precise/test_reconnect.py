"""A KV-event subscriber whose publisher is not there backs off its reconnects (ZMQ's
``RECONNECT_IVL_MAX``), and still connects once the publisher comes up."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvlaunch import free_port
from picker.feeds import events
from tests.support.events import subscriber

pytestmark = pytest.mark.precise


async def retries_over(seconds: float) -> int:
    """Connection attempts a subscriber makes in ``seconds`` to a loopback port nobody listens on,
    counted by a ZMQ monitor on its socket (``EVENT_CONNECT_RETRIED``)."""
    async with subscriber("k", free_port(), None) as sub:
        while sub._drain is None:
            await asyncio.sleep(0.001)
        # a socket of the subscriber's context, so an asyncio one whatever the stubs say
        mon = cast(zmq.asyncio.Socket, sub._drain.sock.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED))
        await asyncio.sleep(seconds)
        n = 0
        while await mon.poll(0):
            await mon.recv_multipart()
            n += 1
        mon.close(linger=0)
        return n


async def test_reconnects_to_an_absent_publisher_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # ZMQ's own 100 ms retry, for ever: 25 to 40 attempts in 4 s here (the check that this counts them)
    monkeypatch.setattr(events, "RECONNECT_IVL_MAX_MS", 0)
    fixed = await retries_over(4.0)
    monkeypatch.undo()
    # doubling from 100 ms up to 1 s: at 0.1, 0.3, 0.7, 1.5, 2.5, 3.5 s
    backed_off = await retries_over(4.0)
    assert fixed >= 15, f"{fixed} retries at ZMQ's fixed 100 ms interval"
    assert backed_off <= 8, f"{backed_off} retries in 4 s with the back-off (about 6 expected)"


async def test_a_publisher_that_comes_up_late_is_connected_within_the_cap() -> None:
    """The subscriber has been retrying for 3 s (its interval at the 1 s cap) when the publisher
    binds; a batch published the cap plus 0.5 s later (the handshake) reaches it."""
    port = free_port()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    stored = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
    }
    try:
        async with subscriber("k", port, None) as sub:
            await asyncio.sleep(3.0)
            pub.bind(f"tcp://127.0.0.1:{port}")
            await asyncio.sleep(events.RECONNECT_IVL_MAX_MS / 1000 + 0.5)
            await pub.send_multipart([b"", (0).to_bytes(8, "big"), msgpack.packb([time.time(), [stored]])])
            deadline = time.monotonic() + 5.0
            while sub.sync.expected != 1:
                assert time.monotonic() < deadline, "the batch never arrived: the subscriber is not connected"
                await asyncio.sleep(0.02)
    finally:
        pub.close(linger=0)
        ctx.term()

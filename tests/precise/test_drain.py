"""``picker.feeds.drain.Inbox`` on real ZMQ sockets over loopback TCP: not woken per message, every
message queued before :meth:`~picker.feeds.drain.Inbox.catch_up` taken by it, the timer's bound
when nothing picks, an idle inbox never woken, and a flood still read in slices."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import zmq

from kvlaunch import free_port
from picker.feeds.drain import Drain, Inbox

pytestmark = pytest.mark.precise


@asynccontextmanager
async def wired(interval_s: float, max_per_wake: int = 256) -> AsyncIterator[tuple[zmq.Socket[bytes], Inbox, list[bytes]]]:  # fmt: skip
    """A PUB socket, and an inbox reading its SUB socket into a list."""
    ctx = zmq.Context()
    url = f"tcp://127.0.0.1:{free_port()}"
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    pub.bind(url)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(url)
    got: list[bytes] = []
    inbox = Inbox(interval_s)
    inbox.start()
    drain = Drain(sub, lambda frames: got.append(frames[0]) is None, max_per_wake, inbox)
    drain.start()
    try:
        while not got:  # the slow joiner: until the subscription reached the publisher
            pub.send(b"hello")
            await asyncio.sleep(0.05)
            inbox.catch_up()
        await asyncio.sleep(0.05)
        inbox.catch_up()
        got.clear()
        yield pub, inbox, got
    finally:
        drain.stop()
        inbox.stop()
        for s in (pub, sub):
            s.close(linger=0)
        ctx.term()


async def test_catch_up_takes_what_arrived_and_the_loop_is_not_woken_per_message() -> None:
    async with wired(interval_s=30.0) as (pub, inbox, got):
        woken = inbox.woken
        for i in range(20):
            pub.send(b"%d" % i)
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        assert got == [], "read before the timer or a pick"
        assert inbox.woken - woken <= 1, "woken more than once for 20 messages"
        inbox.catch_up()
        assert got == [b"%d" % i for i in range(20)]


async def test_the_timer_reads_within_its_interval_when_nothing_picks() -> None:
    async with wired(interval_s=0.05) as (pub, _inbox, got):
        await asyncio.sleep(0.1)  # the last read is older than the interval
        t0 = time.monotonic()
        pub.send(b"x")
        while not got:
            assert time.monotonic() - t0 < 1.0, "not read within 1 s"
            await asyncio.sleep(0.002)
        pub.send(b"y")  # right after a read: waits for the interval
        t1 = time.monotonic()
        while len(got) < 2:
            assert time.monotonic() - t1 < 1.0, "not read within 1 s"
            await asyncio.sleep(0.002)
        assert time.monotonic() - t1 >= 0.03, "read sooner than the interval after the last read"


async def test_an_idle_inbox_is_not_woken() -> None:
    async with wired(interval_s=0.01) as (_, inbox, _got):
        woken, reads = inbox.woken, sum(inbox.reads.values())
        await asyncio.sleep(0.3)
        assert (inbox.woken, sum(inbox.reads.values())) == (woken, reads)


async def test_a_flood_is_read_in_slices_and_counted() -> None:
    async with wired(interval_s=30.0, max_per_wake=8) as (pub, inbox, got):
        for i in range(100):
            pub.send(b"%d" % i)
        await asyncio.sleep(0.1)
        inbox.catch_up()
        assert len(got) == 8 and inbox.short == 1, (len(got), inbox.short)
        await asyncio.sleep(0.05)  # the rest in later rounds of the loop
        assert got == [b"%d" % i for i in range(100)]


async def test_a_message_whose_handling_raises_is_dropped_alone() -> None:
    """A handler's bug loses that message, not the ones after it nor the pick that read them."""
    async with wired(interval_s=30.0) as (pub, inbox, got):
        (drain,) = inbox._drains
        take = drain.take

        def fragile(frames: list[bytes]) -> bool:
            if frames[0] == b"boom":
                raise KeyError("a bug")
            return take(frames)

        drain.take = fragile
        for body in (b"1", b"boom", b"2"):
            pub.send(body)
        await asyncio.sleep(0.1)
        inbox.catch_up()
        assert got == [b"1", b"2"] and drain.failed == 1

"""Picker replicas sharing their picks over ZMQ (``picker.feeds.peers``): two in-process routers, real
sockets on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest
import zmq

from kvlaunch import free_port
from picker.core.config import PrefixConfig, RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint
from picker.core.prefix.precise import State, Sync
from picker.core.request import InferenceRequest
from picker.core.router import Router
from picker.feeds.peers import Peers, resolve, zmq_address
from picker.feeds.scrape import Scraper

pytestmark = pytest.mark.precise
EPS = [Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000), Endpoint("10.0.0.3", 8000)]


def router(mode: str) -> Router:
    pool = Pool()
    pool.set_endpoints(EPS)
    r = Router(RouterConfig(prefix=PrefixConfig(mode=mode, block_size=16)), pool)
    for s in pool:
        r.syncs[s.key] = Sync(State.SYNCED, expected=0)
    return r


@contextlib.asynccontextmanager
async def pair(
    mode: str, scraper_b: Callable[[Router], Scraper] | None = None
) -> AsyncIterator[tuple[Router, Router, Peers, Peers]]:
    """Two pickers' peer channels; ``scraper_b`` makes B's scraper (B then shares scrapes)."""
    pa, pb = free_port(), free_port()
    a, b = router(mode), router(mode)
    peer_a = Peers(a, f"tcp://127.0.0.1:{pa}", [f"tcp://127.0.0.1:{pb}"], "a")
    scraper = scraper_b(b) if scraper_b is not None else None
    peer_b = Peers(b, f"tcp://127.0.0.1:{pb}", [f"tcp://127.0.0.1:{pa}"], "b", scraper=scraper)
    tasks = [asyncio.create_task(p.run()) for p in (peer_a, peer_b)]
    await asyncio.sleep(0.5)  # slow joiner
    try:
        yield a, b, peer_a, peer_b
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        peer_a.close()
        peer_b.close()


async def until(cond: Callable[[], bool], what: str) -> None:
    for _ in range(150):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(what)


@pytest.mark.parametrize("mode", ["precise", "approximate"])
async def test_a_peer_pick_steers_the_other_picker(mode: str) -> None:
    """Picker A sends a new prefix to some endpoint; picker B, told of the pick, sends the
    prefix's next request to the same endpoint (before any KV event could have said so)."""
    async with pair(mode) as (a, b, _, peer_b):
        toks = list(range(100, 100 + 16 * 40))
        text = " ".join(map(str, toks))
        req = InferenceRequest(
            model="m", routing_text=text, prompt_token_ids=toks if mode == "precise" else None
        )
        d = a.route(req)
        a.start(d)
        await until(lambda: peer_b.picks >= 1, "pick received")
        assert peer_b.bad == 0
        db = b.route(req)
        assert db.primary.key == d.primary.key
        assert db.cycle.matches[d.primary.key] == db.cycle.n_blocks > 0


async def test_malformed_or_foreign_picks_are_dropped() -> None:
    async with pair("precise") as (_, b, peer_a, peer_b):
        bad = [
            b"\xc1",
            msgpack.packb(["x", "10.9.9.9:1", [1], []]),  # not an endpoint of the pool
            msgpack.packb(["x", "10.0.0.1:8000", [-1], []]),  # not a 60-bit key
            msgpack.packb(["x", "10.0.0.1:8000", "keys", []]),
            msgpack.packb(["x", "10.0.0.1:8000", [1], [], {"10.0.0.1:8000": [-1, 0]}]),  # bad report
            msgpack.packb(["x", "10.0.0.1:8000", [1], [], {}, "more"]),
            msgpack.packb(["x", "10.0.0.1:8000"]),
        ]
        for body in bad:
            peer_a._pub.send_multipart([b"pick", body])
        await until(lambda: peer_b.bad >= len(bad), "bad picks counted")
        await asyncio.sleep(0.1)
        assert peer_b.bad == len(bad) and peer_b.picks == 0
        assert b.precise is not None and b.precise._spec_count == 0


async def test_in_flight_work_is_shared_and_a_dead_peers_fades() -> None:
    """B sees A's in-flight request and pending prefill on the endpoint A picked, adds them to its
    cost estimate, and forgets them once A stops reporting (load_ttl_s)."""
    async with pair("precise") as (a, b, peer_a, peer_b):
        toks = list(range(16 * 64))
        req = InferenceRequest(model="m", routing_text="x", prompt_token_ids=toks)
        d = a.route(req)
        ticket = a.start(d)
        key = d.primary.key
        state_b = b.pool.get(key)
        assert state_b is not None
        await until(lambda: state_b.peer_load.in_flight_requests == 1, "peer in-flight seen")
        assert state_b.peer_load.pending_prefill_tokens == len(toks)
        assert peer_b._loads["a"][1] == {key: [1, len(toks)]}, "the pick carried A's load"
        assert state_b.load.in_flight_requests == 0, "B's own count is untouched"
        a.finish(ticket)
        await until(lambda: state_b.peer_load.in_flight_requests == 0, "peer finish seen")
        a.start(a.route(req))
        await until(lambda: sum(s.peer_load.in_flight_requests for s in b.pool) == 1, "in flight again")
        peer_b.load_ttl_s = 0.2
        peer_a.load_interval_s = 3600.0  # A goes silent (as if killed)
        await asyncio.sleep(0.1)
        await until(
            lambda: sum(s.peer_load.in_flight_requests for s in b.pool) == 0, "a dead peer's load fades"
        )


def test_an_unchanged_load_report_waits_for_the_heartbeat() -> None:
    """A pick carries the picker's load with the new request in it; a separate load report goes
    out when the work changed otherwise (a request finished), else once per heartbeat: an idle
    picker wakes each peer 4 times a second, not 20, and a busy one about once per pick and finish."""
    now = [100.0]
    r = router("precise")
    peer = Peers(r, f"tcp://127.0.0.1:{free_port()}", [], "a", clock=lambda: now[0], load_heartbeat_s=0.25)
    try:
        assert peer.publish_load(), "the first report always goes"
        now[0] += 0.05
        assert not peer.publish_load(), "nothing changed, heartbeat not due"
        d = r.route(InferenceRequest(model="m", routing_text="y" * 64))
        ticket = r.start(d)  # the pick goes out with the report that has this request in it
        assert peer._last_report == (now[0], {d.primary.key: [1, d.cycle.prompt_tokens]})
        assert not peer.publish_load(), "the pick carried the change"
        now[0] += 0.2
        assert not peer.publish_load()
        now[0] += 0.05
        assert peer.publish_load(), "the heartbeat is due"
        r.finish(ticket)
        assert peer.publish_load(), "a finished request is reported at once"
        assert not peer.publish_load()
    finally:
        peer.close()
    with pytest.raises(AssertionError, match="heartbeat"):
        Peers(r, f"tcp://127.0.0.1:{free_port()}", [], "b", load_ttl_s=0.2, load_heartbeat_s=0.25)


async def test_peers_found_by_dns_follow_restarts_and_scaling() -> None:
    """Peers named by a DNS name (the chart's headless Service): pods on their own IPs, one port.
    A picker added to the name is heard within one re-resolution, a restarted one (same address,
    new process) is heard again, and one that leaves the name is disconnected. The name's answer is
    a table here (no DNS server to change records in); ``resolve`` itself is checked on localhost."""
    port = free_port()
    names: set[str] = {"127.0.0.1"}

    async def table(host: str) -> set[str]:
        assert host == "kvpick-peers.serving.svc"
        return set(names)

    def peer(r: Router, ip: str, ident: str) -> Peers:
        return Peers(
            r, f"tcp://{ip}:{port}", [], ident, peer_dns=f"kvpick-peers.serving.svc:{port}",
            dns_interval_s=0.1, resolver=table,
        )  # fmt: skip

    a, b = router("precise"), router("precise")
    peer_a, peer_b = peer(a, "127.0.0.1", "a"), peer(b, "127.0.0.2", "b")
    tasks = {"a": asyncio.create_task(peer_a.run()), "b": asyncio.create_task(peer_b.run())}
    req = InferenceRequest(model="m", routing_text="x", prompt_token_ids=list(range(16 * 8)))
    try:
        await until(lambda: peer_b.discovered == {f"tcp://127.0.0.1:{port}"}, "B found A")
        await asyncio.sleep(0.3)  # slow joiner
        a.start(a.route(req))
        await until(lambda: peer_b.picks >= 1, "B hears A")
        b.start(b.route(req))
        await asyncio.sleep(0.5)
        assert peer_a.picks == 0, "B is not in the name yet: A does not listen to it"
        names.add("127.0.0.2")  # scaled up: B's pod became ready
        await until(lambda: len(peer_a.discovered) == 2, "A found B")
        await hears(peer_a, b, req, "A hears B once the name lists it")
        tasks["b"].cancel()  # B's pod restarts: same address, a new process
        with contextlib.suppress(asyncio.CancelledError):
            await tasks["b"]
        peer_b.close()
        b2 = router("precise")
        for _ in range(50):  # ZMQ releases the old socket's port in its I/O thread, a moment later
            try:
                peer_b2 = peer(b2, "127.0.0.2", "b2")
                break
            except zmq.ZMQError:
                await asyncio.sleep(0.05)
        tasks["b"] = asyncio.create_task(peer_b2.run())
        await hears(peer_a, b2, req, "A hears the restarted B")
        names.discard("127.0.0.2")  # scaled down
        await until(lambda: peer_a.discovered == {f"tcp://127.0.0.1:{port}"}, "A drops B")
    finally:
        for t in tasks.values():
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        peer_a.close()
        if "peer_b2" in locals():
            peer_b2.close()


async def hears(listener: Peers, sender: Router, req: InferenceRequest, what: str) -> None:
    """``sender`` picks until ``listener`` has heard one (a new subscription drops what comes
    before its connection completes: ZMQ's slow joiner)."""
    picks = listener.picks
    for _ in range(50):
        sender.start(sender.route(req))
        if listener.picks > picks:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(what)


async def test_resolve_names_every_address() -> None:
    assert "127.0.0.1" in await resolve("localhost")
    assert zmq_address("10.1.2.3", 5560) == "tcp://10.1.2.3:5560"
    assert zmq_address("fd00::1", 5560) == "tcp://[fd00::1]:5560"
    with pytest.raises(ValueError, match="host:port"):
        Peers(router("precise"), f"tcp://127.0.0.1:{free_port()}", [], peer_dns="no-port")


async def test_scrape_batches_are_checked_and_unseen_by_older_pickers() -> None:
    """A malformed batch of shared scrapes is dropped whole; a picker older than shared scrapes
    (subscribed to ``pick`` and ``load`` only) is never sent one; a peer that shares scrapes
    becomes an owner of some endpoints, and a peer that does not never does."""
    from picker.core.config import ScrapeConfig
    from picker.feeds.scrape import Outcome, metrics_to_wire, parse_metrics

    async with pair("precise", lambda r: Scraper(r.pool, ScrapeConfig())) as (_, b, peer_a, peer_b):
        scraper = peer_b.scraper
        assert scraper is not None
        old = zmq.Context.instance().socket(zmq.SUB)
        old.connect(f"tcp://127.0.0.1:{peer_a._pub.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(':', 1)[1]}")
        for topic in (b"pick", b"load"):
            old.setsockopt(zmq.SUBSCRIBE, topic)
        await asyncio.sleep(0.3)
        assert all(peer_b.owns(s.key) for s in b.pool), "no sharer heard yet: B owns everything"
        good = metrics_to_wire(parse_metrics("vllm:num_requests_waiting 7\n"))
        bad = [
            msgpack.packb(["a", [["10.0.0.1:8000", 0.01, "", good[:3]]]]),  # too few fields
            msgpack.packb(["a", [["10.0.0.1:8000", 0.01, "", [*good[:1], float("nan"), *good[2:]]]]]),
            msgpack.packb(["a", [["10.0.0.1:8000", -5, "", good]]]),  # negative age
            msgpack.packb(["a", [["10.0.0.1:8000", 0.01, "ClientError", good]]]),  # both
            msgpack.packb(["a", "not a list"]),
        ]
        for body in bad:
            peer_a._pub.send_multipart([b"scrape", body])
        await until(lambda: peer_b.bad >= len(bad), "bad batches counted")
        assert peer_b.sharers() == [], "a malformed batch does not make its sender an owner"
        peer_a._pub.send_multipart([b"scrape", msgpack.packb(["a", [["10.0.0.1:8000", 0.01, "", good]]])])
        await until(lambda: peer_b.sharers() == ["a"], "A heard sharing")
        state = b.pool.get("10.0.0.1:8000")
        assert state is not None and state.metrics.waiting == 7 and scraper.peer_outcomes == 1
        owned = {s.key for s in b.pool if peer_b.owns(s.key)}
        assert owned == {s.key for s in b.pool if not peer_a_owns(s.key)}, "rendezvous: one owner each"
        peer_b.share("10.0.0.2:8000", Outcome(None, "ClientError"), 0.0)
        peer_b.flush_scrapes()
        await asyncio.sleep(0.3)
        with pytest.raises(zmq.Again):
            while True:  # only picks and load reports reach the older picker
                assert old.recv_multipart(zmq.NOBLOCK)[0] in (b"pick", b"load")
        old.close(linger=0)


def peer_a_owns(key: str) -> bool:
    """A's rendezvous score beats B's (the idents of :func:`pair`)."""
    import xxhash

    return xxhash.xxh64_intdigest(f"a|{key}".encode()) > xxhash.xxh64_intdigest(f"b|{key}".encode())


async def test_a_pick_leaves_out_what_its_endpoint_holds_by_events() -> None:
    """Both pickers have the same KV events: endpoint X holds a prompt's first 30 blocks. A's pick
    of the 40-block prompt on X carries the last 10 keys only, on the ``tail`` topic (which an
    older picker, subscribed to ``pick`` and ``load``, never receives); B, told of it, matches all
    40 blocks on X. Malformed tails are dropped."""
    from picker.core.prefix.precise import request_keys

    async with pair("precise") as (a, b, peer_a, peer_b):
        old = zmq.Context.instance().socket(zmq.SUB)
        old.connect(peer_a._pub.getsockopt(zmq.LAST_ENDPOINT).decode())
        for topic in (b"pick", b"load"):
            old.setsockopt(zmq.SUBSCRIBE, topic)
        toks = list(range(500, 500 + 16 * 40))
        x = EPS[1].key
        for r in (a, b):
            assert r.precise is not None
            assert r.precise.stored(x, list(range(1, 31)), None, toks[: 16 * 30], 16, None)
        await asyncio.sleep(0.3)
        req = InferenceRequest(model="m", routing_text="x", prompt_token_ids=toks)
        d = a.route(req)
        assert d.primary.key == x and d.keys == request_keys(toks, 16)
        a.start(d)
        assert peer_a.skipped == 30
        await until(lambda: peer_b.picks >= 1, "tail pick received")
        assert peer_b.bad == 0
        db = b.route(req)
        assert db.primary.key == x and db.cycle.matches[x] == 40
        assert b.precise is not None and b.precise._spec_count == 10, "only the tail is speculative"
        await asyncio.sleep(0.1)
        with pytest.raises(zmq.Again):
            while True:  # the tail never reaches an older picker
                assert old.recv_multipart(zmq.NOBLOCK)[0] in (b"pick", b"load")
        old.close(linger=0)
        bad = [
            msgpack.packb(["x", x, 0, [1], [], {}]),  # skips nothing: that is a "pick"
            msgpack.packb(["x", x, -3, [1], [], {}]),
            msgpack.packb(["x", x, "30", [1], [], {}]),
            msgpack.packb(["x", x, 30, [1], []]),  # no report
            msgpack.packb(["x", "10.9.9.9:1", 30, [1], [], {}]),
        ]
        for body in bad:
            peer_a._pub.send_multipart([b"tail", body])
        await until(lambda: peer_b.bad >= len(bad), "bad tails counted")
        assert peer_b.picks == 1

"""``python -m bench.peer_messages``: what one message a picker receives costs it in CPU, the work
every extra picker replica repeats (issue 10).

Each kind is sent from another process over real ZMQ on loopback, one message every ``--gap-ms``
(spaced as a replica's steps and a peer's picks arrive at a moderate request rate, so each one wakes
the receiver on its own), and received by the picker's own code in an asyncio loop:

- ``kv-event``: a ``BlockStored`` batch of ``--blocks`` blocks of 16 tokens (vLLM's wire format)
  into :class:`~picker.feeds.events.Subscriber` and the precise index;
- ``kv-full``: the same batch from a full cache: it also evicts as many blocks (those stored
  ``FULL_LAG`` batches before), one ``BlockRemoved`` event each, as vLLM sends them;
- ``pick``: a peer's pick of as many blocks, with its load report, into
  :class:`~picker.feeds.peers.Peers`;
- ``tail``: the same pick when its endpoint holds all but ``TAIL_KEYS`` of the blocks by its KV
  events (only the rest is sent);
- ``load``: a peer's load report over 4 endpoints.

Reported: the receiving process's CPU (user + system, all its threads: the event loop and ZMQ's I/O
thread) per message, and beside it the same decoding and indexing called back to back in a loop
(``in a loop``): the difference is what being woken for each message costs (the event loop's round,
ZMQ's I/O thread, caches gone cold in between). ``--burst K`` sends K messages back to back every
``--gap-ms`` (as a busy replica's steps and several peers' picks pile up between two wake-ups).

``--intervals``: how the receiver reads its socket, side by side in one run: ``0`` woken for every
message (a :class:`~picker.feeds.drain.Drain` on the loop, the code before the inbox); ``T`` (seconds)
through the picker's :class:`~picker.feeds.drain.Inbox`, which reads at most every T (no pick happens
here, so this is what a picker that does not route pays; one that routes also reads before each
pick, for free). Medians over ``--repeats`` runs with [min-max], the intervals interleaved within
each repeat.

``--split``: where a ``BlockStored`` batch's in-loop cost goes, per block, stage by stage (each the
fastest of ``--repeats`` passes over the same messages, CPU time): msgpack decoding, the event
checks, the token ids turned into bytes, the chained hashing, the index inserts; and beside them
the same blocks' removal (one ``BlockRemoved`` event per block, as vLLM sends them), and their
speculative entry and expiry (a peer's pick of them).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import resource
import statistics
import time
from array import array
from collections.abc import Callable

import msgpack
import zmq
import zmq.asyncio

from kvlaunch import free_port
from picker.core.config import PrefixConfig, RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint
from picker.core.prefix.precise import PreciseIndex, State, Sync, chain_keys
from picker.core.router import Router
from picker.feeds.drain import Inbox
from picker.feeds.events import Stored, Subscriber, apply, decode_batch
from picker.feeds.peers import Peers

BS = 16
EPS = [Endpoint(f"10.0.0.{i + 1}", 8000) for i in range(4)]
KINDS = ("kv-event", "kv-full", "pick", "tail", "load")
FULL_LAG = 10
"""``kv-full``: each batch also evicts the blocks stored this many batches before (a full cache)."""
TAIL_KEYS = 4
"""A ``tail`` pick carries this many of its keys: the rest its endpoint holds by its events (a
shared-prefix request: 64 blocks of prefix, 4 of question)."""


def _messages(kind: str, n: int, blocks: int) -> list[list[bytes]]:
    rng = random.Random(0)
    out: list[list[bytes]] = []
    for i in range(n):
        keys = [i * blocks + b + 1 for b in range(blocks)]
        if kind in ("kv-event", "kv-full"):
            event = {
                "type": "BlockStored", "block_hashes": keys, "parent_block_hash": None,
                "token_ids": [rng.randrange(32000) for _ in range(blocks * BS)], "block_size": BS,
                "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
            }  # fmt: skip
            evicted = [
                {
                    "type": "BlockRemoved",
                    "block_hashes": [k - FULL_LAG * blocks],
                    "medium": "GPU",
                    "group_idx": 0,
                }
                for k in (keys if kind == "kv-full" and i >= FULL_LAG else [])
            ]  # as vLLM sends them: one event per evicted block
            out.append([b"", i.to_bytes(8, "big"), msgpack.packb([time.time(), [event, *evicted]])])
        elif kind == "pick":
            report = {EPS[0].key: [1 + i % 3, 1000]}
            body = msgpack.packb(["peer", EPS[i % 4].key, keys, [], report], use_bin_type=True)
            out.append([b"pick", body])
        elif kind == "tail":
            report = {EPS[0].key: [1 + i % 3, 1000]}
            skip = blocks - TAIL_KEYS
            body = msgpack.packb(["peer", EPS[i % 4].key, skip, keys[skip:], [], report], use_bin_type=True)
            out.append([b"tail", body])
        else:
            report = {e.key: [i % 3, 1000 + i] for e in EPS}
            out.append([b"load", msgpack.packb(["peer", report])])
    return out


def _send(url: str, kind: str, n: int, blocks: int, gap_s: float, burst: int) -> None:
    msgs = _messages(kind, n, blocks)
    sock = zmq.Context().socket(zmq.PUB)
    sock.bind(url)
    time.sleep(1.0)  # slow joiner
    for i, m in enumerate(msgs):
        sock.send_multipart(m)
        if (i + 1) % burst == 0:
            time.sleep(gap_s)
    time.sleep(0.5)
    sock.close(linger=0)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _router() -> Router:
    pool = Pool()
    pool.set_endpoints(EPS)
    r = Router(RouterConfig(prefix=PrefixConfig(mode="precise", block_size=BS)), pool)
    for s in pool:
        r.syncs[s.key] = Sync(State.SYNCED, expected=0)
    return r


async def _receive(kind: str, url: str, n: int, interval_s: float) -> float:
    """CPU ms per message received after the first few (the slow joiner's are not counted)."""
    inbox = Inbox(interval_s) if interval_s > 0 else None
    if inbox is not None:
        inbox.start()
    if kind.startswith("kv-"):
        sub = Subscriber(EPS[0].key, PreciseIndex(), url, ctx=zmq.asyncio.Context(), inbox=inbox)
        count: Callable[[], int] = lambda: sub.sync.expected or 0  # noqa: E731
        task = asyncio.create_task(sub.run())
    else:
        peers = Peers(
            _router(), f"tcp://127.0.0.1:{free_port()}", [url], "me", load_interval_s=3600, inbox=inbox
        )
        count = lambda: peers.received  # noqa: E731
        task = asyncio.create_task(peers.run())
    while count() < 5:
        await asyncio.sleep(0.01)
    c0, n0 = _cpu(), count()
    while count() < n:
        await asyncio.sleep(0.05)
    ms = (_cpu() - c0) / (count() - n0) * 1000
    task.cancel()
    await asyncio.sleep(0)
    if inbox is not None:
        inbox.stop()
    return ms


def _in_a_loop(kind: str, n: int, blocks: int) -> float:
    msgs = _messages(kind, n, blocks)
    if kind.startswith("kv-"):
        index = PreciseIndex()
        t0 = time.process_time()
        for m in msgs:
            apply(index, EPS[0].key, decode_batch(m[2]))
    else:
        peers = Peers(_router(), f"tcp://127.0.0.1:{free_port()}", [], "me")
        take = {"pick": peers.apply, "tail": peers.apply_tail, "load": peers.apply_load}[kind]
        t0 = time.process_time()
        for m in msgs:
            assert take(m[1]), f"the {kind} message was refused"
        peers.close()
    return (time.process_time() - t0) / n * 1000


def measure(kind: str, n: int, blocks: int, gap_s: float, burst: int = 1, interval_s: float = 0.0) -> float:
    """CPU ms per message received (``interval_s``: 0 woken per message, else the inbox's)."""
    url = f"tcp://127.0.0.1:{free_port()}"
    sender = multiprocessing.Process(target=_send, args=(url, kind, n, blocks, gap_s, burst))
    sender.start()
    try:
        return asyncio.run(_receive(kind, url, n, interval_s))
    finally:
        sender.join(timeout=60)


def _fastest(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def split(n: int, blocks: int, repeats: int) -> list[tuple[str, float]]:
    """``[(stage, µs per block)]`` of indexing ``n`` ``BlockStored`` batches of ``blocks`` blocks."""
    payloads = [m[2] for m in _messages("kv-event", n, blocks)]
    events = [e for p in payloads for e in decode_batch(p) if isinstance(e, Stored)]
    keys = [chain_keys(e.token_ids, e.block_size) for e in events]
    removals = [  # as vLLM sends them: one BlockRemoved event per evicted block
        msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
                             for h in e.block_hashes]])
        for e in events
    ]  # fmt: skip

    def unpack() -> None:
        for p in payloads:
            msgpack.unpackb(p, raw=False, strict_map_key=False)

    def decode() -> None:
        for p in payloads:
            decode_batch(p)

    def to_bytes() -> None:
        for e in events:
            array("I", e.token_ids).tobytes()

    def store() -> PreciseIndex:
        index = PreciseIndex()
        for e in events:
            index.stored("e", e.block_hashes, e.parent, e.token_ids, e.block_size, e.extras)
        return index

    def keys_only() -> None:
        for e in events:
            chain_keys(e.token_ids, e.block_size, e.extras)

    def store_remove() -> None:
        index = store()
        for r in removals:
            apply(index, "e", decode_batch(r))

    def speculate() -> None:
        index = PreciseIndex(spec_ttl_s=1.0)
        for i, k in enumerate(keys):
            index.speculate("e", k, i * 0.01)  # one pick every 10 ms, each expiring after 1 s
        index.speculate("e", [], 1e9)  # the rest expire
        index.match_many(["e"], keys[0], 1e9)

    t = {name: _fastest(fn, repeats) for name, fn in [
        ("unpack", unpack), ("decode", decode), ("bytes", to_bytes),
        ("keys", keys_only), ("store", store), ("store+remove", store_remove), ("speculate", speculate),
    ]}  # fmt: skip
    whole = _fastest(lambda: [apply(PreciseIndex(), "e", decode_batch(p)) for p in payloads], repeats)
    per = 1e6 / (n * blocks)
    return [
        ("msgpack decode of the batch (token ids become Python ints)", t["unpack"] * per),
        (
            "decode_batch beyond that (its checks; since the struct decoder: all of its reading)",
            (t["decode"] - t["unpack"]) * per,
        ),
        ("token ids to bytes (one array('I') per batch)", t["bytes"] * per),
        (
            "slices + xxh64, chained through the seed (chain_keys beyond the bytes)",
            (t["keys"] - t["bytes"]) * per,
        ),
        ("index inserts (stored() beyond its keys)", (t["store"] - t["keys"]) * per),
        ("whole BlockStored, decoded and applied", whole * per),
        (
            "its removal later: one BlockRemoved per block, as vLLM sends them, decoded and applied",
            (t["store+remove"] - t["store"]) * per,
        ),
        ("a peer's pick of it: speculative entry + expiry", t["speculate"] * per),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peer_messages", description=__doc__)
    p.add_argument("--messages", type=int, default=1000)
    p.add_argument("--blocks", type=int, default=68, help="blocks per KV-event batch and per pick")
    p.add_argument("--gap-ms", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--burst", type=int, default=1, help="messages sent back to back every --gap-ms")
    p.add_argument(
        "--intervals",
        default="0,0.05",
        help="comma-separated: 0 = woken per message, T = read through the inbox at most every T s",
    )
    p.add_argument("--split", action="store_true", help="the in-loop cost per block, stage by stage")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    a = p.parse_args(argv)
    if a.split:
        print(f"| stage ({a.blocks} blocks of {BS} tokens per batch) | µs per block |")
        print("|---|---|")
        for stage, us in split(a.messages, a.blocks, max(a.repeats, 5)):
            print(f"| {stage} | {us:.3f} |")
        return 0
    intervals = [float(x) for x in a.intervals.split(",")]
    heads = ["woken per message" if t == 0 else f"inbox {t * 1000:g} ms" for t in intervals]
    print(f"| message ({a.blocks} blocks, {a.burst} at a time) | " + " | ".join(heads) + " | in a loop |")
    print("|---" * (len(intervals) + 2) + "|")
    kinds = a.kinds.split(",")
    if not set(kinds) <= set(KINDS):
        p.error(f"unknown kinds {sorted(set(kinds) - set(KINDS))}")
    for kind in kinds:
        runs: dict[float, list[float]] = {t: [] for t in intervals}
        for _ in range(a.repeats):
            for t in intervals:
                runs[t].append(measure(kind, a.messages, a.blocks, a.gap_ms / 1000, a.burst, t))
        loop = [_in_a_loop(kind, a.messages, a.blocks) for _ in range(a.repeats)]
        cells = [_med(runs[t]) for t in intervals] + [_med(loop)]
        print(f"| {kind} | " + " | ".join(cells) + " |", flush=True)
    return 0


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


if __name__ == "__main__":
    raise SystemExit(main())

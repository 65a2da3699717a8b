"""vLLM KV events → :class:`~picker.core.prefix.precise.PreciseIndex`, one ZMQ subscriber per endpoint.

Wire format (vLLM 0.32 ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): PUB multipart
``[topic, seq (8-byte big-endian), msgpack(KVEventBatch)]``; the batch is an array
``[ts, events, data_parallel_rank?]``; each event a msgspec tagged struct, a map whose ``"type"``
is ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (an array ``[tag, fields…]`` in
declaration order is accepted too). The optional replay endpoint is a ROUTER: a DEALER sends
``[b"", start_seq]`` and gets ``[b"", topic, seq, payload]`` per buffered batch from ``start_seq``,
then ``[b"", b"", -1 (8 bytes, signed), b""]``.

Sequence handling (:class:`Sync`, one per endpoint, written only by its subscriber task):

- in order (``seq == expected``): apply;
- a gap (``seq > expected``), or a first message that is not ``seq 0``: re-sync through the replay
  endpoint when configured and it still buffers ``expected``; otherwise drop the endpoint's
  entries and route it approximately for ``refill_s`` while new events refill the index;
- ``seq < expected``: the publisher restarted (a new engine counts from
  0, with an empty cache), so the entries are dropped and the stream taken from there.

Only GPU-tier (``medium`` GPU or unset) events of KV-cache group 0 are indexed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec
import zmq
import zmq.asyncio

from picker.core.prefix.precise import PreciseIndex, State, Sync
from picker.feeds.drain import Drain, Inbox

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Larger messages are refused by ZMQ (a gap follows): memory stays bounded whatever a peer sends."""
RECONNECT_IVL_MAX_MS = 1000
"""Longest wait between two connection attempts to a publisher that is not there, in ms: ZMQ
doubles its 100 ms reconnect interval up to this, instead of retrying every 100 ms for ever.
An endpoint that publishes no events (no ``--kv-events-config``, a replica still loading)
then costs one TCP connect a second, not ten (with 100 such endpoints the ZMQ I/O thread took
0.047 of a core idle; bench/results/2026-11-28-parity.md), and a publisher that comes (back) up
is connected to within a second."""

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")


class BadEvent(ValueError):
    """A batch that does not decode as vLLM's ``KVEventBatch``."""


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[Any]
    parent: Any
    token_ids: list[int]
    block_size: int
    extras: list[Any] | None


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[Any]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def _fields(raw: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, list):  # array-like tagged struct: [tag, field0, field1, ...]
        return dict(zip(names, raw[1:], strict=False))
    raise BadEvent(f"event is a {type(raw).__name__}, not a map or array")


def _tag(raw: Any) -> str:
    tag = raw.get("type") if isinstance(raw, dict) else raw[0] if isinstance(raw, list) and raw else None
    if not isinstance(tag, str):
        raise BadEvent(f"event has no type tag: {raw!r:.100}")
    return tag


_GPU = (None, "GPU")
_GROUP0 = (None, 0)


def _indexed(f: dict[str, Any]) -> bool:
    return f.get("medium") in _GPU and f.get("group_idx") in _GROUP0


class _WireStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[int | bytes]
    token_ids: msgspec.Raw
    """Kept as msgpack bytes by the struct decoder, then read by msgpack: faster for int arrays."""
    block_size: int
    parent_block_hash: int | bytes | None = None
    medium: str | None = None
    group_idx: int | None = None
    extra_keys: list[Any] | None = None


class _WireRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _WireCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _WireBatch(msgspec.Struct, array_like=True, gc=False):
    ts: Any
    events: list[_WireStored | _WireRemoved | _WireCleared]
    data_parallel_rank: Any = None


def _no_ext(code: int, data: memoryview) -> Any:
    raise ValueError("msgpack extension type")  # the lenient decoder reads those


_STRICT = msgspec.msgpack.Decoder(_WireBatch, ext_hook=_no_ext)


def _decode_strict(payload: bytes) -> list[Event] | None:
    """:func:`decode_batch` for a batch in exactly vLLM's shape (map events of the three known
    types, hashes ints or bytes), read by msgspec's struct decoder: a map event costs about a
    third of a generic decode (no dict, no key strings). None: not in that shape, for the lenient
    decoder to read. The result, or the :class:`BadEvent` raised, is what the lenient one gives."""
    try:
        batch = _STRICT.decode(payload)
    except (msgspec.MsgspecError, ValueError):
        return None
    out: list[Event] = []
    run: list[Any] | None = None
    for e in batch.events:
        if type(e) is _WireRemoved:
            if e.medium in _GPU and e.group_idx in _GROUP0:
                if run is not None:
                    run += e.block_hashes
                else:
                    out.append(Removed(e.block_hashes))
                    run = e.block_hashes
        elif type(e) is _WireStored:
            tokens = msgpack.unpackb(e.token_ids, raw=False, strict_map_key=False)
            hashes, bs = e.block_hashes, e.block_size
            if not (isinstance(tokens, list) and bs > 0):
                raise BadEvent("BlockStored without block_hashes, token_ids or block_size")
            if len(tokens) != len(hashes) * bs:
                raise BadEvent(f"BlockStored: {len(tokens)} tokens for {len(hashes)} blocks of {bs}")
            if e.medium in _GPU and e.group_idx in _GROUP0:
                out.append(Stored(hashes, e.parent_block_hash, tokens, bs, e.extra_keys or None))
                run = None
        else:
            out.append(Cleared())
            run = None
    return out


def decode_batch(payload: bytes) -> list[Event]:
    """The GPU-tier events of one ``KVEventBatch`` payload. Raises :class:`BadEvent`.

    vLLM sends one ``BlockRemoved`` per evicted block, so in a full cache a batch holds as many
    removals as stored blocks: a run of consecutive removals becomes one :class:`Removed` of all
    their hashes (the same index change, one call instead of one per block). A batch in exactly
    vLLM's shape is read by :func:`_decode_strict`; any other (array-like events, other event
    types, odd field types) by the lenient reading below."""
    strict = _decode_strict(payload)
    return strict if strict is not None else _decode_lenient(payload)


def _decode_lenient(payload: bytes) -> list[Event]:
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadEvent(f"payload is not msgpack: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise BadEvent("payload is not a KVEventBatch array [ts, events, ...]")
    out: list[Event] = []
    run: list[Any] | None = None
    """The hashes of the last event in ``out`` while it is a :class:`Removed` (extended in place)."""
    for raw in batch[1]:
        f = raw if type(raw) is dict else None
        tag = f.get("type") if f is not None else _tag(raw)
        if tag == "BlockRemoved":
            if f is None:
                f = _fields(raw, _REMOVED_FIELDS)
            hashes = f.get("block_hashes")
            if type(hashes) is not list:
                raise BadEvent("BlockRemoved without block_hashes")
            if f.get("medium") in _GPU and f.get("group_idx") in _GROUP0:
                if run is not None:
                    run += hashes
                else:
                    out.append(Removed(hashes))
                    run = hashes
        elif tag == "BlockStored":
            f = _fields(raw, _STORED_FIELDS)
            hashes, tokens, bs = f.get("block_hashes"), f.get("token_ids"), f.get("block_size")
            if not (isinstance(hashes, list) and isinstance(tokens, list) and isinstance(bs, int) and bs > 0):
                raise BadEvent("BlockStored without block_hashes, token_ids or block_size")
            if len(tokens) != len(hashes) * bs:
                raise BadEvent(f"BlockStored: {len(tokens)} tokens for {len(hashes)} blocks of {bs}")
            extras = f.get("extra_keys")
            if _indexed(f):
                out.append(Stored(hashes, f.get("parent_block_hash"), tokens, bs, extras or None))
                run = None
        elif tag == "AllBlocksCleared":
            out.append(Cleared())
            run = None
        elif not isinstance(tag, str):
            raise BadEvent(f"event has no type tag: {raw!r:.100}")
        # other event types (future vLLM versions) are skipped
    return out


def apply(index: PreciseIndex, key: str, events: list[Event]) -> int:
    """Apply decoded events to ``key``'s entries. Returns the stores skipped for an unknown parent."""
    skipped = 0
    for e in events:
        if isinstance(e, Stored):
            try:
                ok = index.stored(key, e.block_hashes, e.parent, e.token_ids, e.block_size, e.extras)
            except (OverflowError, TypeError) as exc:  # token ids that are not uint32
                raise BadEvent(f"BlockStored with bad token ids: {exc}") from exc
            skipped += not ok
        elif isinstance(e, Removed):
            index.removed(key, e.block_hashes)
        else:
            index.clear(key)
    return skipped


class Subscriber:
    """Consumes one endpoint's KV events into the shared index."""

    def __init__(
        self,
        key: str,
        index: PreciseIndex,
        pub_url: str,
        replay_url: str | None = None,
        topic: str = "",
        refill_s: float = 30.0,
        ctx: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
        inbox: Inbox | None = None,
    ) -> None:
        self.key, self.index, self.pub_url, self.replay_url = key, index, pub_url, replay_url
        self.inbox = inbox
        """Reads the socket before each pick and every ``interval_s`` (None: on every wake-up)."""
        self.topic, self.refill_s, self.clock = topic.encode(), refill_s, clock
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.sync = Sync()
        self._drain: Drain | None = None
        self._replaying: asyncio.Task[None] | None = None
        """The replay of a gap in progress (the reading is paused meanwhile); written by the drain."""

    # --- the pure part: sequence logic (tests drive it directly) ----------------------------
    async def on_message(self, seq: int, payload: bytes) -> None:
        if not self.take(seq, payload):  # a gap the replay endpoint may fill
            assert self.sync.expected is not None, "take() set the expected seq before refusing"
            await self._gap(self.sync.expected, seq)
            self._apply(seq, payload)

    def take(self, seq: int, payload: bytes) -> bool:
        """Apply one batch, unless it follows a gap and a replay endpoint is configured: then
        False, nothing applied, for :meth:`on_message` to replay (which awaits)."""
        sy = self.sync
        if sy.expected is not None and seq < sy.expected:
            sy.restarts += 1  # the publisher counts from 0 again: a new engine, an empty cache
            log.info(
                "%s: KV-event stream restarted (seq %d after %d); entries dropped",
                self.key,
                seq,
                sy.expected - 1,
            )
            self.index.forget(self.key)
            sy.expected, sy.state = 0, State.SYNCED
        if sy.expected is None:
            sy.expected = 0
            if seq == 0:
                sy.state = State.SYNCED
        if seq > sy.expected:
            if self.replay_url is not None:
                return False
            sy.gaps += 1
            self._lost(sy.expected, seq)
        self._apply(seq, payload)
        return True

    def _apply(self, seq: int, payload: bytes) -> None:
        sy = self.sync
        try:
            sy.skipped_stores += apply(self.index, self.key, decode_batch(payload))
        except BadEvent as exc:
            sy.bad += 1
            log.warning("%s: bad KV-event batch %d (%s); entries dropped", self.key, seq, exc)
            self._drop()
        sy.expected = seq + 1
        if sy.state is State.REFILL and self.clock() >= sy.refill_until:
            sy.state = State.SYNCED

    async def _gap(self, expected: int, seq: int) -> None:
        sy = self.sync
        sy.gaps += 1
        if self.replay_url is not None:
            batches = await self._replay(expected)
            if batches and batches[0][0] <= expected and batches[-1][0] >= seq - 1:
                for s, payload in batches:
                    if expected <= s < seq:
                        self._apply(s, payload)
                if sy.state is State.WAITING:
                    sy.state = State.SYNCED if expected == 0 else State.REFILL
                log.info("%s: KV-event gap %d..%d re-synced by replay", self.key, expected, seq - 1)
                return
        self._lost(expected, seq)

    def _lost(self, expected: int, seq: int) -> None:
        log.info(
            "%s: KV-event gap %d..%d; entries dropped, approximate until refilled",
            self.key,
            expected,
            seq - 1,
        )
        self._drop()

    def _drop(self) -> None:
        self.index.clear(self.key)
        self.sync.state = State.REFILL
        self.sync.refill_until = self.clock() + self.refill_s

    # --- I/O ----------------------------------------------------------------------------------
    async def _replay(self, start: int, timeout_s: float = 2.0) -> list[tuple[int, bytes]]:
        """Batches from ``start`` on, from the ROUTER replay endpoint ([] on any failure)."""
        assert self.replay_url is not None, "replay without a replay endpoint"
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_url)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(timeout_s * 1000)):
                    log.warning("%s: replay from %d timed out", self.key, start)
                    return []
                frames = await sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    log.warning("%s: malformed replay frame", self.key)
                    return []
                if frames[2] == END_SEQ:
                    return out
                out.append((int.from_bytes(frames[2], "big"), frames[3]))
        except zmq.ZMQError as exc:
            log.warning("%s: replay failed: %s", self.key, exc)
            return []
        finally:
            sock.close(linger=0)

    def _take_frames(self, frames: list[bytes]) -> bool:
        """One received message (:class:`~picker.feeds.drain.Drain`'s ``take``): False pauses the
        reading while a gap is replayed."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.sync.bad += 1
            return True
        seq = int.from_bytes(frames[1], "big")
        if self.take(seq, frames[2]):
            return True
        self._replaying = asyncio.get_running_loop().create_task(self._replay_gap(seq, frames[2]))
        return False

    async def _replay_gap(self, seq: int, payload: bytes) -> None:
        assert self._drain is not None and self.sync.expected is not None
        await self._gap(self.sync.expected, seq)
        self._apply(seq, payload)
        self._drain.resume()

    async def run(self) -> None:
        """Consume the stream until cancelled: every batch queued when the socket is read, in one
        callback (:class:`~picker.feeds.drain.Drain`: with an inbox, before each pick and every
        ``interval_s``); the reading pauses while a gap is replayed."""
        sock: zmq.Socket[bytes] = zmq.Socket(self.ctx, zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.connect(self.pub_url)
        self._drain = Drain(sock, self._take_frames, inbox=self.inbox)
        self._drain.start()
        try:
            await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            self._drain.stop()
            if self._replaying is not None:
                self._replaying.cancel()
            sock.close(linger=0)

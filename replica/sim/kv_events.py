"""vLLM-format KV-cache events over ZMQ PUB (docs/design.md#vllm-facts), so that precise-mode
consumers follow
the simulator exactly as they follow vLLM.

Wire format, as vLLM 0.32's ``ZmqEventPublisher`` and ``vllm/distributed/kv_events.py``:
multipart ``[topic, seq, payload]`` with ``seq`` an 8-byte big-endian counter from 0, one message
per engine step that changed the cache. ``payload`` is msgpack of ``KVEventBatch``, a msgspec
struct encoded as an array ``[ts, events]`` (``data_parallel_rank`` omitted at its default).
Each event is a msgspec tagged struct, i.e. a map whose ``"type"`` is the class name, with
defaulted fields left out:

- ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
  "token_ids": [...], "block_size": n, "lora_id": None | int, "medium": "GPU",
  "lora_name": None | str, "extra_keys": [...], "group_idx": 0}`` — one per request per step,
  covering the blocks it newly cached. ``extra_keys`` has one entry per block: ``None``, or the
  untagged tuple of the LoRA name and, on block 0 only, the cache salt.
- ``{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}`` — one per
  evicted block.
- ``{"type": "AllBlocksCleared"}``.

Block hashes are the simulator's 64-bit chained hashes (vLLM's default int form).

Replay (vLLM's optional ``replay_endpoint``): a ROUTER socket. A DEALER sends ``[b"", start_seq]``
(8 bytes big-endian) and receives ``[b"", topic, seq, payload]`` for each buffered batch with
``seq >= start_seq``, then ``[b"", b"", -1 as 8 signed bytes, b""]``. The last ``buffer_steps``
batches are kept (vLLM's default 10,000). A thread serves it; the buffer is shared under a lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

from .blocks import Cleared, Event, Removed, Stored


def _extra_keys(e: Stored) -> list[list[str] | None]:
    out: list[list[str] | None] = []
    for i in range(len(e.hashes)):
        keys = ([e.lora] if e.lora else []) + ([e.salt] if e.salt and i == 0 else [])
        out.append(keys or None)
    return out


def encode_event(e: Event, block_size: int, lora_ids: dict[str, int]) -> dict[str, Any]:
    if isinstance(e, Stored):
        return {
            "type": "BlockStored",
            "block_hashes": e.hashes,
            "parent_block_hash": e.parent,
            "token_ids": e.token_ids,
            "block_size": block_size,
            "lora_id": lora_ids.get(e.lora) if e.lora else None,
            "medium": "GPU",
            "lora_name": e.lora or None,
            "extra_keys": _extra_keys(e),
            "group_idx": 0,
        }
    if isinstance(e, Removed):
        return {"type": "BlockRemoved", "block_hashes": [e.block_hash], "medium": "GPU", "group_idx": 0}
    assert isinstance(e, Cleared), f"unknown event {e!r}"
    return {"type": "AllBlocksCleared"}


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    """A bound ZMQ PUB socket; ``publish`` sends one ``KVEventBatch`` per call. With
    ``replay_endpoint``, a ROUTER serves the last ``buffer_steps`` batches from a thread."""

    def __init__(
        self,
        endpoint: str,
        block_size: int,
        topic: str = "kv",
        lora_ids: dict[str, int] | None = None,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
    ) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = ctx.socket(zmq.PUB)
        self._sock.bind(endpoint)
        self._topic, self._block_size = topic.encode(), block_size
        self._lora_ids = lora_ids or {}
        self._seq = itertools.count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            replay = ctx.socket(zmq.ROUTER)
            replay.bind(replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, args=(replay,), daemon=True)
            self._thread.start()

    def publish(self, events: list[Event]) -> None:
        if not events:
            return
        body = [encode_event(e, self._block_size, self._lora_ids) for e in events]
        payload = msgpack.packb([time.time(), body], use_bin_type=True)
        seq = next(self._seq)
        with self._lock:
            self._buffer.append((seq, payload))
        self._sock.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self, sock: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frame = sock.recv_multipart()
                if len(frame) != 3 or len(frame[2]) != 8:
                    continue  # vLLM logs and ignores a malformed request
                client, _, start = frame
                first = int.from_bytes(start, "big")
                with self._lock:
                    batches = [b for b in self._buffer if b[0] >= first]
                for seq, payload in batches:
                    sock.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
                sock.send_multipart([client, b"", b"", END_SEQ, b""])
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._sock.close(linger=0)

"""vLLM-format KV-cache events over ZMQ PUB (DESIGN §4), so that precise-mode consumers follow
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
"""

from __future__ import annotations

import itertools
import time
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


class Publisher:
    """A bound ZMQ PUB socket; ``publish`` sends one ``KVEventBatch`` per call."""

    def __init__(
        self, endpoint: str, block_size: int, topic: str = "kv", lora_ids: dict[str, int] | None = None
    ) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = ctx.socket(zmq.PUB)
        self._sock.bind(endpoint)
        self._topic, self._block_size = topic.encode(), block_size
        self._lora_ids = lora_ids or {}
        self._seq = itertools.count()

    def publish(self, events: list[Event]) -> None:
        if not events:
            return
        body = [encode_event(e, self._block_size, self._lora_ids) for e in events]
        payload = msgpack.packb([time.time(), body], use_bin_type=True)
        self._sock.send_multipart([self._topic, next(self._seq).to_bytes(8, "big"), payload])

    def close(self) -> None:
        self._sock.close(linger=0)

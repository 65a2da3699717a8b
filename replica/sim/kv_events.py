"""vLLM-format KV-cache events over ZMQ PUB (DESIGN §4), so precise-mode consumers can follow the
simulator exactly as they follow vLLM.

Wire format, as vLLM 0.32's ``ZmqEventPublisher``: multipart ``[topic, seq (8 bytes, big-endian),
payload]``; ``payload`` is msgpack of ``KVEventBatch`` encoded array-like as ``[ts, events]``; each
event is a tagged map: ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...,
"token_ids": [...], "block_size": n, "lora_id": None, "medium": "GPU", "lora_name": None}``,
``{"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}`` or
``{"type": "AllBlocksCleared"}``. Block hashes are 64-bit ints.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgpack
import zmq

from .blocks import BlockPool


def drain(pool: BlockPool) -> list[dict[str, Any]]:
    """The pool's block changes since the last drain, as vLLM events, in a consistent order:
    a clear first, then removals (evictions happen before the stores that reuse the blocks)."""
    events: list[dict[str, Any]] = []
    if pool.cleared:
        events.append({"type": "AllBlocksCleared"})
        pool.cleared = False
    if pool.evicted:
        events.append({"type": "BlockRemoved", "block_hashes": pool.evicted, "medium": "GPU"})
        pool.evicted = []
    for block_hash, parent, tokens in pool.stored:
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": [block_hash],
                "parent_block_hash": parent,
                "token_ids": list(tokens),
                "block_size": pool.block_size,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        )
    pool.stored = []
    return events


class Publisher:
    def __init__(self, endpoint: str, topic: str = "kv") -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.bind(endpoint)
        self._topic = topic.encode()
        self._seq = itertools.count()

    def publish(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        payload = msgpack.packb([time.time(), events], use_bin_type=True)
        self._sock.send_multipart([self._topic, next(self._seq).to_bytes(8, "big"), payload])

    def close(self) -> None:
        self._sock.close(linger=0)

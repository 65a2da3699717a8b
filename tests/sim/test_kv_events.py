"""KV events from the simulator, read by a real ZMQ SUB and decoded independently."""

from __future__ import annotations

import pathlib
import time

import msgpack
import pytest
import zmq

from replica.sim import tokenizer
from replica.sim.blocks import chain_hashes
from tests.support.procs import PY, Procs, free_port, post_json, wait_port

PROMPT = "Stored blocks must match the engine. " * 8  # 296 chars = 74 tokens = 4 full blocks of 16


def test_events_match_the_engine_block_changes(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    port, ev_port = free_port(), free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        proc = procs.start(
            "sim",
            [
                PY,
                "-m",
                "replica.sim",
                "--port",
                str(port),
                "--profile",
                "cpu-test",
                "--kv-events-port",
                str(ev_port),
                "--num-gpu-blocks",
                "6",
            ],
        )
        wait_port(port, proc=proc)
        sub.connect(f"tcp://127.0.0.1:{ev_port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.5)  # slow-joiner: let the subscription reach the publisher
        url = f"http://127.0.0.1:{port}/v1/completions"
        assert (
            post_json(url, {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": PROMPT, "max_tokens": 2})[
                0
            ]
            == 200
        )
        other = "A different prompt evicts the first. " * 8
        assert (
            post_json(url, {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": other, "max_tokens": 2})[0]
            == 200
        )
        frames = []
        while sub.poll(2000):
            frames.append(sub.recv_multipart())
        assert frames, "no KV events received"
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers are consecutive"
        events = [e for f in frames for e in msgpack.unpackb(f[2], raw=False)[1]]
        stored = [e for e in events if e["type"] == "BlockStored"]
        removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        tokens = tokenizer.encode(PROMPT)
        want = chain_hashes(tokens, 16)
        first = stored[0]  # the first request's prompt blocks, cached in its one prefill step
        assert first["block_hashes"] == want, "one BlockStored per request step, hashes in chain order"
        assert first["parent_block_hash"] is None and first["token_ids"] == tokens[: 16 * len(want)]
        assert first["block_size"] == 16 and first["medium"] == "GPU" and first["group_idx"] == 0
        assert first["extra_keys"] == [None] * len(want) and first["lora_name"] is None
        assert set(removed) <= set(want) and removed, "5 usable blocks cannot hold both prompts"
        assert all(
            set(e) == {"type", "block_hashes", "medium", "group_idx"}
            for e in events
            if e["type"] == "BlockRemoved"
        )
        _decode_with_vllm(frames[0][2])
    finally:
        sub.close(linger=0)
        procs.close()


def _decode_with_vllm(payload: bytes) -> None:
    """vLLM's own decoder accepts the payload (when vLLM is installed, as in `make test`)."""
    msgspec = pytest.importorskip("msgspec")
    try:
        from vllm.distributed.kv_events import KVEventBatch
    except ImportError:
        pytest.skip("vLLM not installed; the plain msgpack decode above still ran")
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    assert batch.events, batch

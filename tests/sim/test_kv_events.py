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
        want = chain_hashes(tokenizer.encode(PROMPT), 16)
        got = [e["block_hashes"][0] for e in stored][: len(want)]
        assert got == want, "BlockStored hashes are the engine's chained block hashes, in order"
        assert [e["parent_block_hash"] for e in stored[: len(want)]] == [None, *want[:-1]]
        assert stored[0]["token_ids"] == tokenizer.encode(PROMPT)[:16] and stored[0]["block_size"] == 16
        assert set(removed) <= set(want) and removed, (
            "6 blocks cannot hold both prompts: the first is evicted"
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

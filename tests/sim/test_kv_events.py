"""KV events from a simulator process, read by a real ZMQ SUB and decoded independently (plain
msgpack, and vLLM's own msgspec ``KVEventBatch`` decoder when vLLM is installed), compared in full
with the block-pool changes of the same engine replayed in process.

Every request is sent after the previous one has answered, so the replica's steps are
deterministic and an in-process ``EngineCore`` stepped in discrete time makes the same block
changes, step for step: one ZMQ message per step that changed the cache.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import pathlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq

from kvlaunch import PY, Procs, free_port, post_json, wait_port
from replica.sim import tokenizer
from replica.sim.blocks import Cleared, Event, Removed, Stored, chain_hashes
from replica.sim.costmodel import profile
from replica.sim.engine import EngineConfig, EngineCore
from replica.sim.request import Request

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = "Stored blocks must match the engine. " * 8  # 296 chars = 74 tokens = 4 full blocks of 16
BS = 16


@dataclass
class Sim:
    url: str
    sub: zmq.Socket[bytes]
    procs: Procs

    def complete(self, prompt: list[int] | str, max_tokens: int, **extra: Any) -> dict[str, Any]:
        status, body = post_json(
            self.url + "/v1/completions",
            {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra},
        )
        assert status == 200, body
        assert isinstance(body, dict)
        return body

    def frames(self, quiet_ms: int = 700) -> list[list[bytes]]:
        """Every message received until none arrives for ``quiet_ms``."""
        out = []
        while self.sub.poll(quiet_ms):
            out.append(self.sub.recv_multipart())
        return out


@contextlib.contextmanager
def simulator(tmp_path: pathlib.Path, *flags: str) -> Iterator[Sim]:
    procs = Procs(tmp_path)
    port, ev_port = free_port(), free_port()
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    try:
        args = ["--port", str(port), "--profile", "cpu-test", "--kv-events-port", str(ev_port)]
        proc = procs.start("sim", [PY, "-m", "replica.sim", *args, *flags])
        wait_port(port, proc=proc)
        sub.connect(f"tcp://127.0.0.1:{ev_port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.5)  # slow joiner: let the subscription reach the publisher
        yield Sim(f"http://127.0.0.1:{port}", sub, procs)
    finally:
        sub.close(linger=0)
        procs.stop()


# --- independent decoding ------------------------------------------------------------------------


def decode(frames: list[list[bytes]], first_seq: int = 0) -> list[list[dict[str, Any]]]:
    """Check the envelope and return each message's events as plain msgpack maps."""
    out = []
    for i, frame in enumerate(frames):
        assert len(frame) == 3, "multipart [topic, seq, payload]"
        topic, seq, payload = frame
        assert topic == b"kv"
        assert len(seq) == 8 and int.from_bytes(seq, "big") == first_seq + i, "seq: 8 bytes BE, consecutive"
        batch = msgpack.unpackb(payload, raw=False)
        assert isinstance(batch, list) and len(batch) == 2, "KVEventBatch as an array [ts, events]"
        ts, events = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 120
        assert events, "no empty batches"
        out.append(events)
    _decode_with_vllm(frames, out)
    return out


def _decode_with_vllm(frames: list[list[bytes]], plain: list[list[dict[str, Any]]]) -> None:
    """vLLM's own decoder reads every payload to the same events (when vLLM is installed)."""
    msgspec = pytest.importorskip("msgspec")
    try:
        from vllm.distributed import kv_events as vk
    except ImportError:
        return  # the plain msgpack decode still ran; make test installs vLLM
    dec = msgspec.msgpack.Decoder(vk.KVEventBatch)
    for frame, events in zip(frames, plain, strict=True):
        batch = dec.decode(frame[2])
        assert batch.data_parallel_rank is None
        assert len(batch.events) == len(events)
        for got, want in zip(batch.events, events, strict=True):
            assert type(got).__name__ == want["type"]
            if isinstance(got, vk.BlockStored):
                assert list(got.block_hashes) == want["block_hashes"]
                assert got.parent_block_hash == want["parent_block_hash"]
                assert list(got.token_ids) == want["token_ids"] and got.block_size == want["block_size"]
                assert (got.lora_id, got.lora_name, got.medium) == (
                    want["lora_id"],
                    want["lora_name"],
                    want["medium"],
                )
                keys = [None if k is None else list(k) for k in got.extra_keys or []]
                assert keys == want["extra_keys"] and got.group_idx == want["group_idx"]
            elif isinstance(got, vk.BlockRemoved):
                assert list(got.block_hashes) == want["block_hashes"] and got.medium == "GPU"
            else:
                assert isinstance(got, vk.AllBlocksCleared)


def expected(e: Event, lora_ids: dict[str, int]) -> dict[str, Any]:
    """The wire form vLLM 0.32 gives an engine change (msgspec tagged struct, defaults omitted)."""
    if isinstance(e, Stored):
        lora = e.lora or None
        salt = [e.salt] if e.salt else []
        extra = [([e.lora] if lora else []) + (salt if i == 0 else []) or None for i in range(len(e.hashes))]
        return {
            "type": "BlockStored",
            "block_hashes": e.hashes,
            "parent_block_hash": e.parent,
            "token_ids": e.token_ids,
            "block_size": BS,
            "lora_id": lora_ids[e.lora] if lora else None,
            "medium": "GPU",
            "lora_name": lora,
            "extra_keys": extra,
            "group_idx": 0,
        }
    if isinstance(e, Removed):
        return {"type": "BlockRemoved", "block_hashes": [e.block_hash], "medium": "GPU", "group_idx": 0}
    assert isinstance(e, Cleared)
    return {"type": "AllBlocksCleared"}


class Consumer:
    """What a precise-mode subscriber knows: a multiset of cached hashes, rebuilt from events,
    with each stored hash recomputed from its token ids (llm-d's practice:
    docs/design.md#vllm-facts)."""

    def __init__(self) -> None:
        self.cached: collections.Counter[int] = collections.Counter()

    def apply(self, ev: dict[str, Any]) -> None:
        if ev["type"] == "BlockStored":
            lora = ev["lora_name"] or ""
            ids, parent = ev["token_ids"], ev["parent_block_hash"]
            assert len(ids) == BS * len(ev["block_hashes"]), "full blocks only"
            if parent is None:
                first = list(ev["extra_keys"][0] or [])[1 if lora else 0 :]
                want = chain_hashes(ids, BS, lora, first[0] if first else "")
            else:
                assert ev["parent_block_hash"] in self.cached, "a stored block's parent is cached"
                want = chain_hashes([0] * BS + ids, BS, lora, "", 1, parent)
            assert ev["block_hashes"] == want, "hashes recomputed from token_ids agree"
            self.cached.update(ev["block_hashes"])
        elif ev["type"] == "BlockRemoved":
            for h in ev["block_hashes"]:
                assert self.cached[h] > 0, f"removed {h}, which is not cached"
                self.cached[h] -= 1
            self.cached = +self.cached
        else:
            self.cached.clear()


# --- the engine, replayed in process -------------------------------------------------------------


class Replay:
    """The replica's engine in process: each request alone, stepped until it finishes."""

    def __init__(self, num_gpu_blocks: int) -> None:
        self.batches: list[list[Event]] = []
        self.states: list[collections.Counter[int]] = []
        self.core = EngineCore(profile("cpu-test"), EngineConfig(BS, num_gpu_blocks), self._on_events)

    def _on_events(self, events: list[Event]) -> None:
        if events:
            self.batches.append(events)
            self.states.append(self.pool_state())

    def pool_state(self) -> collections.Counter[int]:
        """The pool's cached hashes, read from its blocks (not from its event log)."""
        return collections.Counter(b.block_hash for b in self.core.pool.blocks if b.block_hash is not None)

    def run(self, prompt: list[int], max_tokens: int, lora: str = "", salt: str = "") -> int:
        req = Request(prompt, max_tokens, BS, lora, salt)
        self.core.sched.add(req)
        t = 0.0
        while not req.finished:
            step = self.core.begin(t)
            assert step is not None
            t += step.duration
            self.core.end(step, t)
        self.core.pool.check()
        return req.num_cached_tokens

    def reset(self) -> None:
        assert self.core.pool.reset()
        self._on_events(self.core.pool.take_events())


def compare(
    got: list[list[dict[str, Any]]], replay: Replay, lora_ids: dict[str, int], start: int = 0
) -> Consumer:
    """Message i carries exactly step i's changes, in order; after applying it, the consumer's
    view equals the replayed pool's cached hashes."""
    want = [[expected(e, lora_ids) for e in b] for b in replay.batches[start:]]
    assert len(got) == len(want), (len(got), len(want))
    consumer = Consumer()
    for i, (g, w, state) in enumerate(zip(got, want, replay.states[start:], strict=True)):
        assert g == w, f"message {i}"
        for ev in g:
            consumer.apply(ev)
        assert consumer.cached == state, f"after message {i} the subscriber's view is the pool's"
    return consumer


def ids(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


# --- tests ---------------------------------------------------------------------------------------


def test_events_match_the_engine_block_changes_worked_by_hand(tmp_path: pathlib.Path) -> None:
    """6 blocks (5 usable): prompt A (74 tokens + 2 outputs = 5 blocks) is cached, then prompt B
    needs all 5 blocks, which come off the free queue in the order A released them (last block
    first, vLLM's order), evicting A's 4 cached blocks last-to-first before B's are stored."""
    a, b = tokenizer.encode(PROMPT), tokenizer.encode("A different prompt evicts the first. " * 8)
    assert len(a) == len(b) == 74
    ha, hb = chain_hashes(a, BS), chain_hashes(b, BS)
    with simulator(tmp_path, "--num-gpu-blocks", "6") as sim:
        assert sim.complete(PROMPT, 2)["usage"]["prompt_tokens"] == 74
        sim.complete("A different prompt evicts the first. " * 8, 2)
        got = decode(sim.frames())

    def stored(hashes: list[int], toks: list[int]) -> dict[str, Any]:
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": toks[:64],
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None] * 4,
            "group_idx": 0,
        }

    removed = [
        {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0} for h in ha[::-1]
    ]
    assert got == [[stored(ha, a)], [*removed, stored(hb, b)]]


def test_whole_stream_matches_the_engine_replayed_in_process(tmp_path: pathlib.Path) -> None:
    """Shared prefixes (hits), output tokens filling blocks, a LoRA adapter, cache salts and
    evictions in a 24-block pool: every message equals the replayed engine's changes of that step."""
    lora_ids = {"ad1": 1, "ad2": 2}
    base = ids(1, 80)
    workload: list[tuple[list[int], int, str, str]] = [
        (base + ids(500, 20), 20, "", ""),  # 6 blocks, outputs complete a 7th
        (base + ids(600, 40), 3, "", ""),  # hits the 5 blocks of `base`
        (base + ids(500, 20), 1, "ad1", ""),  # same tokens under a LoRA: no hit
        (base + ids(700, 8), 2, "", "s1"),  # salted: no hit on block 0, hence none
        (base + ids(700, 8), 2, "", "s1"),  # same salt: hits
        (ids(2000, 200), 2, "ad2", "s2"),  # 13 blocks: evicts
        (base + ids(500, 20), 30, "", ""),  # back to the first prompt, partly evicted
        (ids(3000, 17), 40, "ad1", "s3"),  # outputs fill blocks under a LoRA
    ]
    replay = Replay(24)
    with simulator(tmp_path, "--num-gpu-blocks", "24", "--lora-modules", "ad1", "ad2") as sim:
        for prompt, n, lora, salt in workload:
            extra = {"model": lora} if lora else {}
            body = sim.complete(prompt, n, **({"cache_salt": salt} if salt else {}), **extra)
            cached = replay.run(prompt, n, lora, salt)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        got = decode(sim.frames())
    kinds = collections.Counter(e["type"] for m in got for e in m)
    assert kinds["BlockStored"] >= 8 and kinds["BlockRemoved"] > 0, kinds
    assert any(e.get("lora_name") == "ad2" and e["extra_keys"][0] == ["ad2", "s2"] for m in got for e in m)
    consumer = compare(got, replay, lora_ids)
    assert consumer.cached == replay.pool_state() and consumer.cached


def test_reset_prefix_cache_emits_all_blocks_cleared(tmp_path: pathlib.Path) -> None:
    """POST /reset_prefix_cache is refused (409, no event) while a request holds blocks; once idle
    it succeeds with one AllBlocksCleared message, and the cleared blocks are then reused without
    BlockRemoved (vLLM drops their hashes at reset)."""
    replay = Replay(12)
    prompt = ids(1, 40)
    with simulator(tmp_path, "--num-gpu-blocks", "12", "--time-scale", "20") as sim:
        sim.complete(prompt, 2)
        replay.run(prompt, 2)
        host, port = sim.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        body = {"model": MODEL, "prompt": ids(100, 20), "max_tokens": 30, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: "), "the request is running"
        status, doc = post_json(sim.url + "/reset_prefix_cache", {})
        assert (status, doc) == (409, {"reset": False})
        rest = resp.read()
        conn.close()
        assert rest.rstrip().endswith(b"data: [DONE]")
        replay.run(ids(100, 20), 30)
        before = len(replay.batches)
        assert post_json(sim.url + "/reset_prefix_cache", {}) == (200, {"reset": True})
        replay.reset()
        assert sim.complete(prompt, 2)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert replay.run(prompt, 2) == 0
        got = decode(sim.frames())
    consumer = compare(got, replay, {})
    assert got[before] == [{"type": "AllBlocksCleared"}], "the reset is one message of its own"
    after = [e for m in got[before + 1 :] for e in m]
    assert [e["type"] for e in after] == ["BlockStored"], "cleared blocks are reused without BlockRemoved"
    assert after[0]["block_hashes"] == chain_hashes(prompt, BS)
    assert consumer.cached == collections.Counter(chain_hashes(prompt, BS))

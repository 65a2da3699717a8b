"""The picker's KV-event subscriber against simulator processes publishing vLLM's wire format.

Requests are sent one at a time, so the replica's block changes are deterministic and an
in-process engine (``tests.sim.test_kv_events.Replay``) gives the replica's true cache contents
after every message. Checked: the index equals them (with evictions, LoRA, salts), predicted
cached tokens equal the replica's reported ``cached_tokens``, and gaps (late join, a lost
message), replay, ``AllBlocksCleared`` and a replica restart are handled.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kvlaunch import PY, Procs, free_port, post_json, wait_port
from picker.core.prefix.precise import PreciseIndex, State, request_keys
from picker.feeds.events import Subscriber
from replica.sim.blocks import chain_hashes
from tests.sim.test_kv_events import MODEL, Replay, ids
from tests.support.events import subscriber

pytestmark = pytest.mark.precise
BS = 16
KEY = "127.0.0.1:sim"


@dataclass
class Sim:
    procs: Procs
    port: int
    ev_port: int
    replay_port: int
    blocks: int

    def start(self) -> None:
        args = ["--port", str(self.port), "--profile", "cpu-test", "--kv-events-port", str(self.ev_port)]
        args += ["--kv-events-replay-port", str(self.replay_port), "--num-gpu-blocks", str(self.blocks)]
        args += ["--lora-modules", "ad1", "--time-scale", "0.2"]
        proc = self.procs.start("sim", [PY, "-m", "replica.sim", *args])
        wait_port(self.port, proc=proc)

    async def complete(self, prompt: list[int], max_tokens: int, **extra: Any) -> int:
        doc = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}
        status, body = await asyncio.to_thread(post_json, f"http://127.0.0.1:{self.port}/v1/completions", doc)
        assert status == 200, body
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert isinstance(cached, int)
        return cached


@contextlib.asynccontextmanager
async def sim(tmp_path: pathlib.Path, blocks: int = 24) -> AsyncIterator[Sim]:
    procs = Procs(tmp_path)
    s = Sim(procs, free_port(), free_port(), free_port(), blocks)
    try:
        s.start()
        yield s
    finally:
        procs.stop()


@contextlib.asynccontextmanager
async def subscribed(s: Sim, replay: bool = True, refill_s: float = 30.0) -> AsyncIterator[Subscriber]:
    async with subscriber(KEY, s.ev_port, s.replay_port if replay else None, refill_s) as sub:
        await asyncio.sleep(0.5)  # slow joiner: the subscription reaches the publisher
        yield sub


async def settle(sub: Subscriber, messages: int, timeout: float = 10.0) -> None:
    """Wait until the subscriber has taken in ``messages`` messages."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (sub.sync.expected or 0) < messages:
        assert loop.time() < deadline, f"subscriber at {sub.sync.expected}, want {messages}"
        await asyncio.sleep(0.02)


def our_keys(replay: Replay, requests: list[tuple[list[int], str, str]]) -> Callable[[int], int]:
    """Engine hash → our key, over every block the workload made (prompt and output tokens)."""
    table: dict[int, int] = {}
    for toks, lora, salt in requests:
        table.update(zip(chain_hashes(toks, BS, lora, salt), request_keys(toks, BS, lora, salt), strict=True))
    return table.__getitem__


def assert_index_is_the_pool(sub: Subscriber, replay: Replay, seen: list[tuple[list[int], str, str]]) -> None:
    truth = set(replay.pool_state())
    assert sub.index.engine_hashes(KEY) == truth, "the index holds exactly the replica's cached blocks"
    to_ours = our_keys(replay, seen)
    assert sub.index.holds(KEY) == {to_ours(h) for h in truth}, "under our own keys"
    sub.index.check()


WORKLOAD: list[tuple[list[int], int, str, str]] = [
    (ids(1, 80) + ids(500, 20), 20, "", ""),
    (ids(1, 80) + ids(600, 40), 3, "", ""),  # hits `base`
    (ids(1, 80) + ids(500, 20), 1, "ad1", ""),  # LoRA: no hit
    (ids(1, 80) + ids(700, 8), 2, "", "s1"),  # salted: no hit
    (ids(1, 80) + ids(700, 8), 2, "", "s1"),  # same salt: hit
    (ids(2000, 200), 2, "", "s2"),  # 13 blocks: evicts
    (ids(1, 80) + ids(500, 20), 30, "", ""),  # partly evicted
    (ids(3000, 17), 40, "ad1", "s3"),  # outputs fill blocks under a LoRA
    (ids(1, 80) + ids(600, 40), 3, "", ""),
    (ids(2000, 100), 2, "", "s2"),
]


async def run_workload(
    s: Sim,
    sub: Subscriber,
    replay: Replay,
    workload: list[tuple[list[int], int, str, str]],
    seen: list[tuple[list[int], str, str]] | None = None,
) -> tuple[int, list[tuple[list[int], str, str]]]:
    """Send each request after predicting its cached tokens; returns (exact predictions, blocks
    seen). ``seen``: what was sent before (for our-key lookups)."""
    exact, seen = 0, list(seen or [])
    for prompt, n, lora, salt in workload:
        keys = request_keys(prompt, BS, lora, salt)
        predicted = sub.index.match_many([KEY], keys, 0.0)[KEY] * BS
        predicted = min(predicted, (len(prompt) - 1) // BS * BS)  # a full hit recomputes the last token
        extra: dict[str, Any] = {"model": lora} if lora else {}
        if salt:
            extra["cache_salt"] = salt
        cached = await s.complete(prompt, n, **extra)
        assert cached == replay.run(prompt, n, lora, salt), "the replay is the replica"
        assert abs(predicted - cached) <= BS, f"predicted {predicted}, replica cached {cached}"
        exact += predicted == cached
        seen.append((prompt + replay_outputs(replay, prompt, n), lora, salt))
        await settle(sub, len(replay.batches))
        assert_index_is_the_pool(sub, replay, seen)
    return exact, seen


def replay_outputs(replay: Replay, prompt: list[int], n: int) -> list[int]:
    from replica.sim import tokenizer

    return [tokenizer.output_token(i) for i in range(n)]


async def test_index_equals_the_replica_cache_through_evictions(tmp_path: pathlib.Path) -> None:
    replay = Replay(24)
    async with sim(tmp_path) as s, subscribed(s) as sub:
        exact, _ = await run_workload(s, sub, replay, WORKLOAD)
        assert sub.sync.state is State.SYNCED and sub.sync.gaps == 0 and sub.sync.bad == 0
    assert exact == len(WORKLOAD), "every prediction exact on the simulator"
    kinds = {type(e).__name__ for b in replay.batches for e in b}
    assert {"Stored", "Removed"} <= kinds, "the run included evictions"


async def test_all_blocks_cleared_empties_the_index(tmp_path: pathlib.Path) -> None:
    replay = Replay(24)
    async with sim(tmp_path) as s, subscribed(s) as sub:
        await run_workload(s, sub, replay, WORKLOAD[:2])
        assert sub.index.size(KEY) > 0
        assert post_json(f"http://127.0.0.1:{s.port}/reset_prefix_cache", {}) == (200, {"reset": True})
        replay.reset()
        await settle(sub, len(replay.batches))
        assert sub.index.size(KEY) == 0 and sub.sync.state is State.SYNCED


async def test_late_join_resyncs_through_replay(tmp_path: pathlib.Path) -> None:
    """The subscriber starts after 3 requests: its first message is not seq 0, a gap it fills
    from the replica's replay endpoint, ending exact."""
    replay = Replay(24)
    async with sim(tmp_path) as s:
        before = []
        for prompt, n, lora, salt in WORKLOAD[:3]:
            await s.complete(prompt, n, **({"model": lora} if lora else {}))
            replay.run(prompt, n, lora, salt)
            before.append((prompt + replay_outputs(replay, prompt, n), lora, salt))
        async with subscribed(s) as sub:
            exact, _ = await run_workload(s, sub, replay, WORKLOAD[3:], before)
            assert sub.sync.gaps == 1 and sub.sync.state is State.SYNCED
    assert exact >= len(WORKLOAD) - 4, "exact after the replay (the first prediction may miss)"


async def test_late_join_without_replay_falls_back_then_refills(tmp_path: pathlib.Path) -> None:
    replay = Replay(24)
    async with sim(tmp_path) as s:
        for prompt, n, lora, salt in WORKLOAD[:2]:
            await s.complete(prompt, n)
            replay.run(prompt, n, lora, salt)
        async with subscribed(s, replay=False, refill_s=0.0) as sub:
            prompt, n, _, _ = WORKLOAD[5]
            await s.complete(prompt, n, cache_salt="s2")
            replay.run(prompt, n, "", "s2")
            await settle(sub, len(replay.batches))
            assert sub.sync.gaps == 1
            # entries dropped at the gap, then this request's new blocks refilled the index
            assert sub.index.engine_hashes(KEY) <= set(replay.pool_state())
            assert sub.index.engine_hashes(KEY) == set(chain_hashes(prompt, BS, "", "s2"))
            assert sub.sync.state is State.SYNCED, "refill_s 0: precise again after the next message"


async def test_lost_message_is_replayed(tmp_path: pathlib.Path) -> None:
    """A message lost between publisher and subscriber (dropped here on purpose from a plain SUB
    feed) is a gap: the subscriber fetches it from the replay endpoint and stays exact."""
    replay = Replay(24)
    async with sim(tmp_path) as s:
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.SUB)
        raw.setsockopt(zmq.SUBSCRIBE, b"")
        raw.connect(f"tcp://127.0.0.1:{s.ev_port}")
        await asyncio.sleep(0.5)
        sub = Subscriber(KEY, PreciseIndex(), "unused", f"tcp://127.0.0.1:{s.replay_port}", ctx=ctx)
        try:
            for prompt, n, lora, salt in WORKLOAD[:6]:
                extra: dict[str, Any] = {"model": lora} if lora else {}
                await s.complete(prompt, n, **extra, **({"cache_salt": salt} if salt else {}))
                replay.run(prompt, n, lora, salt)
            frames = []
            while await raw.poll(500):
                frames.append(await raw.recv_multipart())
            assert len(frames) == len(replay.batches) >= 4
            for i, (_, seq, payload) in enumerate(frames):
                if i != 2:
                    await sub.on_message(int.from_bytes(seq, "big"), payload)
            assert sub.sync.gaps == 1 and sub.sync.state is State.SYNCED
            assert sub.index.engine_hashes(KEY) == set(replay.pool_state())
        finally:
            raw.close(linger=0)
            ctx.term()


async def test_lost_message_without_replay_drops_the_endpoint() -> None:
    from replica.sim.blocks import Stored as SimStored
    from tests.precise.test_index import payload

    now = [0.0]
    sub = Subscriber(KEY, PreciseIndex(), "unused", None, refill_s=5.0, clock=lambda: now[0])
    a, b = ids(1, 32), ids(100, 32)
    await sub.on_message(0, payload(SimStored(chain_hashes(a, BS), None, a, "", "")))
    assert sub.sync.state is State.SYNCED and sub.index.size(KEY) == 2
    await sub.on_message(2, payload(SimStored(chain_hashes(b, BS), None, b, "", "")))
    assert sub.sync.state is State.REFILL and sub.index.engine_hashes(KEY) == set(chain_hashes(b, BS))
    now[0] = 6.0
    await sub.on_message(3, payload(SimStored(chain_hashes(a, BS), None, a, "", "")))
    assert sub.sync.state is State.SYNCED and sub.index.size(KEY) == 4
    await sub.on_message(4, b"not msgpack \xc1")
    assert sub.sync.bad == 1 and sub.sync.state is State.REFILL and sub.index.size(KEY) == 0


async def test_replica_restart_is_detected_and_the_index_restarts(tmp_path: pathlib.Path) -> None:
    """The replica is killed and started again on the same ports: its publisher counts from 0
    again (an empty cache); the subscriber (reconnected by ZMQ) drops the old entries."""
    replay = Replay(24)
    async with sim(tmp_path) as s, subscribed(s) as sub:
        await run_workload(s, sub, replay, WORKLOAD[:4])
        assert sub.index.size(KEY) > 0
        s.procs.stop("sim")
        s.start()
        await asyncio.sleep(2.0)  # ZMQ reconnects the SUB socket (within RECONNECT_IVL_MAX_MS)
        replay = Replay(24)
        prompt, n, _, _ = WORKLOAD[0]
        await s.complete(prompt, n)
        replay.run(prompt, n)
        await settle(sub, len(replay.batches))
        assert sub.sync.restarts == 1 and sub.sync.state is State.SYNCED
        assert sub.index.engine_hashes(KEY) == set(replay.pool_state())

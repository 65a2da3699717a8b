"""vLLM's ``/tokenize`` as the precise mode's tokenizer of last resort (``picker.feeds.remote_tokenizer``),
against the simulator's ``/tokenize`` (vLLM's request and answer shapes; the simulator's own
tokenizer): the ids equal those the replica serves the request with, repeats are cached, and a
slow, failing or unusable answer gives None (approximate matching), never an error. Then the
picker process in precise mode with no tokenizer, behind a real Envoy: text prompts are matched
from the KV events, and the predicted cached tokens equal what the replica reports.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from kvlaunch import Procs, Stack, free_port, http
from picker.feeds.remote_tokenizer import RemoteTokenizer, tokenize_body
from replica.sim import tokenizer as sim_tokenizer
from tests.precise.test_picker_precise import HOSTS, MODEL, debug, start_sim, wait_for

pytestmark = [pytest.mark.precise]
TEXT = "".join(f"w{i:03d}" for i in range(16 * 12))  # 12 blocks of 16 four-character tokens


@pytest.fixture
def sim(tmp_path: pathlib.Path) -> AsyncIterator[str]:
    procs, port = Procs(tmp_path), free_port()
    try:
        start_sim(procs, "127.0.0.1", port, free_port())
        yield f"127.0.0.1:{port}"
    finally:
        procs.stop()


async def test_ids_are_the_replicas_and_repeats_are_cached(sim: str) -> None:
    tok = RemoteTokenizer(timeout_s=2.0)
    try:
        ids = await tok.encode(MODEL, {"prompt": TEXT + " why?"}, "/v1/completions", sim)
        assert ids == sim_tokenizer.encode(TEXT + " why?")
        msgs = [
            {"role": "system", "content": TEXT},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ]
        chat = await tok.encode(MODEL, {"messages": msgs}, "/v1/chat/completions", sim)
        status, body, _ = http(
            "POST",
            f"http://{sim}/v1/chat/completions",
            json.dumps({"model": MODEL, "messages": msgs, "max_tokens": 1}).encode(),
            {"content-type": "application/json"},
        )
        assert status == 200 and chat is not None
        assert len(chat) == json.loads(body)["usage"]["prompt_tokens"]
        assert (tok.calls, tok.hits) == (2, 0)
        again = await tok.encode(MODEL, {"prompt": TEXT + " why?"}, "/v1/completions", sim)
        assert again == ids and (tok.calls, tok.hits) == (2, 1), "a repeated prompt costs no round trip"
        assert await tok.encode("no-such-model", {"prompt": "x"}, "/v1/completions", sim) is None
        assert tok.failures == 1 and tok.seconds > 0
    finally:
        await tok.close()


def test_unusable_bodies_are_not_sent() -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    assert tokenize_body(MODEL, {"messages": image}, "/v1/chat/completions") is None
    assert tokenize_body(MODEL, {"prompt": ["a", "b"]}, "/v1/completions") is None
    assert tokenize_body(MODEL, {"prompt": [1, 2]}, "/v1/completions") is None
    body = tokenize_body(MODEL, {"prompt": "hi", "max_tokens": 3}, "/v1/completions")
    assert body is not None and json.loads(body) == {
        "model": MODEL,
        "prompt": "hi",
        "add_special_tokens": True,
    }
    chat = tokenize_body(MODEL, {"messages": [], "tools": [], "stream": True}, "/v1/chat/completions?x=1")
    assert chat is not None and json.loads(chat) == {"model": MODEL, "messages": [], "tools": []}


async def test_slow_or_bad_answers_give_none_within_the_bound() -> None:
    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({"tokens": [1]})

    async def bad(_: web.Request) -> web.Response:
        return web.json_response({"tokens": [1, -2]})

    app = web.Application()
    app.router.add_post("/slow/tokenize", slow)
    app.router.add_post("/bad/tokenize", bad)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    tok = RemoteTokenizer(timeout_s=0.2)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await tok.encode(MODEL, {"prompt": "x"}, "/v1/completions", f"127.0.0.1:{port}/slow") is None
        assert loop.time() - t0 < 1.0, "the timeout bounds the wait"
        assert await tok.encode(MODEL, {"prompt": "x"}, "/v1/completions", f"127.0.0.1:{port}/bad") is None
        assert await tok.encode(MODEL, {"prompt": "x"}, "/v1/completions", f"127.0.0.1:{free_port()}") is None
        assert tok.failures == 3 and tok.hits == 0
    finally:
        await tok.close()
        await runner.cleanup()


@pytest.mark.envoy
@pytest.mark.timeout(240)
def test_precise_text_prompts_without_a_tokenizer(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    ports, ev = [free_port(), free_port()], free_port()
    st = Stack(procs, ports)
    try:
        for host, port in zip(HOSTS, ports, strict=True):
            start_sim(procs, host, port, ev)
        eps = ",".join(f"{h}:{p}" for h, p in zip(HOSTS, ports, strict=True))
        # The default 0.5 s bound is for a serving replica; a loaded 2-core CI machine answered the
        # first /tokenize (a new connection to a Python sim) slower than that once, the request
        # then fell back to approximate matching, and the two endpoints tied at no match.
        cfg = tmp_path / "picker.yaml"
        cfg.write_text("prefix: {remote_tokenize_timeout_s: 10}\n")
        st.start_picker(
            "--endpoints",
            eps,
            "--prefix-mode",
            "precise",
            "--kv-events-port",
            str(ev),
            "--config-file",
            str(cfg),
        )
        st.start_envoy()
        wait_for(lambda: all(e["health"] == "ready" for e in st.endpoints().values()), "endpoints ready")
        body = {"model": MODEL, "prompt": TEXT + "q000", "max_tokens": 2}
        status, out, _ = http("POST", st.url + "/v1/completions", json.dumps(body).encode())
        assert status == 200, out
        wait_for(lambda: sum(e.get("precise_blocks", 0) for e in st.endpoints().values()) >= 12, "events in")
        holder = next(k for k, e in st.endpoints().items() if e.get("precise_blocks", 0) >= 12)
        for q in range(1, 4):
            body = {"model": MODEL, "prompt": TEXT + f"q{q:03d}", "max_tokens": 2}
            ex = debug(st, "explain", body)
            row = ex["endpoints"][holder]
            assert row["prefix_source"] == "precise", row
            assert ex["chosen"] == [holder], ex["endpoints"]
            assert row["matched_blocks"] == 12, row
            status, out, _ = http("POST", st.url + "/v1/completions", json.dumps(body).encode())
            assert status == 200, out
            cached = json.loads(out)["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == row["cached_tokens_est"] == 12 * 16, (cached, row)
    finally:
        procs.stop()

"""Progressive tokenization in the routing path (``picker.serving.tokenization``), in process, with
a real tokenizer and the real router, director and precise index (four endpoints whose event
streams are synced):

- a cold long prompt is tokenized one chunk, and routed with an estimate of its length;
- a burst of 16 siblings of a cold ~100k-token prompt lands on one endpoint, as whole-prompt
  tokenization does;
- the next turn of a conversation its endpoint holds tokenizes only what the cache lacks;
- no request holds more than ``max_prompt_tokens`` (plus one chunk) ids.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
from collections import Counter
from typing import Any

import pytest

from picker.core.config import PrefixConfig, RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint
from picker.core.prefix.precise import State, Sync, request_keys
from picker.core.router import Router
from picker.serving.director import Director
from replica.tinymodel import _corpus
from tests.support import picking
from tests.support.tokenizer import STRING_TEMPLATE, tokenizer_dir

pytestmark = pytest.mark.precise
BS = 16
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tokenizer_dir(tmp_path_factory.mktemp("progtok"), STRING_TEMPLATE)


def director(tok_dir: pathlib.Path, **prefix: Any) -> Director:
    pool = Pool()
    pool.set_endpoints([Endpoint(f"10.0.0.{i}", 8000) for i in range(1, 5)])
    cfg = RouterConfig(
        prefix=PrefixConfig(
            mode="precise", block_size=BS, tokenizer=str(tok_dir), tokenize_inline_bytes=0, **prefix
        )
    )
    router = Router(cfg, pool)
    for s in pool:
        router.syncs[s.key] = Sync(State.SYNCED, expected=0)
    return picking.director(router)


def document(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of the test tokenizer."""
    return " ".join(_corpus(tokens // 45 + 10, seed=seed))


async def route(d: Director, doc: dict[str, Any]) -> tuple[str, Any]:
    body = json.dumps({"model": "m", **doc}).encode()
    parsed = await d.prepare([body], len(body), {":path": CHAT, "x-request-id": str(random.random())})
    pick, _ = d.pick(parsed)
    return pick.chosen[0], parsed[0]


def whole_ids(d: Director, doc: dict[str, Any]) -> list[int]:
    local = d.tokenization.local
    assert local is not None
    got = local.prompt_text({"model": "m", **doc}, CHAT)
    assert got is not None
    return local.tok.encode(got[0], add_special_tokens=False).ids


async def test_a_cold_prompt_costs_one_chunk_and_an_estimate(tok_dir: pathlib.Path) -> None:
    d = director(tok_dir, tokenize_chunk_chars=8192)
    doc = {"messages": [{"role": "user", "content": document(60_000, 1)}]}
    _, req = await route(d, doc)
    whole = whole_ids(d, doc)
    assert list(req.prompt_token_ids) == whole[: len(req.prompt_token_ids)], (
        "exactly the whole tokenization's prefix"
    )
    assert len(req.prompt_token_ids) < 8192, "one chunk (8192 characters) tokenized, not the prompt"
    error = abs(req.prompt_token_estimate - len(whole)) / len(whole)
    assert error < 0.1, (req.prompt_token_estimate, len(whole))


async def test_a_burst_of_siblings_of_a_cold_long_prompt_sticks(tok_dir: pathlib.Path) -> None:
    d = director(tok_dir)
    shared = document(100_000, 2)
    bodies = [
        {"messages": [{"role": "system", "content": shared}, {"role": "user", "content": f"question {i}?"}]}
        for i in range(16)
    ]
    picks = await asyncio.gather(*(route(d, b) for b in bodies))
    where = Counter(key for key, _ in picks)
    assert len(where) == 1, f"all 16 siblings on one endpoint: {where}"
    n_whole = len(whole_ids(d, bodies[0]))
    assert n_whole > 90_000, n_whole
    tokenized = [len(r.prompt_token_ids) for _, r in picks]
    assert tokenized[0] < 20_000, "the first, cold, tokenized one chunk"


async def test_the_next_turn_tokenizes_only_its_suffix(tok_dir: pathlib.Path) -> None:
    d = director(tok_dir)
    local = d.tokenization.local
    assert local is not None
    history = [{"role": "system", "content": document(40_000, 3)}]
    encoded: list[int] = []
    plain = local._encode_plain  # type: ignore[attr-defined]

    def spy(text: str) -> Any:
        encoded.append(len(text))
        return plain(text)

    local._encode_plain = spy  # type: ignore[attr-defined]
    endpoints = set()
    precise = d.router.precise
    assert precise is not None
    for turn in range(5):
        history.append({"role": "user", "content": " ".join(_corpus(40, seed=100 + turn))})
        encoded.clear()
        key, req = await route(d, {"messages": list(history)})
        endpoints.add(key)
        whole = whole_ids(d, {"messages": history})
        assert list(req.prompt_token_ids) == whole[: len(req.prompt_token_ids)]
        if turn:  # its endpoint holds the history: tokenized to the end
            assert list(req.prompt_token_ids) == whole, "the whole prompt, exactly"
        if turn >= 2:  # the history's ids come from the cache
            assert sum(encoded) < 2 * 16384, f"turn {turn} re-tokenized {sum(encoded)} characters"
        # the engine's KV events: the endpoint now holds the whole prompt (as BlockStored says)
        precise.speculate(key, request_keys(whole, BS), d.router.clock() + 60)
        history.append({"role": "assistant", "content": f"answer {turn}"})
    assert len(endpoints) == 1, "the conversation stays where its prefix is"


async def test_no_request_holds_more_than_the_bound(tok_dir: pathlib.Path) -> None:
    d = director(tok_dir, max_prompt_tokens=5000, tokenize_chunk_chars=4096)
    doc = {"messages": [{"role": "user", "content": document(30_000, 4)}]}
    await route(d, doc)  # its blocks are now held (speculatively) on its endpoint
    _, req = await route(d, doc)
    assert 5000 <= len(req.prompt_token_ids) < 5000 + 4096 * 4, len(req.prompt_token_ids)
    assert req.prompt_token_estimate > 25_000

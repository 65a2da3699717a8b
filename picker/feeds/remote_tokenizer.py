"""vLLM's ``/tokenize`` as the tokenizer of last resort: precise mode with no local tokenizer.

The picker asks a ready replica (they all serve the model, so any gives the same ids) for the token
ids of the request's prompt, with vLLM's own semantics: ``/v1/completions`` bodies become
``{"model", "prompt", "add_special_tokens"}`` (default true, as vLLM's completions), chat bodies
``{"model", "messages", ...}`` with the chat fields vLLM's ``TokenizeChatRequest`` takes (its
``add_special_tokens`` default false: the template writes its own). vLLM answers
``{"count", "max_model_len", "tokens"}``.

- Bounded: one POST of at most ``timeout_s`` (0.5 s). A timeout, an error status or a malformed
  answer gives None, and the request is matched approximately; it is never failed for it.
- Cached: the ids of the last ``cache_entries`` tokenize bodies (keyed by their xxh3-64 and
  length; ids kept as 4-byte arrays, at most ``cache_tokens`` in all), so a repeated prompt costs
  no round trip. Unlike the local tokenizer, a shared prefix alone is not reused: each new prompt
  costs one round trip (its cost against vLLM-CPU: bench/results/2026-11-27-readme-archive.md).
- Media (non-text content parts) and prompt lists give None: vLLM's multimodal blocks carry
  extra hash keys the picker does not reproduce.

I/O goes through ``post`` (url, body → status, body), injectable for tests; the default is one
aiohttp session, closed by :meth:`close`. State: the cache and the counters, written by
:meth:`encode` only (on the event loop).
"""

from __future__ import annotations

import array
import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import xxhash

Post = Callable[[str, bytes, float], Awaitable[tuple[int, bytes]]]
CHAT_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)
"""Chat body fields that change the rendered prompt, passed to ``/tokenize`` as given."""
MAX_TOKENS = 1 << 22
"""Longest answer taken (4M ids)."""


def tokenize_body(model: str, doc: dict[str, Any], path: str) -> bytes | None:
    """The ``/tokenize`` request for this OpenAI body, or None when it cannot be asked for."""
    if path.split("?", 1)[0].endswith("/chat/completions"):
        msgs = doc.get("messages")
        if not isinstance(msgs, list) or not all(_text_only(m) for m in msgs):
            return None
        out = {k: doc[k] for k in CHAT_FIELDS if k in doc}
    else:
        prompt = doc.get("prompt")
        if not isinstance(prompt, str):
            return None
        out = {"prompt": prompt, "add_special_tokens": doc.get("add_special_tokens", True)}
    return orjson.dumps({"model": model, **out})


def _text_only(msg: Any) -> bool:
    if not isinstance(msg, dict):
        return False
    content = msg.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)


class RemoteTokenizer:
    def __init__(
        self,
        timeout_s: float = 0.5,
        cache_entries: int = 256,
        cache_tokens: int = 4_000_000,
        post: Post | None = None,
    ) -> None:
        self.timeout_s, self.cache_entries, self.cache_tokens = timeout_s, cache_entries, cache_tokens
        self._post = post or self._aiohttp_post
        self._session: aiohttp.ClientSession | None = None
        self._cache: OrderedDict[tuple[int, int], array.array[int]] = OrderedDict()
        self._cached_tokens = 0
        self.calls = self.hits = self.failures = 0
        self.seconds = 0.0
        """Total time spent waiting on replicas (``seconds / calls``: the cost per round trip)."""

    async def encode(self, model: str, doc: dict[str, Any], path: str, endpoint: str) -> list[int] | None:
        """The prompt's token ids from ``endpoint``'s ``/tokenize`` (or the cache), or None."""
        body = tokenize_body(model, doc, path)
        if body is None:
            return None
        key = (xxhash.xxh3_64_intdigest(body), len(body))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit.tolist()
        self.calls += 1
        t0 = time.perf_counter()
        try:
            status, raw = await asyncio.wait_for(
                self._post(f"http://{endpoint}/tokenize", body, self.timeout_s), self.timeout_s
            )
            ids = _tokens(raw) if status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            ids = None
        self.seconds += time.perf_counter() - t0
        if ids is None:
            self.failures += 1
            return None
        self._remember(key, ids)
        return ids

    def _remember(self, key: tuple[int, int], ids: list[int]) -> None:
        if not self.cache_entries or len(ids) > self.cache_tokens:
            return
        self._cache[key] = array.array("I", ids)
        self._cached_tokens += len(ids)
        while len(self._cache) > self.cache_entries or self._cached_tokens > self.cache_tokens:
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= len(old)
        assert self._cached_tokens >= 0, "remote tokenizer cache count went negative"

    async def _aiohttp_post(self, url: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=timeout_s), connector=aiohttp.TCPConnector(limit=0)
            )
        async with self._session.post(url, data=body, headers={"content-type": "application/json"}) as r:
            return r.status, await r.read()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _tokens(raw: bytes) -> list[int] | None:
    doc = orjson.loads(raw)
    ids = doc.get("tokens") if isinstance(doc, dict) else None
    if not (isinstance(ids, list) and len(ids) <= MAX_TOKENS):
        return None
    if not all(isinstance(t, int) and 0 <= t < 1 << 32 for t in ids):
        return None
    return ids

"""The one tokenization entry point: a request's prompt token ids, as the replica will compute
them, for precise prefix matching.

Two sources, chosen once from ``prefix`` config (:attr:`PrefixConfig.tokenizes`):

- **local**: the model's ``tokenizer.json`` (HF ``tokenizers``, :mod:`picker.core.tokenize`).
  A body under ``prefix.tokenize_inline_bytes`` is tokenized on the event loop when no other
  encode is running (a thread hop costs more than a short prompt); otherwise in a thread (HF
  ``tokenizers`` releases the GIL).
- **remote**: a ready replica's vLLM ``/tokenize`` (:mod:`picker.feeds.remote_tokenizer`),
  awaited and bounded by its timeout.

Neither ever fails a request: with no ids the request is matched approximately. Off
(approximate mode, or neither source configured): requests pass unchanged.

**Progressive** (local tokenizer, a body of ``prefix.progressive_chars`` bytes or more, some
endpoint routed precisely): the prompt is tokenized a chunk at a time (``tokenize_chunk_chars``,
then twice as long each time, in a thread), and after each chunk its blocks are looked up in the
precise index: once no endpoint holds the next block, tokenizing stops. The request carries the
ids so far (exactly the whole tokenization's first ones, :meth:`HFPromptTokenizer.advance`) and an
estimate of the whole prompt's tokens (the ids per character so far, times the characters), which
the load model uses. A cold prompt costs one chunk; the next turn of a conversation, or another
question on a shared document, costs what the cache does not hold (its new suffix), tokenized in
the same thread hop as the cache look-up when it is at most a chunk. The ids come with their
KV-block keys (a held prefix's from the cache, :meth:`HFPromptTokenizer.begin`), which the
router uses as they are (:attr:`InferenceRequest.prompt_keys`).

Siblings: a prompt cut short this way is remembered with the endpoint it went to (:meth:`picked`;
the last ``PARTIALS`` of them, for ``PARTIAL_TTL_S``). A later prompt that stops where such a
partial one shares more of its text tokenizes on through the shared text and records the shared
blocks as a speculative entry on that endpoint (as the first request's pick would have, had it
been tokenized whole), then goes on matching: a burst of siblings of a cold long prompt follows
the first one (``tests/precise/test_progressive_routing.py``).

Bounds: one request's ids stop past ``prefix.max_prompt_tokens`` (plus one chunk); the cache holds
at most ``prefix.tokenizer_cache_tokens`` ids.

State: the open progressive tokenizations awaiting their pick (at most ``OPEN``) and the partials
(at most ``PARTIALS``), written on the event loop only, beside the two tokenizers' caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from typing import Any

from picker.core.config import PrefixConfig
from picker.core.errors import NoEndpoints
from picker.core.prefix.memo import common_prefix
from picker.core.request import InferenceRequest
from picker.core.router import Router
from picker.core.tokenize import PromptTokenizer
from picker.core.tokenize import load as load_tokenizer
from picker.core.tokenize.cache import KEY_CHARS, cut
from picker.core.tokenize.hf import Keying, Progress
from picker.feeds.remote_tokenizer import RemoteTokenizer

OPEN = 1024
"""Progressive tokenizations awaiting their pick, at most (an explain never picks)."""
PARTIALS = 32
"""Prompts cut short remembered for their siblings, at most."""
PARTIAL_TTL_S = 30.0
"""How long a prompt cut short is remembered: about a long prompt's prefill, after which its
endpoint's KV events say what it holds."""


@dataclasses.dataclass(slots=True)
class _Partial:
    text: str
    lora: str
    salt: str
    endpoint: str = ""
    at: float = 0.0
    follow: asyncio.Future[Progress] | None = None
    """The first sibling's tokenization through the shared text; later siblings await it and
    take its ids from the cache rather than tokenize the same text again."""


class Tokenization:
    """Adds ``prompt_token_ids`` to requests that lack them (see the module doc)."""

    def __init__(
        self,
        router: Router,
        local: PromptTokenizer | None = None,
        remote: RemoteTokenizer | None = None,
        inline_bytes: int = 0,
        cfg: PrefixConfig | None = None,
    ) -> None:
        self.router, self.local, self.remote, self.inline_bytes = router, local, remote, inline_bytes
        cfg = cfg or PrefixConfig()
        self.progressive_chars, self.chunk_chars = cfg.progressive_chars, cfg.tokenize_chunk_chars
        self.max_prompt_tokens = cfg.max_prompt_tokens
        self._open: OrderedDict[str, _Partial] = OrderedDict()
        self._partials: deque[_Partial] = deque(maxlen=PARTIALS)
        self._busy: dict[str, asyncio.Future[Progress]] = {}
        """Text start → the chunk being tokenized for it (at most one per concurrent request)."""
        self.clock = time.monotonic

    @classmethod
    def from_config(cls, router: Router, cfg: PrefixConfig) -> Tokenization:
        """The sources ``cfg`` names; raises ValueError for a tokenizer that does not load."""
        if not cfg.tokenizes:
            return cls(router)
        if cfg.tokenizer:
            try:
                local = load_tokenizer(cfg.tokenizer, cfg.tokenizer_cache_entries, cfg.tokenizer_cache_tokens)
            except Exception as exc:  # tokenizers raises its own Exception types
                raise ValueError(f"prefix.tokenizer {cfg.tokenizer!r}: {exc}") from exc
            return cls(router, local=local, inline_bytes=cfg.tokenize_inline_bytes, cfg=cfg)
        remote = RemoteTokenizer(cfg.remote_tokenize_timeout_s, cfg.remote_tokenize_cache_entries)
        return cls(router, remote=remote)

    @property
    def enabled(self) -> bool:
        return self.local is not None or self.remote is not None

    async def tokenize(
        self,
        req: InferenceRequest,
        doc: dict[str, Any] | None,
        path: str,
        size: int,
        subset: Collection[str] | None = None,
    ) -> InferenceRequest:
        """``req`` with its prompt's token ids (``size``: the body's bytes, which decides inline
        or threaded local tokenization; ``subset``: the replicas a remote call may ask), or
        ``req`` unchanged when the ids are known already, cannot be had, or tokenization is off."""
        if req.prompt_token_ids is not None or not doc:
            return req
        if self.local is not None:
            if size >= self.progressive_chars:
                eligible = self._precise_endpoints(subset)
                if eligible:
                    return await self._progressive(req, doc, path, eligible)
            ids: Sequence[int] | None
            done = False
            if size < self.inline_bytes:
                done, ids = self.local.try_encode(doc, path)
            if not done:
                ids = await asyncio.to_thread(self.local.encode, doc, path)
        elif self.remote is not None:
            try:
                endpoint = self.router.any_ready(subset).key
            except NoEndpoints:  # none ready: the pick says so
                return req
            ids = await self.remote.encode(req.model, doc, path, endpoint)
        else:
            return req
        return req if ids is None else dataclasses.replace(req, prompt_token_ids=ids)

    def _precise_endpoints(self, subset: Collection[str] | None) -> list[str]:
        router = self.router
        if router.precise is None or not router.precise_block_size():
            return []
        return [
            s.key
            for s in router.pool
            if s.routable and (subset is None or s.key in subset) and router.is_precise(s.key)
        ]

    async def _progressive(
        self, req: InferenceRequest, doc: dict[str, Any], path: str, eligible: list[str]
    ) -> InferenceRequest:
        """Tokenize as far as some endpoint holds the blocks (see the module doc)."""
        local, precise = self.local, self.router.precise
        assert local is not None and precise is not None, "progressive tokenization needs both"

        keying = Keying(self.router.precise_block_size(), req.lora, req.cache_salt)
        chunk = self.chunk_chars

        def start() -> Progress | None:  # one thread hop: render, then what the cache knows,
            rendered = local.prompt_text(doc, path)  # and a last chunk (no look-up before it)
            if rendered is None:
                return None
            return local.begin(*rendered, keying, last=chunk)  # (a bound cut later is the same)

        first = await asyncio.to_thread(start)
        if first is None:
            return req
        p, text = self._bounded(first), first.text
        while not p.done and len(p.ids) < self.max_prompt_tokens:
            n = len(p.keys)  # the full blocks of the ids so far
            if n and len(text) - p.pos > chunk:  # a last chunk is tokenized without a look-up
                best = max(precise.match_many(eligible, p.keys, self.router.clock()).values(), default=0)
                if best < n:  # no endpoint holds the next block
                    q = await self._follow(p, req, eligible)
                    if q is None:
                        break
                    p = self._bounded(q)
                    continue
            p = await self._advance(p, chunk)
            chunk *= 2
        ids = local.ids_of(p)
        estimate = 0
        if not p.done:
            estimate = len(ids) + round((len(text) - p.pos) * len(p.ids) / max(p.pos, 1))
            self._open[req.request_id] = _Partial(text, req.lora, req.cache_salt)
            while len(self._open) > OPEN:
                self._open.popitem(last=False)
        return dataclasses.replace(
            req,
            prompt_token_ids=ids,
            prompt_token_estimate=estimate,
            prompt_keys=p.keys,
            prompt_keys_block_size=keying.block_size,
        )

    async def _follow(self, p: Progress, req: InferenceRequest, eligible: list[str]) -> Progress | None:
        """When a recent prompt cut short shares more of this one's text than is tokenized, go on
        through the shared text and record its blocks on that prompt's endpoint. None: no such
        prompt (or no progress)."""
        local, precise = self.local, self.router.precise
        assert local is not None and precise is not None, "progressive tokenization needs both"
        now = self.clock()
        for part in reversed(self._partials):
            if now - part.at > PARTIAL_TTL_S or part.endpoint not in eligible:
                continue
            if part.lora != req.lora or part.salt != req.cache_salt:
                continue
            shared = common_prefix(part.text, p.text)
            if shared <= p.pos + self.chunk_chars // 4:
                continue
            if part.follow is not None:  # a sibling is tokenizing (or has) the shared text
                await asyncio.shield(part.follow)
                q = await asyncio.to_thread(local.begin, p.text, p.special, p.keying)
                return q if q.pos > p.pos else None
            budget = (self.max_prompt_tokens - len(p.ids)) * max(p.pos, 1) // max(len(p.ids), 1) + 1
            part.follow = asyncio.ensure_future(
                asyncio.to_thread(local.advance, p, min(shared - p.pos, budget))
            )
            q = await asyncio.shield(part.follow)
            if q.pos <= p.pos:
                return None
            k = len(q.ids)
            if q.done and part.text != p.text:  # its last tokens may differ from the other's
                k = cut(q.ends, p.text, shared, 4)
            precise.speculate(part.endpoint, q.keys_upto(k), self.router.clock())
            return q
        return None

    async def _advance(self, p: Progress, chunk: int) -> Progress:
        """``p`` a chunk further; when a concurrent request is tokenizing a text that starts the
        same, first wait for it and take what it did from the cache (a burst of siblings
        tokenizes their shared text once)."""
        local = self.local
        assert local is not None, "progressive tokenization needs a local tokenizer"
        key = p.text[:KEY_CHARS]
        busy = self._busy.get(key)
        if busy is not None and not busy.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(busy)
            q = await asyncio.to_thread(local.begin, p.text, p.special, p.keying)
            if q.pos > p.pos:
                return self._bounded(q)
        fut = asyncio.ensure_future(asyncio.to_thread(local.advance, p, chunk))
        self._busy[key] = fut
        try:
            return await asyncio.shield(fut)
        finally:
            if self._busy.get(key) is fut:
                del self._busy[key]

    def _bounded(self, p: Progress) -> Progress:
        """``p`` cut to ``max_prompt_tokens`` ids (still exact; never advanced further)."""
        k = self.max_prompt_tokens
        return p if len(p.ids) <= k else p.cut(k)

    def picked(self, request_id: str, endpoint: str) -> None:
        """The request went to ``endpoint``: a prompt it tokenized only in part is remembered
        for its siblings."""
        part = self._open.pop(request_id, None)
        if part is not None:
            part.endpoint, part.at = endpoint, self.clock()
            self._partials.append(part)

    async def close(self) -> None:
        if self.remote is not None:
            await self.remote.close()

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

State: none of its own beyond the two tokenizers' caches; used from the event loop only.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection
from typing import Any

from picker.core.config import PrefixConfig
from picker.core.errors import NoEndpoints
from picker.core.request import InferenceRequest
from picker.core.router import Router
from picker.core.tokenize import PromptTokenizer
from picker.core.tokenize import load as load_tokenizer
from picker.feeds.remote_tokenizer import RemoteTokenizer


class Tokenization:
    """Adds ``prompt_token_ids`` to requests that lack them (see the module doc)."""

    def __init__(
        self,
        router: Router,
        local: PromptTokenizer | None = None,
        remote: RemoteTokenizer | None = None,
        inline_bytes: int = 0,
    ) -> None:
        self.router, self.local, self.remote, self.inline_bytes = router, local, remote, inline_bytes

    @classmethod
    def from_config(cls, router: Router, cfg: PrefixConfig) -> Tokenization:
        """The sources ``cfg`` names; raises ValueError for a tokenizer that does not load."""
        if not cfg.tokenizes:
            return cls(router)
        if cfg.tokenizer:
            try:
                local = load_tokenizer(cfg.tokenizer, cfg.tokenizer_cache_entries)
            except Exception as exc:  # tokenizers raises its own Exception types
                raise ValueError(f"prefix.tokenizer {cfg.tokenizer!r}: {exc}") from exc
            return cls(router, local=local, inline_bytes=cfg.tokenize_inline_bytes)
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
            ids: list[int] | None
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

    async def close(self) -> None:
        if self.remote is not None:
            await self.remote.close()

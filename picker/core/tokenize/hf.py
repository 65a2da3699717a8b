"""The model's own tokenizer (HF ``tokenizers``) and the request → token ids step.

Loaded from a directory (a mounted model or tokenizer volume) holding ``tokenizer.json`` and,
for chat, ``tokenizer_config.json`` (its ``chat_template``, or a ``chat_template.jinja`` file beside
it, and the special tokens the template may use), or from a ``tokenizer.json`` path alone
(completions only).

As vLLM 0.32 does: ``/v1/completions`` prompts are tokenized with the tokenizer's special tokens
(``add_special_tokens`` default true: e.g. a BOS from its post-processor); chat prompts are the
rendered template tokenized without them (the template writes its own). ``/v1/messages`` and
``/v1/responses`` bodies become the chat request vLLM builds from them
(:mod:`picker.core.tokenize.apis`) and are rendered as chat. A list of prompts gives the first
one's ids (the picker routes the batch as one request).

A body whose prompt cannot be reproduced gives None and is counted in :attr:`approximate` by
reason (:data:`picker.core.tokenize.apis.REASONS`).
"""

from __future__ import annotations

import json
import pathlib
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenizers import Tokenizer

from picker.core.prefix.precise import continue_keys
from picker.core.tokenize import apis
from picker.core.tokenize.apis import REASONS, Unrenderable
from picker.core.tokenize.cache import IDS, Plain, PrefixTokenCache, cut
from picker.core.tokenize.chat import ChatTemplate

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True, slots=True)
class Keying:
    """How a request's ids are keyed into KV blocks (:func:`picker.core.prefix.precise.request_keys`):
    tokens per block, and the extras vLLM folds (its LoRA adapter, its cache salt)."""

    block_size: int
    lora: str = ""
    salt: str = ""


@dataclass(slots=True)
class Progress:
    """A prompt tokenized part of the way (:meth:`HFPromptTokenizer.begin`, :meth:`advance`):
    ``ids`` (an ``array('I')``, as the cache keeps them) are exactly the first ``len(ids)`` ids of
    the whole text's tokenization (without the tokenizer's special head and tail), covering
    ``text[:pos]``; ``pos == len(text)`` once done.
    With a ``keying``, ``keys`` are the KV-block keys of the request's ids so far
    (``request_keys(ids_of(p), ...)``: the head, the ids, and the tail once done), else empty.
    Replaced, never mutated in place, by :meth:`HFPromptTokenizer.advance` (the cache and the
    request may share the arrays and lists)."""

    text: str
    special: bool
    ids: array[int]
    ends: array[int]
    pos: int
    keys: list[int] = field(default_factory=list)
    keying: Keying | None = None
    head: int = 0
    """Tokens of the special head before ``ids`` (0 unless ``special``)."""

    @property
    def done(self) -> bool:
        return self.pos >= len(self.text)

    def keys_upto(self, k: int) -> list[int]:
        """The keys of the blocks that the head and the first ``k`` ids fill (no tail)."""
        return self.keys[: (self.head + k) // self.keying.block_size] if self.keying is not None else []

    def cut(self, k: int) -> Progress:
        """The first ``k`` ids (``0 < k < len(ids)``: a stable cut, as every ``ids`` prefix is)."""
        assert 0 < k < len(self.ids), f"cut {k} of {len(self.ids)} ids"
        return Progress(
            self.text,
            self.special,
            self.ids[:k],
            self.ends[:k],
            self.ends[k - 1],
            self.keys_upto(k),
            self.keying,
            self.head,
        )


class PromptTokenizer(Protocol):
    def encode(self, doc: dict[str, Any], path: str) -> Sequence[int] | None:
        """The prompt token ids vLLM will compute for this body, or None when they cannot be
        reproduced here (media, an unrenderable template, no prompt). Not to be mutated (a long
        prompt's may be the tokenization cache's own array)."""
        ...

    def try_encode(self, doc: dict[str, Any], path: str) -> tuple[bool, Sequence[int] | None]:
        """``(True, encode(...))`` at once, or ``(False, None)`` when that would wait for another
        thread's encode: the event loop calls it, and must not wait on a long prompt's."""
        ...

    @property
    def approximate(self) -> dict[str, int]:
        """Bodies :meth:`encode` gave None for, by reason (label values bounded by
        :data:`picker.core.tokenize.apis.REASONS`)."""
        ...

    def prompt_text(self, doc: dict[str, Any], path: str) -> tuple[str, bool] | None:
        """The text vLLM tokenizes, with or without the special tokens; None: cannot be had."""
        ...

    def begin(self, text: str, special: bool, keying: Keying | None = None, last: int = 0) -> Progress:
        """A progressive tokenization of ``text``, as far as the cache knows it (with its keys
        when ``keying`` is given), and to the end when at most ``last`` characters are left."""
        ...

    def advance(self, p: Progress, chars: int) -> Progress:
        """``p`` about ``chars`` characters further, its ids still exact."""
        ...

    def ids_of(self, p: Progress, tail: bool = True) -> Sequence[int]:
        """The request's ids as far as ``p`` goes (``tail``: the special tail once done)."""
        ...


class HFPromptTokenizer:
    def __init__(
        self, tok: Tokenizer, chat: ChatTemplate | None, cache_entries: int = 64, cache_tokens: int = 1 << 20
    ) -> None:
        self.tok, self.chat = tok, chat
        self._lock = threading.Lock()
        """Serialises :meth:`encode` (the prefix cache is not thread-safe); ext_proc calls it
        from worker threads, and :meth:`try_encode` from the event loop for short prompts."""
        x = tok.encode("x", add_special_tokens=False).ids
        both = tok.encode("x", add_special_tokens=True).ids
        at = _find(both, x)
        self._head, self._tail = (both[:at], both[at + len(x) :]) if at >= 0 else ([], [])
        self.cache = (
            PrefixTokenCache(self._encode_plain, cache_entries, max_tokens=cache_tokens)
            if cache_entries
            else None
        )
        self._approximate: dict[str, int] = dict.fromkeys(REASONS, 0)
        """Written by :meth:`_encode` under the lock; read by the telemetry at scrape time."""

    @property
    def approximate(self) -> dict[str, int]:
        return self._approximate

    def _encode_plain(self, text: str) -> Plain:
        # encode_batch releases the GIL (encode does not), so a long encode in a worker thread
        # does not stall the event loop
        (enc,) = self.tok.encode_batch([text], add_special_tokens=False)
        return enc.ids, [e for _, e in enc.offsets]

    def text_ids(self, text: str, special: bool) -> Sequence[int]:
        ids = (
            self.cache.ids(text)
            if self.cache is not None
            else self.tok.encode(text, add_special_tokens=False).ids
        )
        if not (special and (self._head or self._tail)):
            return ids
        if isinstance(ids, array):  # a long text's cached ids: joined as arrays, one memcpy each
            out = array(IDS, self._head)
            out += ids
            out.extend(self._tail)
            return out
        return [*self._head, *ids, *self._tail]

    def encode(self, doc: dict[str, Any], path: str) -> Sequence[int] | None:
        with self._lock:
            return self._encode(doc, path)

    def try_encode(self, doc: dict[str, Any], path: str) -> tuple[bool, Sequence[int] | None]:
        if not self._lock.acquire(blocking=False):
            return False, None
        try:
            return True, self._encode(doc, path)
        finally:
            self._lock.release()

    def _encode(self, doc: dict[str, Any], path: str) -> Sequence[int] | None:
        try:
            return self._ids(doc, path)
        except Unrenderable as exc:
            self._approximate[exc.reason] += 1
            return None

    def _ids(self, doc: dict[str, Any], path: str) -> Sequence[int]:
        """The prompt ids, or :class:`Unrenderable` saying why they cannot be had."""
        text, special = self._prompt(doc, path)
        return self.text_ids(text, special)

    def prompt_text(self, doc: dict[str, Any], path: str) -> tuple[str, bool] | None:
        """The text vLLM tokenizes for this body and whether with the tokenizer's special tokens,
        or None (counted by reason) when it cannot be reproduced. Thread-safe."""
        try:
            return self._prompt(doc, path)
        except Unrenderable as exc:
            with self._lock:
                self._approximate[exc.reason] += 1
            return None

    def _prompt(self, doc: dict[str, Any], path: str) -> tuple[str, bool]:
        if doc.get("truncate_prompt_tokens") is not None:
            raise Unrenderable("unsupported", "truncate_prompt_tokens")
        api = apis.api_of(path)
        if api == "messages":
            return self._chat_text(self._from_anthropic(doc))
        if api == "responses":
            return self._chat_text(apis.from_responses(doc))
        if api == "chat" or "messages" in doc:
            return self._chat_text(doc)
        if doc.get("prompt_embeds") is not None:
            raise Unrenderable("unsupported", "prompt_embeds")
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0] if isinstance(prompt[0], str) else None
        if not isinstance(prompt, str):
            raise Unrenderable("unsupported", "no text prompt")
        return prompt, bool(doc.get("add_special_tokens", True))

    # -- progressive tokenization ----------------------------------------------------------------
    def begin(self, text: str, special: bool, keying: Keying | None = None, last: int = 0) -> Progress:
        """``text``'s tokenization as far as the cache already knows it, with the keys of those
        ids (``keying``): the cache's where it holds them, the rest hashed. When at most ``last``
        characters are left after that, they are tokenized too (as :meth:`advance` would, but
        extending the cut's ids in place: a cut from the cache is a fresh array, one copy saved)."""
        head = len(self._head) if special else 0
        with self._lock:
            cache = self.cache
            ids, ends, n, keyed = (
                cache.prefix(text) if cache is not None else (array(IDS), array("q"), 0, None)
            )
            p = Progress(text, special, ids, ends, n, [], keying, head)
            if keying is not None:
                known: list[int] = []
                if keyed is not None and keyed[0] == (keying, special):
                    known = keyed[1][: (head + len(ids)) // keying.block_size]
                p.keys = self._keys(p, known)
                if cache is not None and len(p.keys) > len(known):  # keys the cache lacked: kept
                    cache.store(text if p.done else text[:n], (ids, ends), ((keying, special), p.keys))
            if last and not p.done and len(text) - n <= last:
                # not done: ids and ends are a fresh cut (an exact hit is done), held by no one else
                p = self._advance(p, last, in_place=True)
        return p

    def advance(self, p: Progress, chars: int) -> Progress:
        """``p`` tokenized about ``chars`` characters further (to the end when fewer are left),
        cut where the ids are exactly the whole text's (the cache's rule: ``backoff`` tokens
        before the segment's end, at a word start), its keys extended over the new ids.
        Remembered in the cache. Runs in a worker thread (the encode releases the GIL) or
        inline."""
        with self._lock:
            return self._advance(p, chars, in_place=False)

    def _advance(self, p: Progress, chars: int, in_place: bool) -> Progress:
        """:meth:`advance` under the lock; ``in_place``: ``p``'s arrays are extended (``p`` is
        spent: only :meth:`begin`'s own cut may be)."""
        text, start = p.text, p.pos
        while True:
            stop = start + chars
            if stop >= len(text):
                seg_ids, seg_ends = self._encode_plain(text[start:])
                k, pos = len(seg_ids), len(text)
            else:
                seg = text[start:stop]
                seg_ids, seg_ends = self._encode_plain(seg)
                backoff = self.cache.backoff if self.cache is not None else 4
                k = cut(seg_ends, seg, len(seg), backoff)
                pos = start + seg_ends[k - 1] if k else start
            if k:
                break
            chars *= 2  # a segment with no safe cut (one long word): take more
        known = p.keys_upto(len(p.ids))  # p's keys, less any tail block
        new_ends = array("q", [start + e for e in seg_ends[:k]])
        if in_place:
            ids, ends = p.ids, p.ends
            ids.extend(seg_ids[:k])
            ends += new_ends
        else:
            ids, ends = p.ids + array(IDS, seg_ids[:k]), p.ends + new_ends
        q = Progress(text, p.special, ids, ends, pos, known, p.keying, p.head)
        if q.keying is not None:
            q.keys = self._keys(q, known)
        if self.cache is not None:
            keyed = ((q.keying, q.special), q.keys) if q.keying is not None else None
            self.cache.store(text if q.done else text[:pos], (q.ids, q.ends), keyed)
        return q

    def _keys(self, p: Progress, known: list[int]) -> list[int]:
        """``p``'s keys, given ``known``, those of its first blocks: only the rest hashed."""
        keying = p.keying
        assert keying is not None, "keys without a keying"
        bs = keying.block_size
        at = len(known) * bs  # the first token of ids_of(p) not yet keyed
        head = self._head if p.special else []
        tail = self._tail if p.special and p.done else []
        if (len(head) + len(p.ids) + len(tail)) // bs <= len(known):
            return known
        rest = p.ids[at - len(head) :] if at >= len(head) else [*head[at:], *p.ids]
        if tail:
            rest = [*rest, *tail]
        return [*known, *continue_keys(known, rest, bs, keying.lora, keying.salt)]

    def ids_of(self, p: Progress, tail: bool = True) -> Sequence[int]:
        """The request's ids as far as ``p`` goes: the special head, and (``tail``) the tail once
        done (an array; ``p.ids`` itself when there is neither)."""
        if not (p.special and (self._head or self._tail)):
            return p.ids
        return array(IDS, self._head) + p.ids + array(IDS, self._tail if p.done and tail else ())

    def _from_anthropic(self, doc: dict[str, Any]) -> dict[str, Any]:
        if self.chat is None:
            raise Unrenderable("template", "no chat template")
        thinking = doc.get("thinking")
        if self.chat.reads_reasoning and isinstance(thinking, dict) and thinking.get("type") == "disabled":
            raise Unrenderable("thinking", "thinking disabled: vLLM probes the template for the effort")
        return apis.from_anthropic(doc, self.chat.merges_inline_system)

    def _chat_text(self, doc: dict[str, Any]) -> tuple[str, bool]:
        if self.chat is None:
            raise Unrenderable("template", "no chat template")
        return self.chat.render(doc), bool(doc.get("add_special_tokens", False))


def _find(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    return -1


def _special_tokens(cfg: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name in _SPECIAL:
        v = cfg.get(name)
        if isinstance(v, dict):  # AddedToken serialised as {"content": ...}
            v = v.get("content")
        if isinstance(v, str):
            out[name] = v
    return out


def _chat_template(cfg: dict[str, Any], folder: pathlib.Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    t = cfg.get("chat_template")
    if isinstance(t, list):  # named templates: vLLM uses "default"
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


def load(path: str, cache_entries: int = 64, cache_tokens: int = 1 << 20) -> HFPromptTokenizer:
    """A directory with ``tokenizer.json`` (+ ``tokenizer_config.json``), or a ``tokenizer.json``."""
    p = pathlib.Path(path)
    folder = p if p.is_dir() else p.parent
    tok = Tokenizer.from_file(str(folder / "tokenizer.json" if p.is_dir() else p))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    source = _chat_template(cfg, folder)
    chat = ChatTemplate(source, _special_tokens(cfg)) if source else None
    return HFPromptTokenizer(tok, chat, cache_entries, cache_tokens)

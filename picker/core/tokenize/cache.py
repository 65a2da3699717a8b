"""Reuse of the tokenization of a repeated text prefix (a system prompt, a document, a history).

``PrefixTokenCache`` keeps, per first ``KEY_CHARS`` characters, the last text that started that
way with its token ids and each token's end offset (at most ``entries`` texts and ``max_tokens``
ids in all, least recently used dropped). A text may be a prefix cut at a stable point (what
progressive tokenization has done of a prompt so far, :mod:`picker.core.tokenize.hf`). For a new
text it finds the common prefix with the remembered one, keeps the tokens that end at least
``backoff`` tokens before the divergence and at a whitespace boundary, and tokenizes only the rest
from there.

Exactness: for tokenizers whose pre-tokenizer splits text into words at whitespace before BPE
(ByteLevel / GPT-style regex: Llama 3, Qwen, Mistral-Nemo, the test model), no token spans a cut
made at a whitespace boundary before the divergence, so the result equals tokenizing the whole
text. The ``backoff`` absorbs the regex's one-character look-ahead. A tokenizer without such a
pre-tokenizer (SentencePiece without splitting) must run with the cache off
(``prefix.tokenizer_cache_entries: 0``); ``tests/precise/test_tokenize.py`` checks exactness, and
``tests/precise/test_progressive.py`` the same cut for progressive tokenization (hypothesis).

Beside a text's ids an entry may keep their KV-block keys (:func:`picker.core.prefix.precise.request_keys`
of the ids, for one block size, LoRA adapter, salt and special head: the ``tag``), so that a held
prefix's keys are reused as its ids are (:meth:`HFPromptTokenizer.begin`); the cache only stores
and returns them.

Ids are kept as ``array('I')`` (4 bytes each), not lists: a hit's cut of a 100k-id prefix is one
memcpy of 400 KB (about 25 µs) instead of a 100k-slot list copy that touches every int object
(0.35-0.45 ms measured in the bench's conversation, bench/results/2026-11-28-parity.md), and a
cached id costs 4 bytes instead of a list slot plus, above 256, an int object.

Memory: at most ``max_tokens`` ids (4 bytes each in an array, their end offsets 8 bytes each),
their keys (one per block of ids, a list slot and an int object: under 3 bytes per id at 16
tokens per block) and the texts they came from.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from picker.core.prefix.memo import common_prefix

KEY_CHARS = 256
MIN_CHARS = 2048
"""Shorter texts are tokenized directly: a cache look-up would cost about as much."""

Plain = tuple[list[int], list[int]]
"""What the tokenizer gives: (token ids, end offset of each token in characters)."""
Encoded = tuple["array[int]", "array[int]"]
"""What the cache keeps: (token ids as an array of unsigned 32-bit ints, end offsets as an array
of signed 64-bit ints: slicing and joining them copies bytes, not objects)."""

IDS = "I"
"""The array type code of token ids (unsigned 32-bit: every vocabulary fits)."""
Keyed = tuple[Hashable, list[int]]
"""(tag, keys): block keys of an entry's ids, and what they were computed for (the caller's)."""


class PrefixTokenCache:
    __slots__ = ("_memo", "backoff", "encode", "entries", "hits", "max_tokens", "tokens")

    def __init__(
        self, encode: Callable[[str], Plain], entries: int = 64, backoff: int = 4, max_tokens: int = 1 << 20
    ) -> None:
        assert entries >= 1 and backoff >= 1 and max_tokens >= 1, (
            f"bad cache shape {entries} {backoff} {max_tokens}"
        )
        self.encode, self.entries, self.backoff, self.max_tokens = encode, entries, backoff, max_tokens
        self._memo: OrderedDict[str, tuple[str, Encoded, Keyed | None]] = OrderedDict()
        self.hits = 0
        self.tokens = 0
        """Ids held in all (at most ``max_tokens``, one text's ids excepted)."""

    def ids(self, text: str) -> Sequence[int]:
        """``text``'s ids (a list for a short text, else the cache's array: not to be mutated)."""
        if len(text) < MIN_CHARS:
            return self.encode(text)[0]
        ids, ends, n, _ = self.prefix(text)
        if n == len(text):
            enc = (ids, ends)
        elif n:
            rest_ids, rest_ends = self.encode(text[n:])
            enc = (ids + array(IDS, rest_ids), ends + array("q", [n + e for e in rest_ends]))
        else:
            plain_ids, plain_ends = self.encode(text)
            enc = (array(IDS, plain_ids), array("q", plain_ends))
        self.store(text, enc)
        return enc[0]

    def prefix(self, text: str) -> tuple[array[int], array[int], int, Keyed | None]:
        """The remembered tokens of ``text``'s longest known prefix, cut where they are exact:
        (ids, ends, characters they cover, the entry's keys and their tag if it has some; they
        may cover more ids than those returned). A cut is a fresh copy of the arrays (a memcpy);
        an exact hit returns the cache's own, which the caller must not mutate."""
        hit = self._memo.get(text[:KEY_CHARS])
        if hit is None:
            return array(IDS), array("q"), 0, None
        old, (ids, ends), keyed = hit
        if old == text:
            self.hits += 1
            return ids, ends, len(text), keyed
        n = common_prefix(old, text)
        k = cut(ends, text, n, self.backoff)
        if k == 0:
            return array(IDS), array("q"), 0, None
        self.hits += 1
        return ids[:k], ends[:k], ends[k - 1], keyed

    def store(self, text: str, enc: Encoded, keyed: Keyed | None = None) -> None:
        """Remember ``text`` (a whole text, or a prefix cut at a stable point) and its tokens (and
        their keys), in place of the last text with the same first ``KEY_CHARS`` characters
        unless that one extends it."""
        if len(text) < MIN_CHARS:
            return
        key = text[:KEY_CHARS]
        old = self._memo.get(key)
        if old is not None and len(old[0]) >= len(text) and old[0].startswith(text):
            known = old[2]
            if keyed is not None and (known is None or known[0] != keyed[0] or len(known[1]) < len(keyed[1])):
                self._memo[key] = (old[0], old[1], keyed)  # its ids start with these: so do its keys
            self._memo.move_to_end(key)  # it knows all of this text already (a sibling's longer one)
            return
        old = self._memo.pop(key, None)
        if old is not None:
            self.tokens -= len(old[1][0])
        self._memo[key] = (text, enc, keyed)
        self.tokens += len(enc[0])
        while len(self._memo) > 1 and (len(self._memo) > self.entries or self.tokens > self.max_tokens):
            _, (_, (ids, _), _) = self._memo.popitem(last=False)
            self.tokens -= len(ids)


def cut(ends: Sequence[int], text: str, shared: int, backoff: int) -> int:
    """How many leading tokens to keep: they end ``backoff`` tokens before ``shared`` characters,
    at a word start for the pre-tokenizer, and not between two byte tokens of one character (a
    multi-byte character split into byte tokens gives each the character's end offset)."""
    lo, hi = 0, len(ends)
    while lo < hi:  # the number of tokens that end at or before `shared`
        mid = (lo + hi) // 2
        if ends[mid] <= shared:
            lo = mid + 1
        else:
            hi = mid
    k = lo - backoff
    while k > 0 and not (_boundary(text, ends[k - 1]) and (k == len(ends) or ends[k] != ends[k - 1])):
        k -= 1  # not at a word start, or inside one character's bytes (byte tokens share its end)
    return max(k, 0)


def _boundary(text: str, i: int) -> bool:
    """A word start: whitespace at ``i`` after a non-space (runs of spaces split differently)."""
    return 0 < i < len(text) and text[i].isspace() and not text[i - 1].isspace()

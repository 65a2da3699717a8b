"""Reuse of the tokenization of a repeated text prefix (a system prompt, a document, a history).

``PrefixTokenCache`` keeps, per first ``KEY_CHARS`` characters, the last text that started that
way with its token ids and each token's end offset (at most ``entries`` texts, least recently used
dropped). For a new text it finds the common prefix with the remembered one, keeps the tokens that
end at least ``backoff`` tokens before the divergence and at a whitespace boundary, and tokenizes
only the rest from there.

Exactness: for tokenizers whose pre-tokenizer splits text into words at whitespace before BPE
(ByteLevel / GPT-style regex: Llama 3, Qwen, Mistral-Nemo, the test model), no token spans a cut
made at a whitespace boundary before the divergence, so the result equals tokenizing the whole
text. The ``backoff`` absorbs the regex's one-character look-ahead. A tokenizer without such a
pre-tokenizer (SentencePiece without splitting) must run with the cache off
(``prefix.tokenizer_cache_entries: 0``); ``tests/precise/test_tokenize.py`` checks exactness.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from picker.core.prefix.memo import common_prefix

KEY_CHARS = 256
MIN_CHARS = 2048
"""Shorter texts are tokenized directly: a cache look-up would cost about as much."""

Encoded = tuple[list[int], list[int]]
"""(token ids, end offset of each token in characters)."""


class PrefixTokenCache:
    __slots__ = ("_memo", "backoff", "encode", "entries", "hits")

    def __init__(self, encode: Callable[[str], Encoded], entries: int = 64, backoff: int = 4) -> None:
        assert entries >= 1 and backoff >= 1, f"bad cache shape entries={entries} backoff={backoff}"
        self.encode, self.entries, self.backoff = encode, entries, backoff
        self._memo: OrderedDict[str, tuple[str, Encoded]] = OrderedDict()
        self.hits = 0

    def ids(self, text: str) -> list[int]:
        if len(text) < MIN_CHARS:
            return self.encode(text)[0]
        key = text[:KEY_CHARS]
        hit = self._memo.get(key)
        enc = self._extend(hit, text) if hit is not None else None
        if enc is None:
            enc = self.encode(text)
        self._memo[key] = (text, enc)
        self._memo.move_to_end(key)
        if len(self._memo) > self.entries:
            self._memo.popitem(last=False)
        return enc[0]

    def _extend(self, hit: tuple[str, Encoded], text: str) -> Encoded | None:
        old, (ids, ends) = hit
        if old == text:
            self.hits += 1
            return ids, ends
        n = common_prefix(old, text)
        k = _cut(ids, ends, text, n, self.backoff)
        if k == 0:
            return None
        start = ends[k - 1]
        rest_ids, rest_ends = self.encode(text[start:])
        self.hits += 1
        return ids[:k] + rest_ids, ends[:k] + [start + e for e in rest_ends]


def _cut(ids: list[int], ends: list[int], text: str, shared: int, backoff: int) -> int:
    """How many leading tokens to keep: they end ``backoff`` tokens before ``shared`` characters,
    at a word start for the pre-tokenizer."""
    lo, hi = 0, len(ends)
    while lo < hi:  # the number of tokens that end at or before `shared`
        mid = (lo + hi) // 2
        if ends[mid] <= shared:
            lo = mid + 1
        else:
            hi = mid
    k = lo - backoff
    while k > 0 and not _boundary(text, ends[k - 1]):
        k -= 1
    return max(k, 0)


def _boundary(text: str, i: int) -> bool:
    """A word start: whitespace at ``i`` after a non-space (runs of spaces split differently)."""
    return 0 < i < len(text) and text[i].isspace() and not text[i - 1].isspace()

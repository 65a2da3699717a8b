"""Deterministic toy tokenizer: every 4 characters of text are one token, id = xxh32(chunk) mod
``VOCAB``. A text prefix of 4k characters therefore gives a prefix of k tokens, so tests can
predict block boundaries (block_size tokens = 4 × block_size characters). Token-id prompts are
taken as they are."""

from __future__ import annotations

import xxhash

VOCAB = 32_000
CHARS_PER_TOKEN = 4


def encode(text: str) -> list[int]:
    return [
        xxhash.xxh32_intdigest(text[i : i + CHARS_PER_TOKEN].encode()) % VOCAB
        for i in range(0, len(text), CHARS_PER_TOKEN)
    ]


def decode_token(i: int) -> str:
    return f"t{i % 997} "

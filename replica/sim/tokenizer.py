"""Deterministic toy tokenizer of the simulator.

- Text: every ``CHARS_PER_TOKEN`` (4) characters are one token; the last token may be shorter.
  Its id is ``xxh32(chunk as UTF-8) mod VOCAB``. A text prefix of ``4k`` characters therefore
  gives a token prefix of ``k`` tokens, so a test can predict block boundaries: a block of
  ``block_size`` tokens is ``4 × block_size`` characters.
- Token-id prompts (a JSON list of ints) are taken as they are.
- Generated tokens are filler: output ``i`` is the 4-character text ``output_text(i)``, and its id
  is that text's token, so generated text fed back as a prompt tokenizes to the same ids
  (when it starts on a 4-character boundary).
"""

from __future__ import annotations

import xxhash

VOCAB = 32_000
CHARS_PER_TOKEN = 4


def encode(text: str) -> list[int]:
    return [
        xxhash.xxh32_intdigest(text[i : i + CHARS_PER_TOKEN].encode()) % VOCAB
        for i in range(0, len(text), CHARS_PER_TOKEN)
    ]


def output_text(i: int) -> str:
    """Text of the ``i``-th generated token: exactly ``CHARS_PER_TOKEN`` characters."""
    return f" w{i % 100:02d}"


def output_token(i: int) -> int:
    return xxhash.xxh32_intdigest(output_text(i).encode()) % VOCAB


def decode_outputs(start: int, stop: int) -> str:
    """Text of generated tokens ``start`` to ``stop - 1``."""
    return "".join(output_text(i) for i in range(start, stop))

"""Mooncake-format traces → prompts. Shared by the cluster mode and the benchmarks.

Each row is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``
and each hash id names a 512-token block. Block ``h`` becomes 512 deterministic tokens, and the
matching text of exactly 4 characters per token (the simulator tokenizer's ratio), so rows that
share their first ``k`` hash ids share exactly ``k × 512`` tokens and ``k × 2048`` characters.
Tokens past the listed blocks are unique to the row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

BLOCK_TOKENS = 512
CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class Row:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read(path: str, limit: int | None = None) -> list[Row]:
    rows: list[Row] = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                break
            d = json.loads(line)
            rows.append(
                Row(
                    i,
                    d["timestamp"] / 1000.0,
                    int(d["input_length"]),
                    max(1, int(d["output_length"])),
                    tuple(d["hash_ids"]),
                )
            )
    return rows


def _block(h: int) -> tuple[list[int], str]:
    hi, lo = 2 * h + 1_000_000, 2 * h + 1_000_001  # distinct from any other block's tokens
    return [hi, lo] * (BLOCK_TOKENS // 2), f"{h:08x}" * (BLOCK_TOKENS * CHARS_PER_TOKEN // 8)


def tokens_and_text(row: Row) -> tuple[list[int], str]:
    """The row's prompt as token ids and as routing text (4 characters per token)."""
    toks: list[int] = []
    parts: list[str] = []
    for h in row.hash_ids:
        if len(toks) >= row.input_length:
            break
        t, s = _block(h)
        toks += t
        parts.append(s)
    text = "".join(parts)
    if len(toks) < row.input_length:  # unique filler: this row's own tail
        extra = row.input_length - len(toks)
        toks += [-(row.index + 1)] * extra
        text += (f"~{row.index:07x}" * (extra // 2 + 1))[: extra * CHARS_PER_TOKEN]  # "~" is in no block text
    return toks[: row.input_length], text[: row.input_length * CHARS_PER_TOKEN]


def ideal_hit_rate(rows: list[Row]) -> float:
    """Hit rate of an infinite single cache at 512-token-block granularity: a row's leading blocks
    seen in any earlier row hit (the last token of a full hit is still computed, ignored here)."""
    seen: set[int] = set()
    hit = total = 0
    for row in rows:
        k = 0
        for h in row.hash_ids:
            if h not in seen:
                break
            k += 1
        hit += min(row.input_length, k * BLOCK_TOKENS)
        total += row.input_length
        seen.update(row.hash_ids)
    return hit / total if total else 0.0


def iter_rows(rows: list[Row]) -> Iterator[tuple[Row, list[int], str]]:
    for row in rows:
        toks, text = tokens_and_text(row)
        yield row, toks, text

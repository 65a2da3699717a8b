"""Mooncake-format traces → prompts. Shared by the cluster mode and the benchmarks.

Each row is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``
and each hash id names a 512-token block. Block ``h`` becomes 2,048 characters of text (a
16-character pattern drawn from ``xxh64(h)``, repeated) and its tokens are exactly
``tokenizer.encode`` of that text (4 characters per token, ``replica.sim.tokenizer``). So rows
that share their first ``k`` hash ids share exactly ``k × 512`` tokens and ``k × 2048``
characters, whether a replica sees the token ids (cluster mode) or the text (benchmarks over
HTTP). Tokens past the listed blocks are the row's own (a pattern with ``~``, which no block has).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import xxhash

from replica.sim import tokenizer

DEFAULT_TRACE = pathlib.Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl"
"""The Mooncake synthetic trace, in the repository (``bench/data/README.md``): every study's default."""
BLOCK_TOKENS = 512
CHARS_PER_TOKEN = tokenizer.CHARS_PER_TOKEN


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


_PERIOD = 16  # characters; a multiple of CHARS_PER_TOKEN that divides a block's text


@lru_cache(maxsize=1 << 16)
def _encode(pattern: str) -> tuple[int, ...]:
    assert len(pattern) == _PERIOD, f"pattern {pattern!r} is not {_PERIOD} characters"
    return tuple(tokenizer.encode(pattern))


def _repeat(text: str, tokens: int) -> tuple[list[int], str]:
    """``tokens`` tokens of a repeated 16-character pattern, as ids and as text."""
    toks = _encode(text)
    reps = -(-tokens * CHARS_PER_TOKEN // _PERIOD)
    return list(toks * reps)[:tokens], (text * reps)[: tokens * CHARS_PER_TOKEN]


def tokens_and_text(row: Row) -> tuple[list[int], str]:
    """The row's prompt as token ids and as text; ``tokenizer.encode(text) == tokens``."""
    toks: list[int] = []
    parts: list[str] = []
    for h in row.hash_ids:
        if len(toks) >= row.input_length:
            break
        t, s = _repeat(f"{xxhash.xxh64_intdigest(str(h).encode()):016x}", BLOCK_TOKENS)
        toks += t
        parts.append(s)
    if len(toks) < row.input_length:
        tail = f"~{xxhash.xxh64_intdigest(f'tail{row.index}'.encode()):016x}"[:_PERIOD]
        t, s = _repeat(tail, row.input_length - len(toks))
        toks += t
        parts.append(s)
    n = row.input_length
    return toks[:n], "".join(parts)[: n * CHARS_PER_TOKEN]


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

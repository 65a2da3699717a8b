"""Benchmark workloads: lists of requests, deterministic for a given seed.

Text is built for the simulator's tokenizer (4 characters per token, ``replica.sim.tokenizer``):
every generated token is 4 characters, and every shared part is a whole number of tokens long,
so a shared text prefix of ``k`` tokens is a shared token prefix of ``k`` tokens.

- ``shared_prefix``: SGLang's ``generated-shared-prefix`` — ``groups`` system prompts, each followed
  by ``prompts_per_group`` distinct questions; the request order is shuffled (seeded).
- ``multi_turn``: chat sessions whose prompt is the whole history so far plus a new user turn; turn
  ``k`` of a session is sent after turn ``k-1`` has finished (``Req.after``).
- ``no_sharing``: every prompt is unique text (the control: no routing can find a hit).
- ``mooncake``: a Mooncake-format trace replayed through ``bench.mooncake_trace`` (each hash id is a
  512-token block of text; ``input_length``, ``output_length`` and ``timestamp`` honoured).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from bench import mooncake_trace as trace

CHARS_PER_TOKEN = 4
_ALPHABET = string.ascii_lowercase


@dataclass(frozen=True, slots=True)
class Req:
    prompt: str
    max_tokens: int
    at: float | None = None
    """Arrival offset in seconds (trace timestamps); None lets the load generator choose."""
    after: int | None = None
    """Index of an earlier request that must finish before this one is sent."""
    group: str = ""


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: tuple[Req, ...]

    def __post_init__(self) -> None:
        for i, r in enumerate(self.requests):
            assert r.after is None or r.after < i, f"{self.name}[{i}] depends on a later request {r.after}"


def words(rng: random.Random, tokens: int) -> str:
    """``tokens`` tokens of text: 3 random letters and a space each."""
    return "".join("".join(rng.choices(_ALPHABET, k=3)) + " " for _ in range(tokens))


def shared_prefix(
    groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    seed: int = 0,
) -> Workload:
    rng = random.Random(f"gsp:{seed}")
    reqs: list[Req] = []
    for g in range(groups):
        system = words(rng, system_prompt_len)
        reqs += [
            Req(system + words(rng, question_len), output_len, group=f"g{g}")
            for _ in range(prompts_per_group)
        ]
    rng.shuffle(reqs)
    return Workload("generated-shared-prefix", tuple(reqs))


def no_sharing(
    n: int = 512, input_len: int = 2176, output_len: int = 256, seed: int = 0, name: str = "no-sharing"
) -> Workload:
    rng = random.Random(f"none:{seed}")
    return Workload(name, tuple(Req(words(rng, input_len), output_len, group=f"u{i}") for i in range(n)))


def multi_turn(
    sessions: int = 32,
    turns: int = 6,
    system_len: int = 256,
    user_len: int = 128,
    answer_len: int = 128,
    seed: int = 0,
) -> Workload:
    """Request ``t * sessions + s`` is turn ``t`` of session ``s``; the history carries a fixed
    stand-in for each answer (the model's actual text is not fed back), so prompts are known ahead."""
    rng = random.Random(f"chat:{seed}")
    history = ["SYS:" + words(rng, system_len - 1) for _ in range(sessions)]  # tags are one token each
    reqs: list[Req] = []
    for t in range(turns):
        for s in range(sessions):
            history[s] += "USR:" + words(rng, user_len - 1) + "AST:"
            after = (t - 1) * sessions + s if t else None
            reqs.append(Req(history[s], answer_len, after=after, group=f"s{s}"))
            history[s] += words(rng, answer_len)
    return Workload("multi-turn", tuple(reqs))


def mooncake(path: str, limit: int | None = None, max_input_tokens: int | None = None) -> Workload:
    """Rows of a Mooncake trace; ``at`` is the row's timestamp (s). Rows longer than
    ``max_input_tokens`` are cut to it (their leading blocks, so sharing is kept)."""
    rows = trace.read(path, limit)
    if max_input_tokens is not None:
        rows = [_clip(r, max_input_tokens) for r in rows]
    reqs = [
        Req(text, row.output_length, at=row.arrival_s, group=f"r{row.index}")
        for row, _toks, text in trace.iter_rows(rows)
    ]
    return Workload("mooncake", tuple(reqs))


def _clip(row: trace.Row, max_tokens: int) -> trace.Row:
    if row.input_length <= max_tokens:
        return row
    keep = -(-max_tokens // trace.BLOCK_TOKENS)
    return trace.Row(row.index, row.arrival_s, max_tokens, row.output_length, row.hash_ids[:keep])

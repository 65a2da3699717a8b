"""``python -m bench.mktrace KIND ... -o FILE``: a generated workload as a Mooncake-format trace, so
cluster mode (``python -m bench.cluster --trace FILE``) can study it in discrete-event time, with
no wall-clock noise. Every kind is seeded (``--seed``): the same arguments write the same file.

- ``shared-prefix`` is SGLang's generated-shared-prefix in trace form: ``groups`` system prompts
  of ``system`` tokens (``system / 512`` shared hash ids each), every request adding one hash id of
  its own for its ``question`` tokens; requests in seeded random order with Poisson arrivals at
  ``rate``.
- ``scale`` writes ``copies`` disjoint copies of a trace (``--trace``, the Mooncake synthetic trace
  by default): copy ``c`` has every hash id ``h`` renamed ``h + c * (max id + 1)``, so no block is
  shared across copies, and its arrivals shifted by a seeded offset below the trace's mean gap,
  so the copies interleave. ``K`` copies on ``8 K`` replicas see the working set and the load per
  replica of one copy on 8: a fleet-size study with nothing else changed.
- ``multi-turn``: ``conversations`` chats starting as Poisson arrivals at ``rate`` per second,
  each on one of ``groups`` shared system prompts of ``system`` tokens, with about ``turns`` turns
  (uniform in 1..2·turns−1) an exponential think time (mean ``think`` s) apart. Turn ``t``'s prompt
  is the whole conversation so far: the system prompt, every earlier user message (about ``user``
  tokens each, uniform in ±50%) and answer (about ``output``), and the new message; its hash ids
  extend the previous turn's, so each turn shares the previous one's prompt. A conversation ends
  at its last turn or before its context passes ``max_context`` tokens. Many conversations are
  open at once (about ``rate × turns × think``), so the working set grows with the think time.

With ``--replicas N`` (and ``--profile``) it also prints, on stderr, the workload's hit-rate
ceilings at 512-token granularity (``bench.ceilings``): one infinite cache (ideal) and one LRU
cache of the ``N`` replicas' KV capacity together. Cluster mode reports both again, exactly, on
the engines' 16-token blocks.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator

from bench import ceilings
from bench import mooncake_trace as trace
from bench.mooncake_trace import BLOCK_TOKENS
from replica.sim.costmodel import profile

Rows = list[dict[str, object]]


def shared_prefix_rows(
    groups: int, prompts: int, system: int, question: int, output: int, rate: float, seed: int = 0
) -> Iterator[dict[str, object]]:
    if system % BLOCK_TOKENS or not 0 < question <= BLOCK_TOKENS or rate <= 0:
        raise ValueError(
            f"shared-prefix: system must be a multiple of {BLOCK_TOKENS} tokens, question 1..{BLOCK_TOKENS} "
            f"tokens and rate > 0 (got {system}, {question}, {rate})"
        )
    rng = random.Random(f"mktrace:{seed}")
    order = [g for g in range(groups) for _ in range(prompts)]
    rng.shuffle(order)
    per_group = system // BLOCK_TOKENS
    own = groups * per_group  # hash ids past the shared ones are each request's own
    t = 0.0
    for i, g in enumerate(order):
        t += rng.expovariate(rate)
        shared = list(range(g * per_group, (g + 1) * per_group))
        yield {
            "timestamp": round(t * 1000),
            "input_length": system + question,
            "output_length": output,
            "hash_ids": [*shared, own + i],
        }


def scale_rows(rows: Rows, copies: int, seed: int = 0) -> Rows:
    """``copies`` disjoint copies of ``rows`` (Mooncake dicts, in arrival order), interleaved.

    Copy ``c``'s hash ids are ``h + c * (max id + 1)``; its timestamps are shifted by a seeded
    whole number of milliseconds in ``[0, mean gap)`` (copy 0 by none). Output sorted by
    timestamp, ties by copy then row: deterministic."""
    if copies < 1:
        raise ValueError(f"scale: copies must be >= 1, got {copies}")
    if not rows:
        return []
    stride = 1 + max((h for r in rows for h in _ids(r)), default=-1)
    times = [int(_num(r["timestamp"])) for r in rows]
    gap = max(1, (max(times) - min(times)) // len(rows))
    rng = random.Random(f"mktrace-scale:{seed}")
    shifts = [0] + [rng.randrange(gap) for _ in range(copies - 1)]
    out: list[tuple[int, int, int, dict[str, object]]] = []
    for c, shift in enumerate(shifts):
        for i, (r, t) in enumerate(zip(rows, times, strict=True)):
            copy = dict(r)
            copy["timestamp"] = t + shift
            copy["hash_ids"] = [h + c * stride for h in _ids(r)]
            out.append((t + shift, c, i, copy))
    out.sort(key=lambda x: x[:3])
    return [r for *_, r in out]


def _ids(row: dict[str, object]) -> list[int]:
    ids = row["hash_ids"]
    assert isinstance(ids, list), f"hash_ids must be a list, got {ids!r}"
    return [int(h) for h in ids]


def _num(v: object) -> float:
    assert isinstance(v, int | float), f"expected a number, got {v!r}"
    return float(v)


def multi_turn_rows(
    conversations: int,
    turns: int,
    groups: int,
    system: int,
    user: int,
    output: int,
    rate: float,
    think: float,
    max_context: int,
    seed: int = 0,
) -> Rows:
    """The ``multi-turn`` workload (module docstring), rows in arrival order."""
    if (
        system % BLOCK_TOKENS
        or min(conversations, turns, groups, user, output) < 1
        or rate <= 0
        or think <= 0
    ):
        raise ValueError(
            f"multi-turn: system must be a multiple of {BLOCK_TOKENS} tokens; conversations, turns, groups, "
            f"user and output >= 1; rate and think > 0 (got system {system}, rate {rate}, think {think})"
        )
    if max_context <= system + 2 * user:
        raise ValueError(f"multi-turn: max_context {max_context} leaves no room past the system prompt")
    rng = random.Random(f"mktrace-multi-turn:{seed}")
    per_group = system // BLOCK_TOKENS
    next_id = groups * per_group  # ids below are the system prompts'
    out: list[tuple[float, int, int, dict[str, object]]] = []
    start = 0.0
    for c in range(conversations):
        start += rng.expovariate(rate)
        g = rng.randrange(groups)
        blocks = list(range(g * per_group, (g + 1) * per_group))
        n_turns = rng.randint(1, 2 * turns - 1)
        context, t = system, start
        for k in range(n_turns):
            context += rng.randint((user + 1) // 2, user * 3 // 2)
            if context > max_context:
                break
            while len(blocks) * BLOCK_TOKENS < context:  # the conversation's own blocks, grown as needed
                blocks.append(next_id)
                next_id += 1
            answer = rng.randint((output + 1) // 2, output * 3 // 2)
            row = {
                "timestamp": round(t * 1000),
                "input_length": context,
                "output_length": answer,
                "hash_ids": blocks[: -(-context // BLOCK_TOKENS)],
            }
            out.append((t, c, k, row))
            context += answer
            t += rng.expovariate(1.0 / think)
    out.sort(key=lambda x: x[:3])
    return [r for *_, r in out]


def report_ceilings(rows: Rows, replicas: int, profile_name: str) -> str:
    """The ideal and LRU hit rates at 512-token granularity (module docstring), as one line."""
    seqs = [(int(_num(r["input_length"])), _ids(r)) for r in rows]
    per_replica = profile(profile_name).num_gpu_blocks(16) * 16 // BLOCK_TOKENS
    cap = max(1, replicas * per_replica)
    ideal = ceilings.ideal_hit_rate(seqs, BLOCK_TOKENS)
    lru = ceilings.lru_hit_rate(seqs, BLOCK_TOKENS, cap)
    return (
        f"{len(rows)} requests; ideal {ideal:.3f}, LRU {lru:.3f} ({replicas} × {profile_name}: "
        f"{cap:,} blocks of {BLOCK_TOKENS} tokens)"
    )


def _read_raw(path: str) -> Rows:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mktrace", description=__doc__)
    sub = p.add_subparsers(dest="kind", required=True)
    gsp = sub.add_parser("shared-prefix", help="SGLang's generated-shared-prefix as a trace")
    gsp.add_argument("--groups", type=int, default=64)
    gsp.add_argument("--prompts", type=int, default=16, help="prompts per group")
    gsp.add_argument("--system", type=int, default=2048, help="system prompt tokens (a multiple of 512)")
    gsp.add_argument("--question", type=int, default=128)
    gsp.add_argument("--output", type=int, default=256)
    gsp.add_argument("--rate", type=float, required=True, help="Poisson arrivals per second")
    gsp.add_argument("--seed", type=int, default=0)
    sc = sub.add_parser("scale", help="K disjoint copies of a trace, arrivals interleaved")
    sc.add_argument("--trace", default=str(trace.DEFAULT_TRACE), help="Mooncake-format trace (JSONL)")
    sc.add_argument("--copies", type=int, required=True)
    mt = sub.add_parser("multi-turn", help="many concurrent conversations, contexts growing turn by turn")
    mt.add_argument("--conversations", type=int, default=1200)
    mt.add_argument("--turns", type=int, default=6, help="mean turns per conversation")
    mt.add_argument("--groups", type=int, default=16, help="distinct system prompts")
    mt.add_argument("--system", type=int, default=2048, help="system prompt tokens (a multiple of 512)")
    mt.add_argument("--user", type=int, default=512, help="mean tokens of a user message")
    mt.add_argument("--output", type=int, default=128, help="mean tokens of an answer")
    mt.add_argument("--rate", type=float, default=4.0, help="new conversations per second (Poisson)")
    mt.add_argument("--think", type=float, default=45.0, help="mean seconds between turns (exponential)")
    mt.add_argument("--max-context", type=int, default=32768, help="tokens; a conversation ends before this")
    for sp in (gsp, sc, mt):
        if sp is not gsp:
            sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("-o", "--out", default="-")
        sp.add_argument("--replicas", type=int, default=0, help="print the ceilings for N replicas (stderr)")
        sp.add_argument("--profile", default="h100-llama-3.1-8b", help="the replicas' cost-model profile")
    a = p.parse_args(argv)
    try:
        if a.kind == "shared-prefix":
            rows = list(
                shared_prefix_rows(a.groups, a.prompts, a.system, a.question, a.output, a.rate, a.seed)
            )
        elif a.kind == "scale":
            rows = scale_rows(_read_raw(a.trace), a.copies, a.seed)
        else:
            rows = multi_turn_rows(
                a.conversations,
                a.turns,
                a.groups,
                a.system,
                a.user,
                a.output,
                a.rate,
                a.think,
                a.max_context,
                a.seed,
            )
    except ValueError as err:
        p.error(str(err))
    if a.replicas:
        print(report_ceilings(rows, a.replicas, a.profile), file=sys.stderr)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if a.out == "-":
        sys.stdout.write(text)
    else:
        with open(a.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

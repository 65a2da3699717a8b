"""``python -m bench.mktrace shared-prefix ... -o FILE``: a generated workload as a Mooncake-format
trace, so cluster mode (``python -m bench.cluster --trace FILE``) can study it in
discrete-event time, with no wall-clock noise.

``shared-prefix`` is SGLang's generated-shared-prefix in trace form: ``groups`` system prompts of
``system`` tokens (``system / 512`` shared hash ids each), every request adding one hash id of its
own for its ``question`` tokens; requests in seeded random order with Poisson arrivals at ``rate``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator

from bench.mooncake_trace import BLOCK_TOKENS


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
    gsp.add_argument("-o", "--out", default="-")
    a = p.parse_args(argv)
    try:
        rows = list(shared_prefix_rows(a.groups, a.prompts, a.system, a.question, a.output, a.rate, a.seed))
    except ValueError as err:
        p.error(str(err))
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if a.out == "-":
        sys.stdout.write(text)
    else:
        with open(a.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

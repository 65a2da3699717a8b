"""``python -m bench.precise``: the precise prefix mode's hot-path cost.

1. **Token ids in hand** (a 32k- and a 240k-token prompt, 96 endpoints, every endpoint precise):
   the request's keys (``request_keys``), the index lookup across all endpoints (``match_many``),
   and the whole decision (``Router.route`` with the cost policy + ``start`` + ``finish``, which
   also hashes the routing text for the approximate fallback). The index is warm: every endpoint
   holds ``fill_blocks`` blocks of other prompts and a different-length piece of this prompt's
   shared 75% prefix (so the lookup walks deep for many endpoints at once). Target (issue 10): a
   32k-token prompt in at most 2 ms. llm-d #2390 reports 674 ms and 13 GB for 240k tokens over 96
   pods; the index's traced memory for that fill is reported too.
2. **Tokenization** of a 32k-token prompt with the model's tokenizer (a byte-level BPE trained here,
   as the test model's): cold (nothing cached) and when a cached request shares all but its last
   ~2k tokens (a document + a new question), plus a chat request's template rendering.

Prints a markdown table; ``--json`` writes the figures. Timings are medians over ``--iters``
repetitions with the 10th-90th percentile spread: wall-clock, or with ``--clock cpu`` this
thread's CPU time (``time.thread_time``), which other processes on a shared machine move far less.
The script imports ``picker`` from ``PYTHONPATH``, so one copy of it times any tree side by side:
``PYTHONSAFEPATH=1 PYTHONPATH=TREE python bench/precise.py ...``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass

from picker.core.config import PrefixConfig, RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint
from picker.core.prefix.hashing import block_hashes, seed_for
from picker.core.prefix.precise import PreciseIndex, State, Sync, request_keys
from picker.core.request import InferenceRequest
from picker.core.router import Router

BS = 16
ENDPOINTS = 96


@dataclass(frozen=True)
class Timing:
    what: str
    tokens: int
    endpoints: int
    p50_ms: float
    p10_ms: float
    p90_ms: float


CLOCK: Callable[[], float] = time.perf_counter
"""What :func:`timed` reads (``--clock``)."""


def timed(what: str, tokens: int, endpoints: int, fn: Callable[[], object], iters: int) -> Timing:
    fn()  # warm
    gc.collect()
    samples = []
    clock = CLOCK
    for _ in range(iters):
        t0 = clock()
        fn()
        samples.append((clock() - t0) * 1000)
    q = statistics.quantiles(samples, n=10) if len(samples) >= 2 else samples * 9
    return Timing(what, tokens, endpoints, statistics.median(samples), q[0], q[8])


def _router(n: int, max_blocks: int, mode: str = "precise") -> Router:
    pool = Pool()
    pool.set_endpoints(Endpoint("10.0.0.1", 8000 + i) for i in range(n))
    prefix = PrefixConfig(mode="approximate")
    if mode == "precise":
        prefix = PrefixConfig(mode="precise", block_size=BS, max_blocks_per_endpoint=max_blocks)
    router = Router(RouterConfig(policy="cost", prefix=prefix), pool)
    if mode == "precise":
        for s in pool:
            router.syncs[s.key] = Sync(State.SYNCED, expected=0)
    return router


def _fill_approximate(
    router: Router, keys: list[str], text: str, fill_blocks: int, rng: random.Random, holders: int = 0
) -> None:
    """:func:`_fill` for the approximate index: every endpoint was sent ``fill_blocks`` blocks of
    other text and a different-length piece of ``text``'s first 75%."""
    cfg = router.cfg.hashing
    seed = seed_for("m")
    whole = block_hashes(text, seed, cfg)
    shared = len(whole) * 3 // 4
    for i, key in enumerate(keys):
        router.index.record(key, [rng.getrandbits(63) for _ in range(fill_blocks)])
        depth = shared * (i + 1) // len(keys) if i >= len(keys) - (holders or len(keys)) else 0
        if depth:
            router.index.record(key, whole[:depth])


def _fill(
    index: PreciseIndex,
    keys: list[str],
    prompt: list[int],
    fill_blocks: int,
    rng: random.Random,
    holders: int = 0,
) -> None:
    """Other traffic on every endpoint, and a piece of ``prompt``'s shared prefix on each (on the
    last ``holders`` only, the deepest pieces, if not 0)."""
    shared = len(prompt) * 3 // 4 // BS * BS
    eh = iter(range(1, 1 << 62))
    for i, key in enumerate(keys):
        other = [rng.randrange(2048) for _ in range(fill_blocks * BS)]
        index.stored(key, [next(eh) for _ in range(fill_blocks)], None, other, BS, None)
        depth = shared * (i + 1) // len(keys) // BS * BS if i >= len(keys) - (holders or len(keys)) else 0
        if depth:
            index.stored(key, [next(eh) for _ in range(depth // BS)], None, prompt[:depth], BS, None)


def hot_path_approximate(
    tokens: int, iters: int, fill_blocks: int, seed: int = 0, endpoints: int = ENDPOINTS, holders: int = 0
) -> Timing:
    """The whole decision in approximate mode (no token ids: the routing text is hashed), the
    index filled as :func:`_fill_approximate` says."""
    rng = random.Random(seed)
    text = " ".join(str(rng.randrange(2048)) for _ in range(tokens))  # ~4.5 chars a "token"
    router = _router(endpoints, 0, "approximate")
    _fill_approximate(router, [s.key for s in router.pool], text, fill_blocks, rng, holders)
    req = InferenceRequest(model="m", routing_text=text)

    def decide() -> None:
        router.finish(router.start(router.route(req)))

    return timed("whole decision, approximate", tokens, endpoints, decide, iters)


def hot_path(
    tokens: int, iters: int, fill_blocks: int, seed: int = 0, endpoints: int = ENDPOINTS, holders: int = 0
) -> tuple[list[Timing], int]:
    rng = random.Random(seed)
    prompt = [rng.randrange(2048) for _ in range(tokens)]
    router = _router(endpoints, fill_blocks + tokens // BS + 1)
    assert router.precise is not None
    keys = [s.key for s in router.pool]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    _fill(router.precise, keys, prompt, fill_blocks, rng, holders)
    index_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    text = " ".join(map(str, prompt))
    req = InferenceRequest(model="m", routing_text=text, prompt_token_ids=prompt)
    rkeys = request_keys(prompt, BS)
    idx = router.precise

    def decide() -> None:
        d = router.route(req)
        assert d.keys is not None, "precise matching applied"
        router.finish(router.start(d))

    out = [
        timed("request keys", tokens, endpoints, lambda: request_keys(prompt, BS), iters),
        timed("index lookup", tokens, endpoints, lambda: idx.match_many(keys, rkeys, 0.0), iters),
        timed("whole decision", tokens, endpoints, decide, iters),
    ]
    return out, index_bytes


_WORDS = ["the", "cache", "prefix", "token", "router", "replica", "model", "request", "system", "prompt"]


def _corpus(n: int, seed: int = 0) -> list[str]:
    """Word-salad lines like the test model's training text (``replica.tinymodel``)."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(rng.randrange(5, 40)))
        for _ in range(n)
    ]


def _tokenizer_dir(tmp: str) -> str:
    import pathlib

    from bench.progressive import write_bpe

    write_bpe(pathlib.Path(tmp), _corpus(2000))
    return tmp


def tokenization(iters: int, target_tokens: int = 32_768, seed: int = 1) -> list[Timing]:
    import tempfile

    from picker.core.tokenize import load

    with tempfile.TemporaryDirectory() as tmp:
        path = _tokenizer_dir(tmp)
        tok = load(path)
        words = " ".join(_corpus(20000, seed=seed)).split(" ")
        doc: list[str] = []
        for n, w in enumerate(words, 1):  # a document of about target_tokens - 2k tokens
            doc.append(w)
            if n % 500 == 0 and len(tok.tok.encode(" ".join(doc)).ids) >= target_tokens - 2048:
                break
        document = " ".join(doc)
        questions = [" ".join(_corpus(60, seed=seed + i + 1)) for i in range(4 * iters + 8)]
        qi = iter(questions)
        full = document + " " + questions[0]
        ntok = len(tok.tok.encode(full).ids)

        def cold() -> None:
            fresh = load(path, cache_entries=0)
            fresh.encode({"prompt": document + " " + next(qi)}, "/v1/completions")

        cold_tok = load(path, cache_entries=0)
        warm_tok = load(path)
        warm_tok.encode({"prompt": full}, "/v1/completions")
        chat_doc = {
            "messages": [{"role": "system", "content": document}, {"role": "user", "content": questions[1]}]
        }
        assert warm_tok.chat is not None
        chat = warm_tok.chat
        return [
            timed("tokenize, cold (tokenizer loaded each time)", ntok, 0, cold, max(3, iters // 4)),
            timed(
                "tokenize, cold",
                ntok,
                0,
                lambda: cold_tok.encode({"prompt": document + " " + next(qi)}, "/v1/completions"),
                iters,
            ),
            timed(
                "tokenize, shared prefix cached",
                ntok,
                0,
                lambda: warm_tok.encode({"prompt": document + " " + next(qi)}, "/v1/completions"),
                iters,
            ),
            timed("chat template render", ntok, 0, lambda: chat.render(chat_doc), iters),
        ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.precise", description=__doc__)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--fill-blocks", type=int, default=2000, help="other blocks held by every endpoint")
    p.add_argument("--tokens", default="32768,245760", help="prompt sizes in tokens, comma-separated")
    p.add_argument(
        "--endpoints", default=str(ENDPOINTS), help="endpoint counts, comma-separated (memory: the first)"
    )
    p.add_argument("--no-tokenize", action="store_true", help="skip part 2 (tokenization)")
    p.add_argument(
        "--approximate", action="store_true", help="also time the whole decision in approximate mode"
    )
    p.add_argument(
        "--holders",
        type=int,
        default=0,
        help="endpoints holding a piece of the prompt (0: all, the worst case)",
    )
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: this thread's CPU time")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time if a.clock == "cpu" else time.perf_counter
    rows: list[Timing] = []
    memory: dict[int, int] = {}
    counts = [int(x) for x in a.endpoints.split(",")]
    for n in map(int, a.tokens.split(",")):
        for i, count in enumerate(counts):
            timings, mem = hot_path(n, a.iters, a.fill_blocks, endpoints=count, holders=a.holders)
            rows += timings
            if a.approximate:
                rows.append(
                    hot_path_approximate(n, a.iters, a.fill_blocks, endpoints=count, holders=a.holders)
                )
            if i == 0:
                memory[n] = mem
    if not a.no_tokenize:
        rows += tokenization(a.iters)
    print("| step | prompt tokens | endpoints | p50 ms | p10-p90 ms |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r.what} | {r.tokens:,} | {r.endpoints or '-'} | {r.p50_ms:.3f} | {r.p10_ms:.3f}-{r.p90_ms:.3f} |"
        )
    for n, mem in memory.items():
        e = counts[0]
        blocks = e * a.fill_blocks + sum(n * 3 // 4 // BS * (i + 1) // e for i in range(e))
        print(
            f"index memory, {n:,}-token prompts over {e} endpoints: {mem / 2**20:.1f} MiB "
            f"for {blocks:,} (block, endpoint) entries ({mem / blocks:.0f} B each)"
        )
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump({"timings": [asdict(r) for r in rows], "index_bytes": memory}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

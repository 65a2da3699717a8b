"""In-process picker cost: decisions per second and per-decision latency, and index bytes per entry.

A decision is what the ext_proc server does per request once the body is parsed:
``Router.route`` (hash the routing text, look up every endpoint's LRU, run the cost policy) +
``Router.start`` (record the pick in the index, account) + ``Router.finish``.

The index is warmed the way a busy pool looks: every endpoint holds ``fill_blocks`` blocks of other
traffic, and each of ``groups`` shared prefixes (a system prompt or document taking
``shared_fraction`` of the prompt) is held by two endpoints. Each measured request is one group's
prefix plus a unique suffix, so every decision hashes the whole prompt and finds a partial match.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import tracemalloc
from dataclasses import dataclass

from picker.core.config import RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint
from picker.core.prefix.hashing import MASK60, HashConfig, block_hashes, seed_for
from picker.core.prefix.index import PrefixIndex
from picker.core.request import InferenceRequest
from picker.core.router import Router

WORDS = [f"w{i:x}" for i in range(4096)]


def text(rng: random.Random, chars: int) -> str:
    """ASCII prose-like text of exactly ``chars`` characters."""
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


@dataclass(frozen=True)
class PickResult:
    prompt_chars: int
    endpoints: int
    decisions: int
    p50_us: float
    p99_us: float
    decisions_per_s: float
    blocks: int


def _router(n_endpoints: int) -> Router:
    pool = Pool()
    pool.set_endpoints(Endpoint("10.0.0.1", 8000 + i) for i in range(n_endpoints))
    return Router(RouterConfig(policy="cost"), pool)


def _warm(router: Router, prefixes: list[str], fill_blocks: int, rng: random.Random) -> None:
    keys = [s.key for s in router.pool]
    for key in keys:  # other traffic: unrelated blocks
        router.index.record(key, [rng.getrandbits(60) & MASK60 for _ in range(fill_blocks)])
    seed = seed_for("m")
    for g, prefix in enumerate(prefixes):  # each shared prefix sits on two endpoints
        hashes = block_hashes(prefix, seed, router.cfg.hashing)
        for key in (keys[g % len(keys)], keys[(g * 7 + 3) % len(keys)]):
            router.index.record(key, hashes)


def measure_pick(
    prompt_chars: int,
    n_endpoints: int,
    *,
    min_decisions: int = 300,
    min_seconds: float = 1.0,
    groups: int = 16,
    shared_fraction: float = 0.75,
    fill_blocks: int = 8000,
    seed: int = 0,
) -> PickResult:
    rng = random.Random(seed)
    router = _router(n_endpoints)
    shared = int(prompt_chars * shared_fraction)
    prefixes = [text(rng, shared) for _ in range(groups)]
    _warm(router, prefixes, fill_blocks, rng)
    suffixes = [text(rng, prompt_chars - shared) for _ in range(64)]
    reqs = [
        InferenceRequest(model="m", routing_text=prefixes[i % groups] + suffixes[i % 64], request_id=str(i))
        for i in range(256)
    ]
    lat: list[float] = []
    route, start, finish, clock = router.route, router.start, router.finish, time.perf_counter
    gc.collect()
    t_begin = clock()
    i = 0
    while i < min_decisions or clock() - t_begin < min_seconds:
        req = reqs[i % len(reqs)]
        t0 = clock()
        finish(start(route(req)))
        lat.append(clock() - t0)
        i += 1
    total = clock() - t_begin
    q = statistics.quantiles(lat, n=100)
    blocks = len(block_hashes(reqs[0].routing_text, 0, router.cfg.hashing))
    return PickResult(prompt_chars, n_endpoints, i, q[49] * 1e6, q[98] * 1e6, i / total, blocks)


@dataclass(frozen=True)
class MemoryResult:
    endpoints: int
    capacity_blocks: int
    entries: int
    bytes_total: int
    bytes_per_entry: float


def measure_memory(
    n_endpoints: int = 8, capacity: int = 31_250, prompt_chars: int = 8192, seed: int = 0
) -> MemoryResult:
    """Fill every endpoint's LRU to steady state (several segment rotations) with hashes made by
    the real hasher, then divide the traced bytes the index holds by its entries. The int objects
    the dicts keep alive are counted: they are part of what an entry costs."""
    rng = random.Random(seed)
    cfg = HashConfig()
    docs = [text(rng, prompt_chars) for _ in range(64)]
    keys = [f"10.0.0.1:{8000 + i}" for i in range(n_endpoints)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(capacity)
    per_endpoint = 0
    n = 0
    while per_endpoint < 3 * capacity:
        seed_n = n  # a unique seed per request: distinct blocks, realistic int objects
        hashes = block_hashes(docs[n % len(docs)], seed_n, cfg)
        index.record(keys[n % n_endpoints], hashes)
        n += 1
        per_endpoint = n * len(hashes) // n_endpoints
    del hashes
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    entries = index.size()
    return MemoryResult(n_endpoints, capacity, entries, used, used / entries)

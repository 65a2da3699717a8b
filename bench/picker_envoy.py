"""Throughput through a real Envoy + picker, against the same upstreams hit directly.

The stack is the one the Envoy tests use (``kvlaunch``): ``python -m kvlaunch.upstream``
upstreams, ``python -m picker`` (TLS ext_proc, cost policy), and Envoy rendered by
``deploy/envoy/render.py``. A fixed number of aiohttp workers post 32 KB ``/v1/completions`` bodies
(16 shared prefixes, unique tails) for ``duration_s``; the baseline posts the same bodies straight
to the upstreams, round-robin. Both runs report requests/s and latency percentiles.
"""

from __future__ import annotations

import asyncio
import itertools
import pathlib
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import aiohttp
import orjson

from bench.picker_inproc import text
from kvlaunch import stack


@dataclass(frozen=True)
class LoadResult:
    target: str
    concurrency: int
    body_bytes: int
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float


def bodies(body_bytes: int, n: int = 256, groups: int = 16, seed: int = 0) -> list[bytes]:
    """``n`` JSON bodies of about ``body_bytes`` bytes: a group's shared 3/4 plus a unique tail."""
    rng = random.Random(seed)
    shared = [text(rng, body_bytes * 3 // 4) for _ in range(groups)]
    out = []
    for i in range(n):
        prompt = shared[i % groups] + text(rng, body_bytes // 4 - 64)
        out.append(orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}))
    return out


async def drive(
    urls: list[str], payloads: list[bytes], concurrency: int, duration_s: float, target: str
) -> LoadResult:
    """``concurrency`` workers post back to back until ``duration_s`` has passed."""
    lat: list[float] = []
    errors = 0
    next_url = itertools.cycle(urls).__next__
    next_body = itertools.cycle(payloads).__next__
    headers = {"content-type": "application/json"}
    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as http:

        async def worker(deadline: float) -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    async with http.post(next_url(), data=next_body(), headers=headers) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors += 1

        # a short warm-up opens the connections and the picker's gRPC streams
        await asyncio.gather(*(worker(time.perf_counter() + 0.5) for _ in range(concurrency)))
        lat.clear()
        errors = 0
        t_begin = time.perf_counter()
        await asyncio.gather(*(worker(t_begin + duration_s) for _ in range(concurrency)))
        seconds = time.perf_counter() - t_begin
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else [float("nan")] * 99
    return LoadResult(
        target,
        concurrency,
        len(payloads[0]),
        len(lat),
        errors,
        seconds,
        len(lat) / seconds,
        q[49] * 1e3,
        q[98] * 1e3,
    )


def measure_envoy(
    body_bytes: int = 32 * 1024, concurrency: int = 16, duration_s: float = 10.0, upstreams: int = 4
) -> tuple[LoadResult, LoadResult]:
    """(direct to upstreams, through Envoy + picker) at the same concurrency and bodies."""
    payloads = bodies(body_bytes)
    with (
        tempfile.TemporaryDirectory(prefix="kvpick-bench-") as tmp,
        stack(pathlib.Path(tmp), n=upstreams) as st,
    ):
        direct_urls = [f"http://127.0.0.1:{p}/v1/completions" for p in st.upstreams]
        direct = asyncio.run(drive(direct_urls, payloads, concurrency, duration_s, "direct"))
        via = asyncio.run(
            drive([st.url + "/v1/completions"], payloads, concurrency, duration_s, "envoy+picker")
        )
        st.wait_in_flight_zero(timeout=30)
    return direct, via

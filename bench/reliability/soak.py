"""Soak: the picker under steady load for minutes, watching its memory and its in-flight counters.

Two simulated replicas (``replica.sim``, H100 + Llama-3.1-8B profile, real time), the picker and a
real Envoy. Capacity is measured first (closed loop, 64 streams, ``calibrate_s``); the soak then
sends Poisson arrivals at ``load_fraction`` of it for ``minutes``: streamed completions of 16
prompt families (a shared 2 KB prefix each, a unique question) and 32 output tokens. The picker's
RSS (VmRSS) and the prefix index's size (``inference_extension_prefix_indexer_size``) are
sampled every 5 s. Every request carries a unique question, so the index inserts a block or two
per request until it reaches its bound (per endpoint: derived from the replica's KV cache size,
or ``index_capacity`` with derivation off); RSS grows with it. Warm-up therefore ends at
``warmup_s`` or when the index first holds 90% of the most it held in the run, whichever is
later (at its bound the segmented LRU's size swings by a segment, so its peak is noise), and RSS growth is measured from there: a bounded fill is not growth, a leak is. Where the
index was still filling at the end, ``index_filled`` is false and the growth figure says nothing.
"""

from __future__ import annotations

import asyncio
import pathlib
import random
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvlaunch import PY, Procs, Stack, free_port, wait_port

from . import checks

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class Counts:
    ok: int = 0
    failed: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


def _body(rnd: random.Random) -> dict[str, Any]:
    family = rnd.randrange(16)
    prefix = f"System prompt of family {family}: answer as a careful assistant. " * 30
    return {
        "model": MODEL,
        "prompt": prefix + f" Question {rnd.random()}?",
        "max_tokens": 32,
        "stream": True,
    }


async def _send(session: aiohttp.ClientSession, url: str, body: dict[str, Any], counts: Counts) -> None:
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            raw = await resp.read()
            status = resp.status
    except (TimeoutError, aiohttp.ClientError):
        status, raw = 0, b""
    counts.statuses[status] = counts.statuses.get(status, 0) + 1
    if status == 200 and b"[DONE]" in raw:
        counts.ok += 1
    else:
        counts.failed += 1


async def capacity(url: str, seconds: float, concurrency: int = 64) -> float:
    """Completed requests per second with ``concurrency`` streams back to back."""
    rnd, counts = random.Random(1), Counts()
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def worker() -> None:
            while time.monotonic() < deadline:
                await _send(session, url, _body(rnd), counts)

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        took = time.monotonic() - start
    return counts.ok / took


def index_blocks(metrics_port: int) -> int:
    """The picker's ``inference_extension_prefix_indexer_size`` gauge."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("inference_extension_prefix_indexer_size"):
                return int(float(line.split()[-1]))
    raise RuntimeError("the picker exports no inference_extension_prefix_indexer_size")


def warm_end(samples: list[tuple[float, int, int]], warmup_s: float) -> float:
    """Seconds into the run where warm-up ends: ``warmup_s``, or the first sample where the index
    held 90% of the most it ever held, whichever is later."""
    most = max(blocks for _, _, blocks in samples)
    filled = next(t for t, _, blocks in samples if blocks >= 0.9 * most)
    return max(warmup_s, filled)


async def soak(
    tmp: pathlib.Path,
    minutes: float,
    load_fraction: float = 0.8,
    calibrate_s: float = 30.0,
    warmup_s: float = 60.0,
    index_capacity: int = 0,
    picker_env: dict[str, str] | None = None,
    picker_args: tuple[str, ...] = (),
    envoy_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``index_capacity`` > 0: the picker's per-endpoint index bound, not derived from the
    replicas (a small bound fills in seconds: what is left of the growth is not the index).
    ``picker_env``, ``picker_args`` and ``envoy_args`` vary the picker's environment (e.g. an
    ``LD_PRELOAD``ed allocator), its flags and render.py's, to find where memory goes by
    switching one thing off at a time."""
    st = Stack(Procs(tmp), [free_port(), free_port()])
    try:
        for i, port in enumerate(st.upstreams):
            args = [PY, "-m", "replica.sim", "--port", str(port), "--model", MODEL]
            proc = st.procs.start(f"sim{i}", [*args, "--profile", "h100-llama-3.1-8b"])
            await asyncio.to_thread(wait_port, port, 60.0, proc=proc)
        args = list(picker_args)
        if index_capacity:
            cfg = tmp / "picker.yaml"
            cfg.write_text(f"index: {{capacity_blocks: {index_capacity}, derive_capacity: false}}\n")
            args += ["--config-file", str(cfg)]
        await asyncio.to_thread(lambda: st.start_picker(*args, env=picker_env))
        await asyncio.to_thread(st.start_envoy, *envoy_args)
        picker = next(p for n, p in st.procs.procs if n == "picker")
        cap = await capacity(st.url, min(calibrate_s, 10 + minutes * 60 / 10))
        rate = cap * load_fraction
        rnd, counts = random.Random(7), Counts()
        samples: list[tuple[float, int, int]] = []
        """(seconds into the run, RSS KiB, index blocks)"""
        start = time.monotonic()
        end = start + minutes * 60
        tasks: set[asyncio.Task[None]] = set()
        next_sample = start
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            t = start
            while t < end:
                t += rnd.expovariate(rate)
                now = time.monotonic()
                if now >= next_sample:
                    blocks = await asyncio.to_thread(index_blocks, st.metrics_port)
                    samples.append((now - start, rss_kib(picker.pid), blocks))
                    next_sample += 5.0
                if t > now:
                    await asyncio.sleep(t - now)
                task = asyncio.create_task(_send(session, st.url, _body(rnd), counts))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        blocks = await asyncio.to_thread(index_blocks, st.metrics_port)
        samples.append((time.monotonic() - start, rss_kib(picker.pid), blocks))
        warm = warm_end(samples, min(warmup_s, minutes * 60 / 4))
        after_warmup = next(kib for s, kib, _ in samples if s >= warm)
        final = samples[-1][1]
        return {
            "capacity_rps": round(cap, 2),
            "rate_rps": round(rate, 2),
            "minutes": minutes,
            "requests": counts.ok + counts.failed,
            "failed": counts.failed,
            "statuses": counts.statuses,
            "rss_kib_after_warmup": after_warmup,
            "rss_kib_end": final,
            "rss_kib_max": max(kib for _, kib, _ in samples),
            "index_capacity": index_capacity or "derived from the replicas",
            "warmup_end_s": round(warm, 1),
            "index_filled": warm < samples[-1][0] - 60,
            "index_blocks_end": samples[-1][2],
            "rss_growth_pct": round(100.0 * (final - after_warmup) / after_warmup, 2),
            "in_flight_after": checks.wait_in_flight_zero(st.metrics_port),
            "rss_samples": samples,
        }
    finally:
        st.procs.stop()

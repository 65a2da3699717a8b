"""Soak: the picker under steady load for minutes, watching its memory and its in-flight counters.

Two simulated replicas (``replica.sim``, H100 + Llama-3.1-8B profile, real time), the picker and a
real Envoy. Capacity is measured first (closed loop, 64 streams, ``calibrate_s``); the soak then
sends Poisson arrivals at ``load_fraction`` of it for ``minutes``: streamed completions of 16
prompt families (a shared 2 KB prefix each, a unique question) and 32 output tokens. The picker's
RSS (VmRSS) is sampled every 5 s; growth is measured from the end of ``warmup_s``.
"""

from __future__ import annotations

import asyncio
import pathlib
import random
import time
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


async def soak(
    tmp: pathlib.Path,
    minutes: float,
    load_fraction: float = 0.8,
    calibrate_s: float = 30.0,
    warmup_s: float = 60.0,
) -> dict[str, Any]:
    st = Stack(Procs(tmp), [free_port(), free_port()])
    try:
        for i, port in enumerate(st.upstreams):
            args = [PY, "-m", "replica.sim", "--port", str(port), "--model", MODEL]
            proc = st.procs.start(f"sim{i}", [*args, "--profile", "h100-llama-3.1-8b"])
            await asyncio.to_thread(wait_port, port, 60.0, proc=proc)
        await asyncio.to_thread(st.start_picker)
        await asyncio.to_thread(st.start_envoy)
        picker = next(p for n, p in st.procs.procs if n == "picker")
        cap = await capacity(st.url, min(calibrate_s, 10 + minutes * 60 / 10))
        rate = cap * load_fraction
        rnd, counts = random.Random(7), Counts()
        samples: list[tuple[float, int]] = []
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
                    samples.append((now - start, rss_kib(picker.pid)))
                    next_sample += 5.0
                if t > now:
                    await asyncio.sleep(t - now)
                task = asyncio.create_task(_send(session, st.url, _body(rnd), counts))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        samples.append((time.monotonic() - start, rss_kib(picker.pid)))
        warm = min(warmup_s, minutes * 60 / 4)
        after_warmup = next(kib for s, kib in samples if s >= warm)
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
            "rss_kib_max": max(kib for _, kib in samples),
            "rss_growth_pct": round(100.0 * (final - after_warmup) / after_warmup, 2),
            "in_flight_after": checks.wait_in_flight_zero(st.metrics_port),
            "rss_samples": samples,
        }
    finally:
        st.procs.stop()

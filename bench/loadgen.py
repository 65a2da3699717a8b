"""Streaming load generator (aiohttp): open loop (Poisson or trace timestamps) or closed loop.

Every request is a streamed ``/v1/completions`` with ``stream_options.include_usage`` and an
``x-request-id`` (``LABEL-INDEX``, a fresh random label per run) that Envoy, the peers and vLLM
carry into their own logs and traces (``bench.split`` joins them on it); the outcome records the
id, the wall-clock send time, TTFT (first chunk carrying a choice: vLLM streams one per token even when the
token's text is empty, as a partial UTF-8 sequence of the tiny model's byte-level BPE is), the gaps between text chunks (ITL), end-to-end
latency, ``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``, or the error.

A request with ``after`` set waits until that request has finished (multi-turn sessions); in the
open loop it is then sent at once, in the closed loop it holds its worker until then.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import orjson
from tqdm import tqdm

from .workloads import Req, Workload

Mode = Literal["poisson", "trace", "closed"]


@dataclass
class LoadConfig:
    mode: Mode = "poisson"
    rate: float = 10.0
    """Poisson arrivals per second (mode ``poisson``)."""
    time_scale: float = 1.0
    """Trace timestamps are multiplied by this (mode ``trace``; < 1 compresses the trace)."""
    concurrency: int = 16
    """Requests in flight (mode ``closed``)."""
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    seed: int = 0
    timeout_s: float = 600.0
    progress: bool = True
    label: str = ""


@dataclass
class Outcome:
    index: int
    ok: bool = False
    error: str = ""
    sent_at: float = 0.0
    """Seconds after the run started."""
    request_id: str = ""
    """The ``x-request-id`` it was sent with."""
    sent_wall: float = 0.0
    """``time.time()`` just before it was sent: the clock Envoy's access log and vLLM's traces use."""
    status: int = 0
    """The HTTP status answered (0: none, the request failed before one came)."""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


def arrival_times(w: Workload, cfg: LoadConfig) -> list[float | None]:
    """Planned send offsets for the open loop; None for requests gated on another one."""
    rng = random.Random(f"arrivals:{cfg.seed}")
    t = 0.0
    out: list[float | None] = []
    for r in w.requests:
        if r.after is not None:
            out.append(None)
        elif cfg.mode == "trace" and r.at is not None:
            out.append(r.at * cfg.time_scale)
        else:
            t += rng.expovariate(cfg.rate)
            out.append(t)
    return out


async def send(
    http: aiohttp.ClientSession,
    url: str,
    req: Req,
    o: Outcome,
    model: str,
    headers: Mapping[str, str] | None = None,
) -> None:
    """One streamed completion into ``o``; ``headers`` are added to the request's (an objective,
    a fairness id)."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = {**_JSON, **(headers or {}), **({"x-request-id": o.request_id} if o.request_id else {})}
    o.sent_wall = time.time()
    t0 = time.perf_counter()
    last = 0.0
    try:
        async with http.post(url + "/v1/completions", data=orjson.dumps(body), headers=sent) as resp:
            o.status = resp.status
            if resp.status != 200:
                o.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                doc = orjson.loads(line[6:])
                choices = doc.get("choices") or []
                if choices:  # a token, even one whose text is empty (a partial UTF-8 sequence)
                    now = time.perf_counter() - t0
                    if o.ttft == 0.0:
                        o.ttft = now
                    else:
                        o.itl.append(now - last)
                    last = now
                usage = doc.get("usage")
                if usage:
                    o.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    o.output_tokens = int(usage.get("completion_tokens") or 0)
                    o.cached_tokens = int(
                        (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    )
        o.e2e = time.perf_counter() - t0
        o.ok = o.ttft > 0 and o.prompt_tokens > 0
        if not o.ok:
            o.error = "stream ended without text or usage"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        o.error = f"{exc.__class__.__name__}: {exc}"[:200]


_JSON = {"content-type": "application/json"}


async def run(urls: list[str], w: Workload, cfg: LoadConfig) -> tuple[list[Outcome], float]:
    """Send the workload; returns the outcomes (in request order) and the run's wall time."""
    assert urls, "no target URL"
    run_id = uuid.uuid4().hex[:12]
    outcomes = [Outcome(i, request_id=f"{run_id}-{i}") for i in range(len(w.requests))]
    finished = [asyncio.Event() for _ in w.requests]
    next_url: Callable[[], str] = itertools.cycle(urls).__next__
    bar = tqdm(
        total=len(w.requests), desc=cfg.label or w.name, disable=None if cfg.progress else True, leave=False
    )
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    t_start = time.perf_counter()
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:

        async def one(i: int) -> None:
            req = w.requests[i]
            if req.after is not None:
                await finished[req.after].wait()
            outcomes[i].sent_at = time.perf_counter() - t_start
            await send(http, next_url(), req, outcomes[i], cfg.model)
            finished[i].set()
            bar.update(1)

        if cfg.mode == "closed":
            await _closed(one, len(w.requests), cfg.concurrency)
        else:
            await _open(one, arrival_times(w, cfg), t_start)
    bar.close()
    return outcomes, time.perf_counter() - t_start


async def _open(one: Callable[[int], Awaitable[None]], times: list[float | None], t_start: float) -> None:
    async def at(i: int, t: float | None) -> None:
        if t is not None:
            await asyncio.sleep(max(0.0, t_start + t - time.perf_counter()))
        await one(i)

    await asyncio.gather(*(at(i, t) for i, t in enumerate(times)))


async def _closed(one: Callable[[int], Awaitable[None]], n: int, concurrency: int) -> None:
    todo = iter(range(n))

    async def worker() -> None:
        for i in todo:
            await one(i)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))

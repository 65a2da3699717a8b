"""Streaming load through Envoy, recorded request by request, so a fault's effect can be read back.

Each of ``concurrency`` workers sends streamed completions back to back (``chunks`` SSE events
``delay`` seconds apart, so streams are in flight when a fault strikes) and records when each
started and ended, its status, which replica served it, whether the picker chose it (Envoy passed
the ``x-gateway-destination-endpoint`` header on) and whether the stream reached ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Record:
    start: float
    end: float = 0.0
    status: int = 0
    served_by: int = 0
    picked: bool = False
    """The picker chose the endpoint (fail-open's fallback route did not)."""
    complete: bool = False
    error: str = ""
    dest: str = ""
    """The primary the picker named (its ip:port; the replica's own port alone can repeat)."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.complete


@dataclass
class Load:
    url: str
    concurrency: int = 16
    chunks: int = 5
    delay: float = 0.04
    timeout: float = 60.0
    records: list[Record] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> list[Record]:
        """Send until :meth:`stop`; returns every record (in-flight ones finish first)."""
        tmo = aiohttp.ClientTimeout(total=self.timeout)
        conn = aiohttp.TCPConnector(limit=self.concurrency)
        async with aiohttp.ClientSession(timeout=tmo, connector=conn) as session:
            await asyncio.gather(*(self._worker(session) for _ in range(self.concurrency)))
        return self.records

    async def _worker(self, session: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            await self.one(session)

    async def one(self, session: aiohttp.ClientSession, chunks: int | None = None) -> Record:
        rec = Record(start=time.monotonic())
        self.records.append(rec)
        n = next(self._ids)
        body = {
            "model": "m",
            "prompt": f"request {n}: " + "reliability load " * 8,
            "stream": True,
            "chunks": chunks or self.chunks,
            "delay": self.delay,
        }
        try:
            async with session.post(self.url + "/v1/completions", json=body) as resp:
                rec.status = resp.status
                raw = await resp.read()
            _read_stream(rec, raw)
        except (TimeoutError, aiohttp.ClientError) as err:
            rec.error = type(err).__name__
        rec.end = time.monotonic()
        return rec


def _read_stream(rec: Record, raw: bytes) -> None:
    for event in raw.split(b"\n\n"):
        if event == b"data: [DONE]":
            rec.complete = True
        elif event.startswith(b"data: {") and not rec.served_by:
            doc = json.loads(event[6:])
            rec.served_by = int(doc["served_by"])
            rec.dest = str(doc.get("dest_header", "")).split(",")[0]
            rec.picked = bool(rec.dest)


def summary(records: list[Record]) -> dict[str, int]:
    return {
        "requests": len(records),
        "ok": sum(r.ok for r in records),
        "failed": sum(not r.ok for r in records),
    }

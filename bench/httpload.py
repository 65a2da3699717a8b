"""A closed-loop HTTP/1.1 load generator in the standard library: ``bench.datapath``'s stand-in for
``wrk`` where no ``wrk`` binary can be had (the offline GPU node, CI).

    python -m bench.httpload http://127.0.0.1:8080/v1/chat/completions --body FILE -c 64 -d 5

Each of ``processes`` processes (one per CPU of ``cpus`` when given, each pinned to its CPU with
``os.sched_setaffinity``) keeps its share of ``connections`` keep-alive connections busy: it sends
the one fixed POST, reads the whole answer (``content-length`` or chunked; a ``connection: close``
answer opens a new connection) and sends the next, until the duration is up. It reports what
``wrk``'s summary script reports (:data:`bench.datapath.LUA`): requests completed within the
duration, errors (connect, read, write, timeout), answers other than 2xx/3xx, and the p50 and p99
latency in microseconds.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import multiprocessing
import os
import pathlib
import socket
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

TIMEOUT_S = 10.0
"""Per request, as the ``--timeout 10s`` ``bench.datapath`` gives ``wrk``."""


@dataclass
class Tally:
    requests: int = 0
    errors: int = 0
    status_errors: int = 0


class _Closed(Exception):
    """The server closed the connection (after ``connection: close``, or mid-answer)."""


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """One whole HTTP/1.1 answer off ``reader``: (status, whether the server closes after it)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        raise _Closed from exc
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length, chunked, close = -1, False, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            close = b"close" in value.lower()
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                    pass
                break
            await reader.readexactly(size + 2)
    elif length >= 0:
        await reader.readexactly(length)
    else:  # neither: the body runs to the end of the connection
        await reader.read()
        close = True
    return status, close


async def _connection(
    host: str, port: int, request: bytes, deadline: float, tally: Tally, latencies: array.array[float]
) -> None:
    writer: asyncio.StreamWriter | None = None
    while time.monotonic() < deadline:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
                writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.monotonic()
            writer.write(request)
            status, close = await asyncio.wait_for(_read_answer(reader), TIMEOUT_S)
            done = time.monotonic()
            if done <= deadline:
                tally.requests += 1
                latencies.append(done - t0)
                if not 200 <= status < 400:
                    tally.status_errors += 1
            if close:
                writer.close()
                writer = None
        except (OSError, _Closed, TimeoutError, asyncio.IncompleteReadError, ValueError):
            if time.monotonic() < deadline:
                tally.errors += 1
            if writer is not None:
                writer.close()
                writer = None
            await asyncio.sleep(0.01)
    if writer is not None:
        writer.close()


def _process(
    url: str, body: bytes, connections: int, duration: float, cpu: int | None, start_at: float
) -> tuple[Tally, bytes]:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    u = urllib.parse.urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    request = (
        f"POST {u.path or '/'} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    tally, latencies = Tally(), array.array("d")

    async def main() -> None:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))  # every process starts together
        deadline = time.monotonic() + duration
        await asyncio.gather(
            *(_connection(host, port, request, deadline, tally, latencies) for _ in range(connections))
        )

    asyncio.run(main())
    return tally, latencies.tobytes()


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))]


def run(
    url: str, body: bytes, connections: int, duration: float, cpus: Sequence[int] = (), processes: int = 0
) -> dict[str, int]:
    """Drive ``url`` for ``duration`` seconds; ``wrk``'s summary (the module doc). ``processes``
    defaults to one per CPU of ``cpus`` (at most one per connection), else 1."""
    n = max(1, min(connections, processes or len(cpus) or 1))
    shares = [connections // n + (i < connections % n) for i in range(n)]
    start_at = time.monotonic() + 0.3
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(n) as pool:
        results = pool.starmap(
            _process,
            [
                (url, body, shares[i], duration, cpus[i % len(cpus)] if cpus else None, start_at)
                for i in range(n)
            ],
        )
    total, lat = Tally(), array.array("d")
    for t, raw in results:
        total.requests += t.requests
        total.errors += t.errors
        total.status_errors += t.status_errors
        lat.frombytes(raw)
    ordered = sorted(lat)
    return {
        "requests": total.requests,
        "duration_us": round(duration * 1e6),
        "errors": total.errors,
        "status_errors": total.status_errors,
        "p50_us": round(_percentile(ordered, 50) * 1e6),
        "p99_us": round(_percentile(ordered, 99) * 1e6),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.httpload", description=__doc__)
    p.add_argument("url")
    p.add_argument("--body", required=True, help="file holding the JSON body to POST")
    p.add_argument("-c", "--connections", type=int, default=16)
    p.add_argument("-d", "--duration", type=float, default=5.0, help="seconds")
    p.add_argument("--cpus", default="", help="comma-separated CPUs, one process pinned to each")
    p.add_argument("--processes", type=int, default=0, help="default: one per --cpus entry, else 1")
    a = p.parse_args(argv)
    cpus = [int(c) for c in a.cpus.split(",") if c]
    body = pathlib.Path(a.body).read_bytes()
    print(json.dumps(run(a.url, body, a.connections, a.duration, cpus, a.processes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

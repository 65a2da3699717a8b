"""A slow-body flood: many clients that send their request headers and then trickle the body,
while normal requests flow through the same Envoy (issue 23 item 4).

Each slow client is a raw loopback socket (asyncio): a ``POST /v1/completions`` whose headers
declare a body (a ``content-length``, or chunked encoding) and which then sends one byte of it
every ``trickle_s`` seconds, never finishing, until Envoy answers or ``hold_s`` passes. Normal
clients send small completions back to back over their own connections meanwhile. The outcome:
the slow clients' answers by status (0: closed with no answer, -1: no connection) and the normal
requests' statuses and latencies.

    flood(port, slow=5000, normal=4, hold_s=30)      # from a coroutine; see run_stack()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

NORMAL_BODY = b'{"model":"m","prompt":"a normal request","max_tokens":1}'
SLOW_BODY_BYTES = 4096
"""What a slow client's headers declare (a small body: one Envoy would otherwise buffer whole)."""
NO_ANSWER, NO_CONNECTION = 0, -1


def _head(length: int | None, keep_alive: bool = False) -> bytes:
    size = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    conn = "keep-alive" if keep_alive else "close"
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: kvpick\r\nContent-Type: application/json\r\n{size}\r\n"
        f"Connection: {conn}\r\n\r\n"
    ).encode()


async def _status(reader: asyncio.StreamReader) -> int:
    """The status of the response ``reader`` starts with (NO_ANSWER: closed before one)."""
    line = await reader.readline()
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return NO_ANSWER
    return int(parts[1])


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a content-length (Envoy's and the replicas'): status, body."""
    status = await _status(reader)
    if status == NO_ANSWER:
        return status, b""
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    return status, await reader.readexactly(length) if length else b""


def post_chunked(port: int, body: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    """POST ``body`` chunked (no content-length), at once; the status and the whole answer's body
    (the connection closes after it)."""
    import socket

    wire = _head(None) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(wire)
        while chunk := s.recv(65536):
            got += chunk
    head, _, rest = got.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        rest = dechunk(rest)
    return int(head.split(b" ", 2)[1]), rest


def dechunk(raw: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body (``raw``: what follows the response head)."""
    out, rest = b"", raw
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, rest = out + rest[:n], rest[n + 2 :]
    return out


@dataclass
class Outcome:
    """What one flood saw."""

    slow: collections.Counter[int] = field(default_factory=collections.Counter)
    """Slow clients by answer status (0: closed with no answer, -1: never connected)."""
    slow_bodies: list[bytes] = field(default_factory=list)
    """The first few answer bodies of slow clients (to check the 408's JSON)."""
    slow_answer_s: list[float] = field(default_factory=list)
    """Per answered slow client: seconds from its headers to the answer."""
    normal: collections.Counter[int] = field(default_factory=collections.Counter)
    normal_s: list[float] = field(default_factory=list)
    """Latency of each normal request that got a 200 (seconds)."""
    connected: int = 0
    """Slow clients whose connection and headers went through."""

    def summary(self) -> dict[str, Any]:
        ok = self.normal.get(200, 0)
        sent = sum(self.normal.values())
        lat = sorted(self.normal_s)
        return {
            "slow_clients": sum(self.slow.values()),
            "slow_connected": self.connected,
            "slow_statuses": {str(k): v for k, v in sorted(self.slow.items())},
            "slow_408": self.slow.get(408, 0),
            "slow_answer_s_median": round(statistics.median(self.slow_answer_s), 2)
            if self.slow_answer_s
            else None,
            "normal_sent": sent,
            "normal_statuses": {str(k): v for k, v in sorted(self.normal.items())},
            "normal_success_pct": round(100.0 * ok / sent, 2) if sent else None,
            "normal_p50_ms": round(1000 * lat[len(lat) // 2], 1) if lat else None,
            "normal_p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1) if lat else None,
            "normal_max_ms": round(1000 * lat[-1], 1) if lat else None,
        }


async def slow_client(
    port: int, out: Outcome, chunked: bool, trickle_s: float, hold_s: float, connected: asyncio.Event
) -> None:
    """One slow client (module doc). Records its answer's status in ``out``."""
    start = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
    except (OSError, TimeoutError):
        out.slow[NO_CONNECTION] += 1
        return
    status = NO_ANSWER
    try:
        start_of_body = b'{"model":"m","prompt":"'
        writer.write(_head(None if chunked else SLOW_BODY_BYTES))
        writer.write(b"%x\r\n%s\r\n" % (len(start_of_body), start_of_body) if chunked else start_of_body)
        await writer.drain()
        out.connected += 1
        connected.set()
        answer = asyncio.ensure_future(_read_response(reader))
        deadline = start + hold_s
        sent = 0
        while not answer.done() and time.monotonic() < deadline and sent < SLOW_BODY_BYTES - 64:
            await asyncio.wait({answer}, timeout=trickle_s)
            if answer.done():
                break
            with contextlib.suppress(OSError):
                writer.write(b"1\r\nx\r\n" if chunked else b"x")
                sent += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(answer), max(0.1, deadline - time.monotonic()))
        if answer.done() and not answer.cancelled() and answer.exception() is None:
            status, body = answer.result()
            if len(out.slow_bodies) < 3:
                out.slow_bodies.append(body)
            out.slow_answer_s.append(time.monotonic() - start)
        else:
            answer.cancel()
    except (OSError, asyncio.IncompleteReadError, ValueError):
        pass
    finally:
        out.slow[status] += 1
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def normal_client(port: int, out: Outcome, stop: asyncio.Event, timeout: float) -> None:
    """Small completions back to back, a fresh connection each (as many clients would), until
    ``stop``; each status and each 200's latency go to ``out``."""
    request = _head(len(NORMAL_BODY)) + NORMAL_BODY
    while not stop.is_set():
        start = time.monotonic()
        status = NO_CONNECTION
        writer = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
            writer.write(request)
            status, _ = await asyncio.wait_for(_read_response(reader), timeout)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            status = NO_ANSWER if writer is not None else NO_CONNECTION
        finally:
            if writer is not None:
                writer.close()
        out.normal[status] += 1
        if status == 200:
            out.normal_s.append(time.monotonic() - start)


async def flood(
    port: int,
    slow: int,
    normal: int = 4,
    hold_s: float = 30.0,
    trickle_s: float = 1.0,
    chunked: bool = False,
    ramp_per_s: float = 2000.0,
    normal_timeout: float = 10.0,
) -> Outcome:
    """``slow`` slow clients, opened at ``ramp_per_s``, and ``normal`` normal clients sending from
    the first slow connection until every slow client has its answer (or its ``hold_s``)."""
    out = Outcome()
    stop = asyncio.Event()
    first = asyncio.Event()
    slows: list[asyncio.Task[None]] = []
    normals: list[asyncio.Task[None]] = []
    step = max(1, int(ramp_per_s / 20))
    for i in range(0, slow, step):
        for _ in range(min(step, slow - i)):
            slows.append(asyncio.create_task(slow_client(port, out, chunked, trickle_s, hold_s, first)))
        await asyncio.sleep(0.05)
        if first.is_set() and not normals:
            normals = [
                asyncio.create_task(normal_client(port, out, stop, normal_timeout)) for _ in range(normal)
            ]
    if not normals:
        await asyncio.wait_for(first.wait(), 30)
        normals = [asyncio.create_task(normal_client(port, out, stop, normal_timeout)) for _ in range(normal)]
    await asyncio.gather(*slows)
    stop.set()
    await asyncio.gather(*normals)
    return out


def start_stack(
    procs: Any,
    replicas: int,
    render_args: tuple[str, ...] = (),
    picker_args: tuple[str, ...] = (),
    shipped: str = "",
) -> Any:
    """Simulated replicas (model ``m``), the picker (plus ``picker_args``) and Envoy (the default
    rendered config, or the ``shipped`` one: kvlaunch.envoy_configs, plus ``render_args``),
    routable. ``procs`` (a :class:`kvlaunch.Procs`) owns them all. Imported late, so that the tree
    on ``PYTHONPATH`` (another one's, for a before figure) provides them."""
    from kvlaunch import PY, Stack, envoy_configs, free_port, wait_port

    ports = [free_port() for _ in range(replicas)]
    for i, p in enumerate(ports):
        procs.start(f"replica-{i}", [PY, "-m", "replica.sim", "--port", str(p), "--model", "m"])
    st = Stack(procs, ports)
    st.start_picker(*picker_args)
    for p in ports:
        wait_port(p, 60, procs=procs)
    if shipped:
        envoy_configs.start_envoy(st, shipped, *render_args)
    else:
        st.start_envoy(*render_args)
    st.wait_routable({"model": "m", "prompt": "warm", "max_tokens": 1})
    return st


def envoy_stats(admin_port: int, names: tuple[str, ...]) -> dict[str, int]:
    """Envoy's counters and gauges whose names end with one of ``names`` (its admin ``/stats``)."""
    from kvlaunch import http

    _, body, _ = http("GET", f"http://127.0.0.1:{admin_port}/stats")
    out: dict[str, int] = {}
    for line in body.decode().splitlines():
        key, _, value = line.partition(": ")
        if key.endswith(names) and value.strip().isdigit():
            out[key] = int(value)
    return out


class PeakGauge:
    """Polls one of Envoy's gauges (admin ``/stats``) every ``every_s`` in a thread; ``peak`` is
    the largest value seen."""

    def __init__(self, admin_port: int, name: str, every_s: float = 0.2) -> None:
        import threading

        self.admin_port, self.name, self.every_s = admin_port, name, every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                self.peak = max(self.peak, *envoy_stats(self.admin_port, (self.name,)).values(), 0)
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakGauge:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)


COUNTERS = (
    "kvpick.downstream_rq_timeout",
    "kvpick.downstream_cx_overload_reject",
    "kvpick_picker.upstream_rq_503",
    "kvpick_picker.upstream_rq_total",
    "kvpick_picker.health_check.failure",
    "kvpick_picker_streamed.upstream_rq_503",
    "kvpick_picker_streamed.upstream_rq_total",
    "ext_proc.streams_started",
)
"""Envoy's counters a flood reports (suffixes of their names)."""


def run(
    slow: int,
    normal: int = 4,
    hold_s: float = 30.0,
    trickle_s: float = 1.0,
    chunked: bool = False,
    replicas: int = 2,
    render_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One stack, one flood (module doc); the summary, Envoy's counters of it and the most
    ext_proc streams open to the picker at once (sampled every 0.2 s)."""
    import pathlib
    import tempfile

    from kvlaunch import Procs

    with tempfile.TemporaryDirectory() as tmp:
        procs = Procs(pathlib.Path(tmp))
        try:
            log = pathlib.Path(tmp) / "access.log"
            st = start_stack(procs, replicas, (*render_args, "--access-log", str(log)))
            started = time.monotonic()
            with PeakGauge(st.admin_port, "cluster.kvpick_picker.upstream_rq_active") as gauge:
                out = asyncio.run(flood(st.envoy_port, slow, normal, hold_s, trickle_s, chunked))
            took = time.monotonic() - started
            stats = envoy_stats(st.admin_port, COUNTERS)
            time.sleep(0.5)  # Envoy flushes its access log every 250 ms here
            answers = collections.Counter(
                f"{line['status']} {line.get('details', '')}"
                for line in map(json.loads, log.read_text().splitlines())
            )
            alive = all(p.poll() is None for _, p in procs.procs)
        finally:
            procs.stop()
    return out.summary() | {
        "seconds": round(took, 1),
        "peak_picker_streams": gauge.peak,
        "envoy": stats,
        "envoy_answers": dict(answers.most_common()),
        "all_alive": alive,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slow", type=int, default=5000)
    p.add_argument("--normal", type=int, default=4, help="normal clients, each back to back")
    p.add_argument("--hold", type=float, default=30.0, help="a slow client gives up after this many s")
    p.add_argument("--trickle", type=float, default=1.0, help="seconds between a slow client's bytes")
    p.add_argument("--chunked", action="store_true", help="slow bodies sent chunked (no content-length)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--render-args", default="", help="extra render.py flags (one string)")
    a = p.parse_args(argv)
    got = run(a.slow, a.normal, a.hold, a.trickle, a.chunked, a.replicas, tuple(a.render_args.split()))
    print(json.dumps(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m bench.parse_stall``: what one large request body costs every other request.

A real picker process (plaintext ext_proc, 4 static endpoints) serves two gRPC clients:

- a prober (this process) sends small completions requests one after another through the
  ext_proc protocol (headers, one body chunk with end-of-stream) and times each answer;
- a sender (a separate process) sends large bodies (an 8 MiB chat request carrying a base64 image,
  or an 8 MiB text prompt) in 1 MiB chunks as Envoy sends them (``--chunk-kib``), one every ``--gap`` seconds.

The stall is how much longer a probe took than the baseline median while a large body was being
parsed: we report the worst probe latency and the p99 during the large-body run, against the
baseline run with no large bodies. Two pickers run side by side in one invocation: with parsing
offloaded (the default, ``parse_offload_bytes`` 512 KiB) and with it inline (0). Each
configuration is run ``--repeats`` times; medians and ranges are printed as markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import multiprocessing
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench import looplag
from kvlaunch import Procs, Stack, free_port

CHUNK = 1024 * 1024
"""Full-duplex body chunk: what Envoy sent the picker under the shipped config (its listener's
buffer limit is ``--stream-bodies-over`` + 64 KiB): 9 messages for an 8 MiB body."""


def _headers(path: str = "/v1/chat/completions") -> pb.HttpHeaders:
    hs = [
        base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
    ]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs))


MODES = {
    "buffered": processing_mode_pb2.ProcessingMode.BUFFERED,
    "full-duplex": processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
}
"""Request body modes, as Envoy announces them in ``protocol_config``: BUFFERED (the shipped
configs' default) sends the body as one message; FULL_DUPLEX_STREAMED (what the shipped configs use for bodies over 1 MiB) in ``--chunk-kib`` chunks."""
PICKED = {"buffered": "request_body", "full-duplex": "request_headers"}
"""The response that carries the pick, per mode."""


def _messages(
    body: bytes, path: str, mode: str = "full-duplex", chunk: int = CHUNK
) -> Iterator[pb.ProcessingRequest]:
    cfg = pb.ProtocolConfiguration(request_body_mode=MODES[mode])
    yield pb.ProcessingRequest(request_headers=_headers(path), protocol_config=cfg)
    if mode == "buffered":
        yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        return
    for start in range(0, len(body), chunk):
        last = start + chunk >= len(body)
        yield pb.ProcessingRequest(
            request_body=pb.HttpBody(body=body[start : start + chunk], end_of_stream=last)
        )


def big_body(kind: str, size: int) -> tuple[bytes, str]:
    """A body of at most ``size`` bytes (the picker's 8 MiB limit answers 413 past it: a body
    over it measures the rejection, not the parse) and the path it is sent to."""
    slack = 512  # the JSON around the payload
    if kind == "image":
        raw = os.urandom((size - slack) * 3 // 4)
        url = "data:image/png;base64," + base64.b64encode(raw).decode()
        parts = [
            {"type": "text", "text": "Describe this image."},
            {"type": "image_url", "image_url": {"url": url}},
        ]
        doc = {"model": "m", "messages": [{"role": "user", "content": parts}]}
        return orjson.dumps(doc), "/v1/chat/completions"
    words = "lorem ipsum dolor sit amet consectetur " * ((size - slack) // 39)
    return orjson.dumps({"model": "m", "prompt": words}), "/v1/completions"


def _send_big(
    port: int, kind: str, size: int, count: int, gap: float, ready: object, mode: str, chunk: int
) -> None:
    """The sender process: ``count`` large bodies, one every ``gap`` seconds."""
    body, path = big_body(kind, size)
    opts = [("grpc.max_send_message_length", 2 * size)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        ready.set()  # type: ignore[attr-defined]
        for _ in range(count):
            time.sleep(gap)
            for resp in stub.Process(_messages(body, path, mode, chunk), timeout=60):
                got = resp.WhichOneof("response")
                assert got != "immediate_response", f"the large body was not routed: {resp}"
                if got == PICKED[mode] and resp.HasField("dynamic_metadata"):
                    break  # the pick is made


async def _probe(stub: pb_grpc.ExternalProcessorStub, body: bytes) -> float:
    t0 = time.perf_counter()
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=_headers("/v1/completions")))
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    await call.read()
    dt = time.perf_counter() - t0
    await call.done_writing()
    call.cancel()
    return dt


async def _probe_for(port: int, seconds: float) -> list[float]:
    body = orjson.dumps({"model": "m", "prompt": "a short question about the weather " * 8})
    out: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        for _ in range(20):  # warm the channel and the picker
            await _probe(stub, body)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            out.append(await _probe(stub, body))
    return out


@dataclass
class Picker:
    """One arrangement under test: the probes go to ``port``, the large bodies to ``big_port``
    (the same picker, or a second process); ``lag`` is the probes' picker's loop-lag record."""

    port: int
    big_port: int
    lag: pathlib.Path


def start_picker(
    name: str, offload_bytes: int, procs: Procs, watched: bool = True
) -> tuple[int, pathlib.Path]:
    """A picker (plaintext ext_proc, no Envoy: the probes speak ext_proc themselves) through the
    shared launcher, over 4 endpoints that are never scraped, run under :mod:`bench.looplag` when
    ``watched``; returns its ext_proc port and its loop-lag record."""
    d = procs.run_dir / name
    d.mkdir(exist_ok=True)
    cfg = d / "config.yaml"
    cfg.write_text(f"parse_offload_bytes: {offload_bytes}\n")
    lag = d / "lag.txt"
    lag.touch()
    st = Stack(Procs(d), [free_port() for _ in range(4)])
    entry = ("-m", "bench.looplag", str(lag)) if watched else ("-m", "picker")
    try:
        args = ["--secure-serving", "false", "--scrape-interval", "3600", "--config-file", str(cfg)]
        st.start_picker(*args, debug=False, entry=entry)
    finally:
        procs.procs += [(f"{name}/{n}", p) for n, p in st.procs.procs]
    time.sleep(1.5)  # the parse worker spawns at start
    return st.grpc_port, lag


LAYOUTS = ("one", "split")
"""``one``: the large bodies go to the probes' picker (what a pod serves today); ``split``: to a
second picker process on its own port (what a separate large-body ext_proc cluster would do), so the
probes' picker never touches them and only the machine is shared."""


def start_pickers(layouts: list[str], parsing: list[str], procs: Procs) -> dict[str, Picker]:
    out: dict[str, Picker] = {}
    for parse in parsing:
        offload = 512 * 1024 if parse == "offload" else 0
        for layout in layouts:
            name = parse if layout == "one" else f"{parse}, split"
            port, lag = start_picker(name.replace(", ", "-"), offload, procs)
            big = port
            if layout == "split":
                big, _ = start_picker(f"{parse}-large", offload, procs, watched=False)
            out[name] = Picker(port, big, lag)
    return out


def _worst_lag(lag: pathlib.Path, start: float, end: float) -> tuple[float, float]:
    """The picker loop's longest late wake-up that began in [start, end) and the main thread's
    CPU in it (ms; low CPU: the loop was waiting for a core, not running a long step)."""
    rows = [r for r in looplag.read(str(lag)) if start <= r[0] < end]
    worst = max(rows, key=lambda r: r[1], default=(0.0, 0.0, 0.0, 0.0))
    return worst[1], worst[2]


def run_once(
    picker: Picker, kind: str, size: int, count: int, gap: float, mode: str, chunk: int = CHUNK
) -> dict[str, float]:
    seconds = count * gap + 1.5
    t0 = time.monotonic()
    base = asyncio.run(_probe_for(picker.port, seconds))
    t1 = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    args = (picker.big_port, kind, size, count, gap, ready, mode, chunk)
    sender = ctx.Process(target=_send_big, args=args)
    sender.start()
    ready.wait(30)
    t2 = time.monotonic()
    loaded = asyncio.run(_probe_for(picker.port, seconds))
    t3 = time.monotonic()
    sender.join(60)
    loaded_lag = _worst_lag(picker.lag, t2, t3)
    p50 = statistics.median(base)
    q = statistics.quantiles(loaded, n=100)
    return {
        "base_p50_ms": p50 * 1e3,
        "base_max_ms": max(base) * 1e3,
        "loaded_p99_ms": q[98] * 1e3,
        "loaded_max_ms": max(loaded) * 1e3,
        "stall_ms": (max(loaded) - p50) * 1e3,
        "base_lag_ms": _worst_lag(picker.lag, t0, t1)[0],
        "loaded_lag_ms": loaded_lag[0],
        "loaded_lag_cpu_ms": loaded_lag[1],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.parse_stall", description=__doc__)
    p.add_argument("--size-mib", type=float, default=8.0)
    p.add_argument("--kinds", default="image,text")
    p.add_argument("--bodies", type=int, default=5, help="large bodies per run")
    p.add_argument("--gap", type=float, default=0.6, help="seconds between large bodies")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="buffered,full-duplex", help=f"request body modes: {','.join(MODES)}")
    p.add_argument(
        "--chunk-kib", default=str(CHUNK // 1024), help="full-duplex body chunk sizes, comma-separated"
    )
    p.add_argument("--layouts", default="one", help=f"where the large bodies go: {','.join(LAYOUTS)}")
    p.add_argument("--parsing", default="offload,inline", help="offload (the default config), inline")
    a = p.parse_args(argv)
    size = int(a.size_mib * 1024 * 1024)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        procs = Procs(pathlib.Path(tmp))
        try:
            pickers = start_pickers(a.layouts.split(","), a.parsing.split(","), procs)
            chunks = [int(c) for c in a.chunk_kib.split(",")]
            for mode, kind in itertools.product(a.modes.split(","), a.kinds.split(",")):
                for kib in chunks if mode == "full-duplex" else chunks[:1]:
                    runs: dict[str, list[dict[str, float]]] = {n: [] for n in pickers}
                    for _ in range(a.repeats):
                        for name, picker in pickers.items():  # side by side, interleaved
                            runs[name].append(run_once(picker, kind, size, a.bodies, a.gap, mode, kib * 1024))
                    label = f"{mode} ({kib} KiB chunks)" if mode == "full-duplex" else mode
                    for name, rs in runs.items():
                        rows.append((label, kind, name, rs))
        finally:
            procs.stop()
    print(f"{a.size_mib:g} MiB bodies, {a.bodies} per run, {a.repeats} runs; median [min–max] over runs\n")
    print(
        "| body mode | body | parsing | probe p50 no load ms | worst probe no load ms | probe p99 with large bodies ms "
        "| worst probe ms | stall ms | picker loop's longest gap no load ms | with large bodies ms "
        "| its main-thread CPU ms |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, kind, name, rs in rows:

        def cell(key: str, rs: list[dict[str, float]] = rs) -> str:
            vals = [r[key] for r in rs]
            return f"{statistics.median(vals):.1f} [{min(vals):.1f}–{max(vals):.1f}]"

        print(
            f"| {mode} | {kind} | {name} | {cell('base_p50_ms')} | {cell('base_max_ms')} | {cell('loaded_p99_ms')} | "
            f"{cell('loaded_max_ms')} | {cell('stall_ms')} | {cell('base_lag_ms')} | {cell('loaded_lag_ms')} | "
            f"{cell('loaded_lag_cpu_ms')} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

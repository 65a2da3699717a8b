"""``python -m bench.extproc_floor``: the ext_proc transport's CPU floor (issue 24). What a gRPC
ext_proc server with no picker code costs per request behind a real Envoy, for server variants:

    flock /tmp/kvpick-heavy.lock python -m bench.extproc_floor            # 3 repeats, the table
    python -m bench.extproc_floor --requests 5 --repeats 1 --idle 0.2      # a dry run

Envoy runs with ``deploy/envoy/render.py``'s shipped defaults (BUFFERED request body, response
body NONE, the response path SKIPped unless asked, ORIGINAL_DST; TLS to ext_proc, with the client
certificate the launcher's stacks present) in front of one fixed-response upstream
(``kvlaunch.upstream --fixed``). Its ext_proc cluster points at :func:`serve`, a minimal server
answering the shipped protocol as the picker does with ``--response-headers when-needed``: the
request headers with an empty answer carrying the ``mode_override`` that skips the response path,
the buffered body with the destination header (``clear_route_cache``) and the ``envoy.lb``
metadata, anything else with an empty answer; after Envoy's half-close it waits for the reset
(the picker's ``STATUS_LINGER_S``), except where a variant says not to. It serves gRPC health on
the same port, as the picker does (Envoy health-checks it every 0.5 s).

Each run starts a fresh server, sends warm-up requests, measures its idle CPU rate over
``--idle`` seconds, then sends ``--requests`` chat bodies of the size at a steady rate (open
loop, ``--rate`` per second) through Envoy and reads the server's CPU (every thread's run time,
``/proc/PID/task/*/schedstat``, ns; the same kernel accounting as utime+stime in
``/proc/PID/stat`` without its 10 ms ticks) from the first request to ``--tail`` seconds after
the last answer. CPU ms per request answered 200, net of the idle rate over the window. Runs are
interleaved (repeat 1 of every variant and size, then repeat 2, ...); the table gives medians
with [min-max].
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import pathlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import aiohttp
import yaml

from kvlaunch.procs import PY, Procs, free_port, wait_port
from kvlaunch.stack import Stack

from .progressive import cpu_s

CHAT = "/v1/chat/completions"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LINGER_S = 2.0
"""As the picker's ``STATUS_LINGER_S``: how long a finished stream waits for Envoy's reset."""
SIZES = {"1k": 1024, "400k": 400 * 1024}


@dataclass(frozen=True)
class Variant:
    server: str
    """``aio`` (``grpc.aio``, as the picker), ``uvloop`` (the same on uvloop's event loop),
    ``sync`` (``grpc.server`` on a ThreadPoolExecutor), ``sync-handoff`` (the same, each message
    answered by a coroutine on an asyncio loop in another thread, as a sync front to the picker's
    loop-bound director would have to) or ``grpclib`` (grpclib's pure-Python asyncio server over
    h2; not a dependency: install it to run these)."""
    tls: bool = True
    """TLS with a required client certificate (the picker's ``--client-ca-path``), or plaintext
    (the picker's ``--secure-serving false``, Envoy's ``--plaintext``)."""
    linger: bool = True
    options: tuple[tuple[str, Any], ...] = ()
    oghttp2: bool = False
    """Envoy's picker clusters on the oghttp2 codec (``use_oghttp2_codec``) instead of Envoy's
    default, nghttp2. nghttp2 sends DATA frames of at most 16 KiB whatever the server's
    ``SETTINGS_MAX_FRAME_SIZE``; oghttp2 honours it (``python -m bench.h2_frames``)."""
    note: str = ""


VARIANTS = {
    "aio-tls": Variant("aio", note="as the picker ships: grpc.aio, mTLS"),
    "aio-plain": Variant("aio", tls=False, note="grpc.aio, plaintext"),
    "aio-tls-nolinger": Variant("aio", linger=False, note="returns at Envoy's half-close"),
    "aio-tls-throughput": Variant(
        "aio", options=(("grpc.optimization_target", "throughput"),), note="grpc.optimization_target"
    ),
    "aio-tls-h2window": Variant(
        "aio",
        options=(("grpc.http2.lookahead_bytes", 4 << 20), ("grpc.http2.max_frame_size", 4 << 20)),
        note="grpc.aio, HTTP/2 stream window and frame size 4 MiB (a 400 KB body in one window)",
    ),
    "aio-tls-nobdp": Variant(
        "aio", options=(("grpc.http2.bdp_probe", 0),), note="grpc.aio, no BDP probe pings"
    ),
    "aio-tls-frame16m": Variant(
        "aio",
        options=(("grpc.http2.max_frame_size", (1 << 24) - 1),),
        note="grpc.aio, SETTINGS_MAX_FRAME_SIZE 16 MiB-1 (Envoy may send larger DATA frames)",
    ),
    "aio-tls-readchunk": Variant(
        "aio",
        options=(
            ("grpc.experimental.tcp_read_chunk_size", 512 << 10),
            ("grpc.experimental.tcp_min_read_chunk_size", 256 << 10),
            ("grpc.experimental.tcp_max_read_chunk_size", 4 << 20),
        ),
        note="grpc.aio, TCP reads of 512 KiB (min 256 KiB, max 4 MiB) instead of 8 KiB adaptive",
    ),
    "aio-tls-oghttp2": Variant("aio", oghttp2=True, note="grpc.aio; Envoy's picker clusters on oghttp2"),
    "aio-tls-oghttp2-frame16m": Variant(
        "aio",
        oghttp2=True,
        options=(("grpc.http2.max_frame_size", (1 << 24) - 1), ("grpc.http2.lookahead_bytes", 4 << 20)),
        note="grpc.aio, SETTINGS_MAX_FRAME_SIZE 16 MiB-1 and a 4 MiB stream window; Envoy's picker "
        "clusters on oghttp2 (a 400 KB body in one or two DATA frames)",
    ),
    "uvloop-tls": Variant("uvloop", note="grpc.aio on uvloop"),
    "sync-tls": Variant("sync", note="grpc.server, ThreadPoolExecutor(16)"),
    "sync-plain": Variant("sync", tls=False, note="grpc.server, plaintext"),
    "sync-tls-oghttp2-frame16m": Variant(
        "sync",
        oghttp2=True,
        options=(("grpc.http2.max_frame_size", (1 << 24) - 1), ("grpc.http2.lookahead_bytes", 4 << 20)),
        note="grpc.server, as aio-tls-oghttp2-frame16m",
    ),
    "sync-tls-handoff": Variant(
        "sync-handoff",
        note="grpc.server, mTLS; each message answered on an asyncio loop thread "
        "(run_coroutine_threadsafe(...).result())",
    ),
    "grpclib-tls": Variant("grpclib", note="grpclib 0.4 (pure-Python h2 on asyncio), mTLS"),
}


# -- the server (a child process) --------------------------------------------------------------
def _answers(destination: str) -> dict[str, Any]:
    """The answers, built once, keyed by the message kind they answer."""
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from google.protobuf import struct_pb2

    pm = processing_mode_pb2.ProcessingMode
    skip = pm(
        request_header_mode=pm.SEND,
        response_header_mode=pm.SKIP,
        request_body_mode=pm.BUFFERED,
        response_body_mode=pm.NONE,
        request_trailer_mode=pm.SEND,
        response_trailer_mode=pm.SKIP,
    )
    header = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="x-gateway-destination-endpoint", raw_value=destination.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    lb = struct_pb2.Struct(
        fields={"x-gateway-destination-endpoint": struct_pb2.Value(string_value=destination)}
    )
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[header]), clear_route_cache=True
    )
    return {
        "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=skip),
        "request_body": pb.ProcessingResponse(
            request_body=pb.BodyResponse(response=common),
            dynamic_metadata=struct_pb2.Struct(fields={"envoy.lb": struct_pb2.Value(struct_value=lb)}),
        ),
        "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
        "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
        "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
    }


def _answer(answers: dict[str, Any], msg: Any) -> Any | None:
    """The answer to ``msg``; None for a BUFFERED body's chunk before its last (none is sent)."""
    kind = msg.WhichOneof("request")
    if kind == "request_body" and not msg.request_body.end_of_stream:
        return None
    return answers[kind]


def _credentials(pki: str) -> Any:
    from picker.serving.tls import server_credentials

    return server_credentials(f"{pki}/picker", False, f"{pki}/gateway/ca.crt")


def serve_grpclib(port: int, destination: str, pki: str, tls: bool, linger: bool) -> None:
    """:func:`serve` on grpclib: ext_proc and grpclib's gRPC health on ``127.0.0.1:port``."""
    import ssl

    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from grpclib.const import Cardinality, Handler
    from grpclib.health.service import Health
    from grpclib.server import Server, Stream

    answers = _answers(destination)

    class Service:
        async def process(self, stream: Stream[Any, Any]) -> None:
            async for msg in stream:
                resp = _answer(answers, msg)
                if resp is not None:
                    await stream.send_message(resp)
            if linger:
                await asyncio.sleep(LINGER_S)

        def __mapping__(self) -> dict[str, Handler]:
            return {
                f"/{EXT_PROC_SERVICE}/Process": Handler(
                    self.process, Cardinality.STREAM_STREAM, pb.ProcessingRequest, pb.ProcessingResponse
                )
            }

    ctx = None
    if tls:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=f"{pki}/gateway/ca.crt")
        ctx.load_cert_chain(f"{pki}/picker/tls.crt", f"{pki}/picker/tls.key")
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.set_alpn_protocols(["h2"])

    async def main() -> None:
        service = Service()  # health: SERVING for "" and the service's name (no checks)
        server = Server([service, Health({service: []})])
        await server.start("127.0.0.1", port, ssl=ctx)
        await server.wait_closed()

    asyncio.run(main())


def serve(name: str, port: int, destination: str, pki: str) -> None:
    """Serve ext_proc and gRPC health on ``127.0.0.1:port`` as variant ``name`` until killed."""
    v = VARIANTS[name]
    if v.server == "grpclib":  # before grpc_health's import: grpclib registers its own health.proto
        serve_grpclib(port, destination, pki, v.tls, v.linger)
        return
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    answers = _answers(destination)
    addr = f"127.0.0.1:{port}"
    options = [("grpc.max_receive_message_length", 16 << 20), *v.options]
    serving = health_pb2.HealthCheckResponse.SERVING

    if v.server == "sync-handoff":
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="loop", daemon=True).start()

        async def answer_on_loop(msg: Any) -> Any | None:
            return _answer(answers, msg)

        def answer(msg: Any) -> Any | None:
            return asyncio.run_coroutine_threadsafe(answer_on_loop(msg), loop).result()

    else:

        def answer(msg: Any) -> Any | None:
            return _answer(answers, msg)

    if v.server in ("sync", "sync-handoff"):

        class SyncService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
            def Process(
                self, request_iterator: Iterator[Any], context: grpc.ServicerContext
            ) -> Iterator[Any]:
                for msg in request_iterator:
                    resp = answer(msg)
                    if resp is not None:
                        yield resp
                if v.linger:  # until the reset (the call's termination callback), as the picker
                    done = threading.Event()
                    if context.add_callback(done.set):
                        done.wait(LINGER_S)

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=options)
        pb_grpc.add_ExternalProcessorServicer_to_server(SyncService(), server)
        hs = health.HealthServicer()
        for svc in ("", EXT_PROC_SERVICE):
            hs.set(svc, serving)
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        server.add_secure_port(addr, _credentials(pki)) if v.tls else server.add_insecure_port(addr)
        server.start()
        server.wait_for_termination()
        return

    class AioService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
            while (msg := await context.read()) is not grpc.aio.EOF:
                resp = _answer(answers, msg)
                if resp is not None:
                    await context.write(resp)
            if v.linger:
                await asyncio.sleep(LINGER_S)

    async def main() -> None:
        aserver = grpc.aio.server(options=options)
        pb_grpc.add_ExternalProcessorServicer_to_server(AioService(), aserver)
        ahs = health.aio.HealthServicer()
        for svc in ("", EXT_PROC_SERVICE):
            await ahs.set(svc, serving)
        health_pb2_grpc.add_HealthServicer_to_server(ahs, aserver)
        aserver.add_secure_port(addr, _credentials(pki)) if v.tls else aserver.add_insecure_port(addr)
        await aserver.start()
        await aserver.wait_for_termination()

    if v.server == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


# -- the driver ----------------------------------------------------------------------------------
def oghttp2_pickers(config: str) -> str:
    """``config`` (render.py's YAML) with its picker clusters on Envoy's oghttp2 codec."""
    cfg = yaml.safe_load(config)
    for c in cfg["static_resources"]["clusters"]:
        if c["name"].startswith("kvpick_picker"):
            opts = c["typed_extension_protocol_options"][
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
            ]
            opts["explicit_http_config"]["http2_protocol_options"]["use_oghttp2_codec"] = True
    return str(yaml.safe_dump(cfg))


async def send(http: aiohttp.ClientSession, url: str, body: bytes, n: int, rate: float) -> list[int]:
    """Post ``body`` ``n`` times, one every ``1/rate`` seconds (open loop); the statuses."""
    headers = {"content-type": "application/json"}

    async def post(i: int) -> int:
        await asyncio.sleep(i / rate)
        try:
            async with http.post(url, data=body, headers=headers) as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, TimeoutError):
            return 0

    return await asyncio.gather(*(post(i) for i in range(n)))


def run_one(st: Stack, name: str, pki: str, body: bytes, args: argparse.Namespace) -> dict[str, float]:
    """A fresh server of variant ``name`` behind ``st``'s Envoy: warm-up, idle window, the run."""
    cmd = [PY, "-m", "bench.extproc_floor", "--serve", name, "--port", str(st.grpc_port)]
    cmd += ["--destination", st.addresses[0], "--pki", pki]
    proc = st.procs.start("server", cmd)
    try:
        wait_port(st.grpc_port, procs=st.procs, proc=proc)
        url = st.url + CHAT

        async def go() -> tuple[list[int], float, float, float, float]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                deadline = time.monotonic() + 30
                while (await send(http, url, body, 1, 1.0)) != [200]:  # Envoy sees it healthy
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"never routable: {st.procs.log('envoy')[-2000:]}")
                    await asyncio.sleep(0.2)
                await send(http, url, body, args.warmup, args.rate)
                await asyncio.sleep(LINGER_S + 0.2)  # the warm-up's streams reset
                i0, t_idle = cpu_s(proc.pid), time.monotonic()
                await asyncio.sleep(args.idle)
                c0, e0, t0 = cpu_s(proc.pid), cpu_s(envoy.pid), time.monotonic()
                statuses = await send(http, url, body, args.requests, args.rate)
                await asyncio.sleep(args.tail)
                c1, e1, t1 = cpu_s(proc.pid), cpu_s(envoy.pid), time.monotonic()
            return statuses, (c0 - i0) / (t0 - t_idle), c1 - c0, e1 - e0, t1 - t0

        envoy = next(p for n, p in st.procs.procs if n == "envoy")
        statuses, idle_rate, cpu, envoy_cpu, seconds = asyncio.run(go())
    finally:
        st.procs.stop("server")
        st.procs.procs = [(n, p) for n, p in st.procs.procs if n != "server"]
    ok = sum(s == 200 for s in statuses)
    return {
        "cpu_ms": cpu * 1000 / max(ok, 1),
        "net_ms": (cpu - idle_rate * seconds) * 1000 / max(ok, 1),
        "idle_cores": idle_rate,
        "envoy_ms": envoy_cpu * 1000 / max(ok, 1),
        "ok": ok,
        "sent": len(statuses),
    }


def fmt(xs: list[float], digits: int = 2) -> str:
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def table(results: dict[tuple[str, str], list[dict[str, float]]], names: list[str], sizes: list[str]) -> str:
    """The markdown table: one row per variant, net CPU ms per request per body size."""
    head = " | ".join(f"{s} net CPU ms/req | {s} gross | {s} Envoy's" for s in sizes)
    lines = [
        f"| variant | {head} | idle cores | 200s | what |",
        "|---|" + "---|---|---|" * len(sizes) + "---|---|---|",
    ]
    for name in names:
        cells, idle, oks = [], [], []
        for s in sizes:
            rs = results[name, s]
            cells.append(
                f"{fmt([r['net_ms'] for r in rs])} | {fmt([r['cpu_ms'] for r in rs])} | "
                f"{fmt([r['envoy_ms'] for r in rs])}"
            )
            idle += [r["idle_cores"] for r in rs]
            oks.append(f"{sum(int(r['ok']) for r in rs)}/{sum(int(r['sent']) for r in rs)}")
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {fmt(idle, 3)} | {' '.join(oks)} | {VARIANTS[name].note} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.extproc_floor", description=__doc__)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"chat body sizes, of {', '.join(SIZES)}")
    p.add_argument("--requests", type=int, default=200, help="measured requests per run")
    p.add_argument("--rate", type=float, default=50.0, help="requests per second")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--idle", type=float, default=2.0, help="seconds of idle CPU measured before each run")
    p.add_argument("--tail", type=float, default=0.5, help="seconds after the last answer counted")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serve", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--destination", default="", help=argparse.SUPPRESS)
    p.add_argument("--pki", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.destination, args.pki)
        return 0
    from bench.datapath import make_body
    from picker.serving.tls import local_pki

    names, sizes = args.variants.split(","), args.sizes.split(",")
    for n in names:
        if n not in VARIANTS:
            p.error(f"unknown variant {n!r}")
    if importlib.util.find_spec("uvloop") is None:  # not a dependency: vLLM's server brings it
        skipped = [n for n in names if VARIANTS[n].server == "uvloop"]
        names = [n for n in names if n not in skipped]
        if skipped:
            print(f"no uvloop installed: {', '.join(skipped)} left out", file=sys.stderr)
    if importlib.util.find_spec("grpclib") is None:  # the bench extra (measured, not shipped)
        skipped = [n for n in names if VARIANTS[n].server == "grpclib"]
        names = [n for n in names if n not in skipped]
        if skipped:
            print(f"no grpclib installed: {', '.join(skipped)} left out", file=sys.stderr)
    bodies = {s: make_body(SIZES[s], stream=False) for s in sizes}
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvpick-bench-floor-") as tmp:
        root = pathlib.Path(tmp)
        pki = local_pki(root / "pki")
        upstream = [free_port()]
        stacks: dict[tuple[bool, bool], Stack] = {}
        try:
            for tls, og in sorted({(VARIANTS[n].tls, VARIANTS[n].oghttp2) for n in names}):
                run_dir = root / f"{'tls' if tls else 'plain'}{'-oghttp2' if og else ''}"
                run_dir.mkdir()
                st = stacks[tls, og] = Stack(Procs(run_dir), upstream, grpc_port=free_port())
                if len(stacks) == 1:  # one upstream, served to every Envoy
                    st.start_upstreams("--fixed")
                st.pki = pki if tls else None
                config = st.render_envoy(*([] if tls else ["--plaintext"]))
                st.start_envoy(config=oghttp2_pickers(config) if og else config)
            for rep in range(args.repeats):
                for name in names:
                    for s in sizes:
                        st = stacks[VARIANTS[name].tls, VARIANTS[name].oghttp2]
                        res = run_one(st, name, str(root / "pki"), bodies[s], args)
                        results.setdefault((name, s), []).append(res)
                        print(f"repeat {rep + 1} {name} {s}: {res}", file=sys.stderr, flush=True)
        finally:
            for st in stacks.values():
                st.procs.stop()
    print(
        f"\n{args.requests} chat requests per run at {args.rate:g}/s through Envoy, {args.repeats} interleaved "
        f"repeats, {time.monotonic() - t_start:.0f} s in all; the ext_proc server's CPU ms per request "
        "answered 200 (net: less its idle rate over the window), median [min-max]\n"
    )
    print(table(results, names, sizes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Fake model servers on real HTTP ports, for the tests and the benchmarks (the simulator,
``replica.sim``, is the one that models an engine).

    python -m kvlaunch.upstream --ports 8001,8002            # echo: says which port served
    python -m kvlaunch.upstream --ports 8001,8002 --fixed    # fixed answers, for data-path runs

Both modes answer ``GET /health`` (200), ``GET /v1/models`` and ``GET /metrics`` (vLLM 0.32
gauge names and ``vllm:cache_config_info``), so the picker and the peer routers treat them as
model servers.

Echo mode (the default; the picker's tests):

- ``POST /v1/*``: JSON ``{"served_by": port, "sha256": ..., "bytes": n, "model": ...}``; with
  ``"stream": true`` an SSE stream of ``chunks`` events (``delay`` seconds between events). A
  streamed request with ``"reset_after": i`` drops the connection (TCP abort) right after event
  ``i``.
- ``POST /control {"waiting": n, "running": n, "kv": x}`` sets the gauges ``/metrics`` shows.
- ``GET /stats``: the gauges plus ``served`` (requests answered) and ``resets`` (streams dropped).

Fixed mode (``--fixed``; ``bench.datapath``): every ``POST /v1/*`` is answered without parsing its
body, with a fixed small JSON completion or, when the body holds ``"stream":true`` (or
``"stream": true``: routers that re-serialize the body move and respace it), an SSE stream of
``--chunks`` events, one token each, then ``data: [DONE]``. Its gauges stay idle. The point is a
replica that costs as little CPU as possible, so that what a run measures is the router.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import socket
from typing import Any

from aiohttp import web

STREAM_MARKS = (b'"stream":true', b'"stream": true')
COMPLETION = (
    b'{"id":"cmpl-bench","object":"text_completion","model":"m","choices":[{"index":0,"text":"ok",'
    b'"finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)
EVENT = b'data: {"id":"cmpl-bench","object":"text_completion","choices":[{"index":0,"text":"tok"}]}\n\n'
ECHO_GPU_BLOCKS = 1000
FIXED_GPU_BLOCKS = 100_000
"""``num_gpu_blocks`` in ``vllm:cache_config_info``: fixed mode's replicas never look full."""


def _reserved(name: str) -> bool:
    n = name.lower()
    return n.startswith(("x-envoy-", "x-gateway-destination-endpoint")) or n in (
        "x-gateway-model-name-rewrite",
        "x-gateway-inference-objective",
        "x-llm-d-model-name-rewrite",
        "x-llm-d-inference-objective",
        "x-prefiller-host-port",
    )


def _num(value: object, default: float, kind: type, cap: float) -> Any:
    """A small non-negative number from a (possibly fuzzed) body field, else ``default``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= cap:
        return default
    return kind(value)


def metrics_text(waiting: float, running: float, kv: float, num_gpu_blocks: int) -> str:
    lbl = 'model_name="m",engine="0"'
    return (
        f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{lbl}}} {waiting}\n"
        f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{lbl}}} {running}\n"
        f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{lbl}}} {kv}\n"
        f"# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{num_gpu_blocks}",engine="0"}} 1.0\n'
    )


def _base_app(port: int, metrics: Any) -> web.Application:
    """The routes both modes share; ``metrics`` is the ``/metrics`` handler."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}], "served_by": port})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


def make_app(port: int) -> web.Application:
    """Echo mode (the module doc)."""
    state = {"waiting": 0.0, "running": 0.0, "kv": 0.0, "served": 0, "resets": 0}

    async def completions(req: web.Request) -> web.StreamResponse:
        body = await req.read()
        state["served"] += 1
        info = {
            "served_by": port,
            "sha256": hashlib.sha256(body).hexdigest(),
            "bytes": len(body),
            "dest_header": req.headers.get("x-gateway-destination-endpoint", ""),
            # What reached the replica of the headers only Envoy or the picker may set.
            "gateway_headers": {k.lower(): v for k, v in req.headers.items() if _reserved(k)},
        }
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):  # fuzzed bodies: never a 500 from this double
            doc = {}
        info["model"] = doc.get("model") if isinstance(doc, dict) else None
        if isinstance(doc, dict) and doc.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(req)
            n = _num(doc.get("chunks"), 5, int, 10_000)
            delay = _num(doc.get("delay"), 0.0, float, 60.0)
            for i in range(n):
                await resp.write(f"data: {json.dumps({'i': i, **info})}\n\n".encode())
                if doc.get("reset_after") == i and req.transport is not None:
                    state["resets"] += 1
                    # Let Envoy read the events first: a reset discards what the peer has not read
                    # yet, and Envoy would then answer 503 (reset before headers) instead.
                    await asyncio.sleep(0.1)
                    req.transport.abort()  # upstream reset mid-stream
                    return resp
                if delay:
                    await asyncio.sleep(delay)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response(info)

    async def metrics(_: web.Request) -> web.Response:
        text = metrics_text(state["waiting"], state["running"], state["kv"], ECHO_GPU_BLOCKS)
        return web.Response(text=text, content_type="text/plain")

    async def control(req: web.Request) -> web.Response:
        doc = await req.json()
        state.update({k: float(v) for k, v in doc.items() if k in ("waiting", "running", "kv")})
        return web.json_response(state)

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(state)

    app = _base_app(port, metrics)
    app.router.add_post("/v1/{tail:.*}", completions)
    app.router.add_get("/stats", stats)
    app.router.add_post("/control", control)
    return app


def make_fixed_app(port: int, chunks: int) -> web.Application:
    """Fixed mode (the module doc): ``chunks`` events per streamed answer."""
    text = metrics_text(0.0, 0.0, 0.0, FIXED_GPU_BLOCKS)

    async def completions(req: web.Request) -> web.StreamResponse:
        body = await req.read()
        if not any(mark in body for mark in STREAM_MARKS):
            return web.Response(body=COMPLETION, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for _ in range(chunks):
            await resp.write(EVENT)
            await asyncio.sleep(0)  # one event per write, as a server producing tokens does
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/plain")

    app = _base_app(port, metrics)
    app.router.add_post("/v1/{tail:.*}", completions)
    return app


async def serve(ports: list[int], host: str = "127.0.0.1", fixed: bool = False, chunks: int = 256) -> None:
    """One app per port on ``host`` (IPv4 or IPv6), TCP_NODELAY (docs/design.md, the latency pitfall), until cancelled."""
    runners = []
    for port in ports:
        app = make_fixed_app(port, chunks) if fixed else make_app(port)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        await web.SockSite(runner, sock, backlog=1024).start()
        runners.append(runner)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m kvlaunch.upstream",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--ports", required=True, help="comma-separated ports, one app each")
    ap.add_argument("--host", default="127.0.0.1", help="any 127.x.y.z: several replicas on one port")
    ap.add_argument("--fixed", action="store_true", help="fixed answers, body unparsed (data-path runs)")
    ap.add_argument("--chunks", type=int, default=256, help="SSE events per streamed answer in --fixed mode")
    a = ap.parse_args(argv)
    asyncio.run(serve([int(p) for p in a.ports.split(",")], a.host, a.fixed, a.chunks))


if __name__ == "__main__":
    main()

"""Real HTTP upstreams for picker tests: each port answers with which port served it.

    python -m kvlaunch.upstream --ports 8001,8002

- ``POST /v1/*``: JSON ``{"served_by": port, "sha256": ..., "bytes": n, "model": ...}``; with
  ``"stream": true`` an SSE stream of ``chunks`` events (``?delay=`` seconds between events).
- ``GET /metrics``: vLLM-named gauges; ``POST /control {"waiting": n, "kv": x}`` sets them.
- ``GET /health``: 200. A streamed request with ``"reset_after": i`` drops the connection (TCP
  abort) right after event ``i``.
- ``GET /stats``: the gauges plus ``served`` (requests answered) and ``resets`` (streams dropped).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import socket
from typing import Any

from aiohttp import web


def _reserved(name: str) -> bool:
    n = name.lower()
    return n.startswith(("x-envoy-", "x-gateway-destination-endpoint")) or n in (
        "x-gateway-model-name-rewrite",
        "x-gateway-inference-objective",
    )


def _num(value: object, default: float, kind: type, cap: float) -> Any:
    """A small non-negative number from a (possibly fuzzed) body field, else ``default``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= cap:
        return default
    return kind(value)


def make_app(port: int) -> web.Application:
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
        lbl = 'model_name="m",engine="0"'
        text = (
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{lbl}}} {state['waiting']}\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{lbl}}} {state['running']}\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{lbl}}} {state['kv']}\n"
            f"# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="1000",engine="0"}} 1.0\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def control(req: web.Request) -> web.Response:
        doc = await req.json()
        state.update({k: float(v) for k, v in doc.items() if k in ("waiting", "running", "kv")})
        return web.json_response(state)

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(state)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}], "served_by": port})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/{tail:.*}", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_post("/control", control)
    return app


async def serve(ports: list[int], host: str = "127.0.0.1") -> None:
    runners = []
    for port in ports:
        runner = web.AppRunner(make_app(port), access_log=None)
        await runner.setup()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        await web.SockSite(runner, sock).start()
        runners.append(runner)
    await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ports", required=True)
    ap.add_argument("--host", default="127.0.0.1", help="any 127.x.y.z: several replicas on one port")
    a = ap.parse_args()
    asyncio.run(serve([int(p) for p in a.ports.split(",")], a.host))

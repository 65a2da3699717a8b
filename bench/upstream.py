"""A fast fixed-response OpenAI-style upstream for data-path benchmarks (``bench.datapath``).

    python -m bench.upstream --ports 8001,8002 [--chunks 256]

Every ``POST /v1/*`` is answered without parsing its body: a fixed small JSON completion, or,
when the body holds ``"stream":true`` (or ``"stream": true``: routers that re-serialize the body
move and respace it), an SSE stream of ``--chunks`` events, one token each, then
``data: [DONE]``. ``GET /health`` and ``GET /metrics``
(idle vLLM 0.32 gauges and ``vllm:cache_config_info``) let the picker and the peer routers treat
it as a model server. The point is a replica that costs as little CPU as possible, so that what a
run measures is the router.
"""

from __future__ import annotations

import argparse
import asyncio
import socket

from aiohttp import web

STREAM_MARKS = (b'"stream":true', b'"stream": true')
COMPLETION = (
    b'{"id":"cmpl-bench","object":"text_completion","model":"m","choices":[{"index":0,"text":"ok",'
    b'"finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)
EVENT = b'data: {"id":"cmpl-bench","object":"text_completion","choices":[{"index":0,"text":"tok"}]}\n\n'
METRICS = (
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{model_name="m",engine="0"} 0.0\n'
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{model_name="m",engine="0"} 0.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.0\n'
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="100000",engine="0"} 1.0\n'
)


def make_app(chunks: int) -> web.Application:
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
        return web.Response(text=METRICS, content_type="text/plain")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/{tail:.*}", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


async def serve(ports: list[int], chunks: int, host: str = "127.0.0.1") -> None:
    for port in ports:
        runner = web.AppRunner(make_app(chunks), access_log=None)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        await web.SockSite(runner, sock, backlog=1024).start()
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.upstream", description=__doc__)
    ap.add_argument("--ports", required=True, help="comma-separated ports, one app each")
    ap.add_argument("--chunks", type=int, default=256, help="SSE events per streamed response")
    ap.add_argument("--host", default="127.0.0.1")
    a = ap.parse_args()
    asyncio.run(serve([int(p) for p in a.ports.split(",")], a.chunks, a.host))


if __name__ == "__main__":
    main()

"""OpenAI-compatible HTTP front of the simulated engine, with vLLM's metric names.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE when ``stream``), GET /v1/models,
GET /health, GET /metrics, POST /reset_prefix_cache. ``usage.prompt_tokens_details.cached_tokens``
reports the prefix-cache hit of each request.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from . import tokenizer
from .engine import Engine
from .scheduler import Request


class Metrics:
    def __init__(self, engine: Engine, model: str) -> None:
        r = self.registry = CollectorRegistry()
        lbl = {"model_name": model, "engine": "0"}
        names = ["model_name", "engine"]
        self.running = Gauge("vllm:num_requests_running", "Running requests", names, registry=r).labels(**lbl)
        self.waiting = Gauge("vllm:num_requests_waiting", "Waiting requests", names, registry=r).labels(**lbl)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1", names, registry=r).labels(**lbl)
        info = Gauge(
            "vllm:cache_config_info",
            "Cache config",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"],
            registry=r,
        )
        info.labels(str(engine.pool.block_size), str(len(engine.pool.blocks)), "True", "0").set(1)
        self.queries = Counter(
            "vllm:prefix_cache_queries", "Prefix-cache queries, tokens", names, registry=r
        ).labels(**lbl)
        self.hits = Counter("vllm:prefix_cache_hits", "Prefix-cache hits, tokens", names, registry=r).labels(
            **lbl
        )
        self.success = Counter("vllm:request_success", "Finished requests", names, registry=r).labels(**lbl)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "TTFT",
            names,
            registry=r,
            buckets=(
                0.001,
                0.005,
                0.01,
                0.02,
                0.04,
                0.06,
                0.08,
                0.1,
                0.25,
                0.5,
                0.75,
                1.0,
                2.5,
                5.0,
                7.5,
                10.0,
                20.0,
                40.0,
                80.0,
            ),
        ).labels(**lbl)
        self.engine = engine
        self._seen = (0, 0)

    def render(self) -> bytes:
        e = self.engine
        self.running.set(len(e.sched.running))
        self.waiting.set(len(e.sched.waiting))
        self.kv.set(e.pool.usage())
        q, h = e.sched.queries, e.sched.hits
        self.queries.inc(q - self._seen[0])
        self.hits.inc(h - self._seen[1])
        self._seen = (q, h)
        return generate_latest(self.registry)


def _prompt(doc: dict[str, Any]) -> list[int]:
    if "messages" in doc:
        text = "".join(
            f"<|{m.get('role', '')}|>{m.get('content', '')}"
            for m in doc["messages"]
            if isinstance(m, dict) and isinstance(m.get("content", ""), str)
        )
        return tokenizer.encode(text)
    p = doc.get("prompt", "")
    if isinstance(p, list) and all(isinstance(t, int) for t in p):
        return list(p)
    if isinstance(p, list):
        p = p[0] if p else ""
    return tokenizer.encode(str(p))


def make_app(engine: Engine, model: str, loras: frozenset[str] = frozenset()) -> web.Application:
    metrics = Metrics(engine, model)

    async def complete(req: web.Request) -> web.StreamResponse:
        chat = req.path.endswith("/chat/completions")
        try:
            doc = json.loads(await req.read())
            assert isinstance(doc, dict)
        except (ValueError, AssertionError):
            return web.json_response({"error": {"message": "body must be a JSON object"}}, status=400)
        name = doc.get("model", model)
        if name != model and name not in loras:
            return web.json_response({"error": {"message": f"model {name!r} does not exist"}}, status=404)
        prompt = _prompt(doc) or [0]
        max_tokens = int(doc.get("max_completion_tokens") or doc.get("max_tokens") or 16)
        r = Request(
            prompt,
            max(1, max_tokens),
            engine.pool.block_size,
            lora=name if name in loras else "",
            salt=str(doc.get("cache_salt", "")),
        )
        t0 = time.monotonic()
        q = engine.submit(r)
        rid, created = f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def usage() -> dict[str, Any]:
            return {
                "prompt_tokens": len(prompt),
                "completion_tokens": r.num_output,
                "total_tokens": len(prompt) + r.num_output,
                "prompt_tokens_details": {"cached_tokens": r.num_cached},
            }

        def choice(text: str, done: bool) -> dict[str, Any]:
            fin = "length" if done else None
            if chat:
                return {
                    "index": 0,
                    ("delta" if doc.get("stream") else "message"): {"role": "assistant", "content": text},
                    "finish_reason": fin,
                }
            return {"index": 0, "text": text, "finish_reason": fin}

        try:
            if not doc.get("stream"):
                while not r.finished:
                    await q.get()
                metrics.ttft.observe((r.first_token_at or time.monotonic()) - t0)
                metrics.success.inc()
                text = "".join(tokenizer.decode_token(i) for i in range(r.num_output))
                return web.json_response(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": name,
                        "choices": [choice(text, True)],
                        "usage": usage(),
                    }
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(req)
            sent = 0
            while sent < r.max_tokens:
                n = await q.get()
                if sent == 0:
                    metrics.ttft.observe(time.monotonic() - t0)
                text = "".join(tokenizer.decode_token(i) for i in range(sent, n))
                sent = n
                chunk = {
                    "id": rid,
                    "object": f"{obj}.chunk",
                    "created": created,
                    "model": name,
                    "choices": [choice(text, r.finished)],
                }
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if (doc.get("stream_options") or {}).get("include_usage", True):
                final = {
                    "id": rid,
                    "object": f"{obj}.chunk",
                    "created": created,
                    "model": name,
                    "choices": [],
                    "usage": usage(),
                }
                await resp.write(f"data: {json.dumps(final)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            metrics.success.inc()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            engine.cancel(r)
            raise

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model"} for m in [model, *loras]]}
        )

    async def prom(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def reset(_: web.Request) -> web.Response:
        ok = engine.pool.reset()
        return web.json_response({"reset": ok}, status=200 if ok else 409)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", prom)
    app.router.add_get("/health", health)
    app.router.add_post("/reset_prefix_cache", reset)
    return app


async def serve(app: web.Application, engine: Engine, host: str, port: int) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    await web.SockSite(runner, sock).start()
    try:
        await engine.run()
    finally:
        await runner.cleanup()

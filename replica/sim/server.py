"""OpenAI-compatible HTTP front of the simulated engine (aiohttp, TCP_NODELAY).

Routes: POST /v1/completions and /v1/chat/completions (SSE when ``stream``), GET /v1/models,
GET /health, GET /metrics, POST /reset_prefix_cache. ``usage.prompt_tokens_details.cached_tokens``
is the request's prefix-cache hit. A body may carry ``cache_salt``; ``model`` may name a served
LoRA adapter. ``max_tokens`` / ``max_completion_tokens`` (default 16) set the output length.

Streams follow vLLM 0.32 (``serve/utils/api_utils.should_include_usage``): the final usage chunk
(``choices: []``) is sent only when ``stream_options.include_usage`` is true, and every chunk
carries running usage when ``continuous_usage_stats`` is true too; ``--enable-force-include-usage``
turns both on for every stream. ``stream_options`` without ``stream`` is a 400, as in vLLM.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from typing import Any

from aiohttp import web

from . import tokenizer
from .engine import AsyncEngine
from .metrics import Metrics
from .request import Request


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _prompt(doc: dict[str, Any]) -> list[int]:
    if "messages" in doc:
        msgs = doc["messages"]
        if not isinstance(msgs, list):
            raise BadRequest("messages must be a list")
        text = "".join(
            f"<|{m.get('role', '')}|>{m.get('content', '')}"
            for m in msgs
            if isinstance(m, dict) and isinstance(m.get("content", ""), str)
        )
        return tokenizer.encode(text)
    p = doc.get("prompt", "")
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        return list(p)
    if isinstance(p, list):
        p = p[0] if p else ""
    return tokenizer.encode(str(p))


class Api:
    def __init__(
        self,
        engine: AsyncEngine,
        model: str,
        loras: tuple[str, ...],
        metrics: Metrics,
        force_include_usage: bool = False,
    ) -> None:
        self.engine, self.model, self.loras, self.metrics = engine, model, loras, metrics
        self.force_include_usage = force_include_usage

    def usage_options(self, doc: dict[str, Any]) -> tuple[bool, bool]:
        """(final usage chunk, usage on every chunk), as vLLM's ``should_include_usage``."""
        opts = doc.get("stream_options")
        if opts and not doc.get("stream"):
            raise BadRequest("Stream options can only be defined when `stream=True`.")
        if self.force_include_usage:
            return True, True
        if opts is not None and not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object")
        include = bool((opts or {}).get("include_usage"))
        return include, include and bool((opts or {}).get("continuous_usage_stats"))

    def parse(self, doc: Any) -> Request:
        if not isinstance(doc, dict):
            raise BadRequest("body must be a JSON object")
        name = doc.get("model", self.model)
        if name != self.model and name not in self.loras:
            raise BadRequest(f"The model `{name}` does not exist.", 404)
        prompt = _prompt(doc) or [0]
        max_tokens = int(doc.get("max_completion_tokens") or doc.get("max_tokens") or 16)
        limit = self.engine.core.max_model_len
        if len(prompt) + max_tokens > limit:
            raise BadRequest(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) > max_model_len ({limit})")
        core = self.engine.core
        lora = name if name in self.loras else ""
        return Request(
            prompt, max(1, max_tokens), core.pool.block_size, lora, str(doc.get("cache_salt") or "")
        )

    async def tokenize(self, http: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``: ``{"model", "prompt"}`` or ``{"model", "messages", ...}`` →
        ``{"count", "max_model_len", "tokens", "token_strs"}``, the ids a completion or chat
        request with that prompt is served with (the simulator's own tokenizer and chat format)."""
        try:
            doc = json.loads(await http.read())
            if not isinstance(doc, dict) or not ("prompt" in doc or "messages" in doc):
                raise BadRequest("body must be an object with prompt or messages")
            name = doc.get("model") or self.model
            if name != self.model and name not in self.loras:
                raise BadRequest(f"The model `{name}` does not exist.", 404)
            ids = _prompt(doc)
        except ValueError as exc:
            return web.json_response({"error": {"message": f"bad JSON: {exc}"}}, status=400)
        except BadRequest as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=exc.status)
        limit = self.engine.core.max_model_len
        return web.json_response(
            {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": None}
        )

    async def complete(self, http: web.Request) -> web.StreamResponse:
        chat = http.path.endswith("/chat/completions")
        try:
            doc = json.loads(await http.read())
            req = self.parse(doc)
            include_usage, continuous_usage = self.usage_options(doc)
        except ValueError as exc:
            return web.json_response({"error": {"message": f"bad JSON: {exc}"}}, status=400)
        except BadRequest as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=exc.status)
        reply = Reply(req, chat, doc.get("model", self.model), bool(doc.get("stream")))
        q = self.engine.submit(req)
        try:
            if not reply.stream:
                while not req.finished:
                    await q.get()
                    self._first_token(req, reply.t0)
                self._observe(req)
                return web.json_response(reply.whole())
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(http)
            sent = 0
            while sent < req.max_tokens:
                n = await q.get()
                self._first_token(req, reply.t0)
                await resp.write(reply.sse(reply.chunk(sent, n, continuous_usage)))
                sent = n
            if include_usage:
                await resp.write(reply.sse(reply.usage_chunk()))
            await resp.write(b"data: [DONE]\n\n")
            self._observe(req)
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.engine.cancel(req)
            raise

    def _first_token(self, req: Request, t0: float) -> None:
        """``vllm:time_to_first_token_seconds`` is observed at a request's first token, as vLLM's
        (the picker's accounting counts first tokens from its ``_count``), once per request."""
        if not req.ttft_observed:
            req.ttft_observed = True
            self.metrics.ttft.observe((req.first_token_at or time.monotonic()) - t0)

    def _observe(self, req: Request) -> None:
        self.metrics.success.inc()


class Reply:
    """OpenAI response bodies for one request."""

    def __init__(self, req: Request, chat: bool, model: str, stream: bool) -> None:
        self.req, self.chat, self.model, self.stream = req, chat, model, stream
        self.id, self.created, self.t0 = f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time()), time.monotonic()
        self.obj = "chat.completion" if chat else "text_completion"

    def usage(self) -> dict[str, Any]:
        p, n = len(self.req.prompt), self.req.num_output
        cached = max(0, self.req.num_cached_tokens)
        return {
            "prompt_tokens": p,
            "completion_tokens": n,
            "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def choice(self, text: str, done: bool) -> dict[str, Any]:
        fin = "length" if done else None
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": fin}
        body = {"role": "assistant", "content": text}
        return {"index": 0, ("delta" if self.stream else "message"): body, "finish_reason": fin}

    def head(self, suffix: str = "") -> dict[str, Any]:
        return {"id": self.id, "object": self.obj + suffix, "created": self.created, "model": self.model}

    def whole(self) -> dict[str, Any]:
        text = tokenizer.decode_outputs(0, self.req.num_output)
        return {**self.head(), "choices": [self.choice(text, True)], "usage": self.usage()}

    def chunk(self, start: int, stop: int, usage: bool = False) -> dict[str, Any]:
        """Outputs ``start:stop``; with ``usage``, the running counts (vLLM's continuous usage)."""
        done = stop >= self.req.max_tokens
        doc = {**self.head(".chunk"), "choices": [self.choice(tokenizer.decode_outputs(start, stop), done)]}
        if usage:
            p = len(self.req.prompt)
            doc["usage"] = {"prompt_tokens": p, "completion_tokens": stop, "total_tokens": p + stop}
        return doc

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.head(".chunk"), "choices": [], "usage": self.usage()}

    @staticmethod
    def sse(doc: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(doc)}\n\n".encode()


def make_app(
    engine: AsyncEngine,
    model: str,
    loras: tuple[str, ...] = (),
    max_loras: int = 1,
    force_include_usage: bool = False,
    fault_api: bool = False,
) -> web.Application:
    """The OpenAI and vLLM routes. ``fault_api`` adds ``POST /admin/fault`` (tests only, off by
    default): ``{"freeze": true}`` stops the engine stepping while HTTP and /metrics still answer
    (a hung engine), ``{"health": false}`` makes ``/health`` answer 503 (a dead engine)."""
    fault = {"healthy": True}
    api = Api(engine, model, loras, Metrics(engine.core, model, loras, max_loras), force_include_usage)

    async def models(_: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "kvpick-sim"} for m in (model, *loras)]
        return web.json_response({"object": "list", "data": data})

    async def prom(_: web.Request) -> web.Response:
        return web.Response(body=api.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def reset(_: web.Request) -> web.Response:
        ok = engine.reset_prefix_cache()
        return web.json_response({"reset": ok}, status=200 if ok else 409)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="", status=200 if fault["healthy"] else 503)

    async def set_fault(req: web.Request) -> web.Response:
        doc = await req.json()
        if "freeze" in doc:
            engine.freeze(bool(doc["freeze"]))
        if "health" in doc:
            fault["healthy"] = bool(doc["health"])
        return web.json_response({"frozen": engine.frozen, "health": fault["healthy"]})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", api.complete)
    app.router.add_post("/v1/chat/completions", api.complete)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_get("/metrics", prom)
    app.router.add_get("/health", health)
    app.router.add_post("/reset_prefix_cache", reset)
    if fault_api:
        app.router.add_post("/admin/fault", set_fault)
    return app


async def serve(app: web.Application, engine: AsyncEngine, host: str, port: int) -> None:
    """Serve until cancelled; the socket has TCP_NODELAY (delayed-ACK stalls:
    docs/design.md#environment-facts)."""
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

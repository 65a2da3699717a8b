"""The picker's HTTP faces.

- :func:`metrics_app` (``--metrics-port``, 9090): Prometheus ``GET /metrics`` only; with
  ``--metrics-token-file`` it needs ``Authorization: Bearer <token>``.
- :func:`debug_app` (``--debug-port``, 9091, only with ``--enable-debug-api``, which needs
  ``--debug-token-file``; bound to 127.0.0.1 unless ``--debug-bind-address`` says otherwise). It
  reveals, per endpoint, whether a guessed prompt prefix was sent there recently — a cross-tenant
  side channel — so it is off by default, never shares the metrics port, and answers only a request
  carrying ``Authorization: Bearer <token>``:

  - ``POST /debug/explain?path=/v1/completions[&policy=NAME]`` with an OpenAI body: per-endpoint
    matched blocks, scores and TTFT estimates, without sending anything.
  - ``GET /debug/endpoints``: the pool's live state.
"""

from __future__ import annotations

import hmac
import pathlib
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from picker.core.errors import PickerError, Unauthorized
from picker.core.router import Router
from picker.serving.director import Director
from picker.serving.errors import CONTENT_TYPE
from picker.serving.errors import encode as encode_error
from picker.serving.telemetry import Telemetry


def _precise_state(router: Router, key: str) -> dict[str, Any]:
    sync = router.syncs.get(key)
    if router.precise is None or sync is None:
        return {}
    return {
        "kv_events": sync.state.value,
        "kv_events_seq": sync.expected,
        "kv_events_gaps": sync.gaps,
        "precise_blocks": router.precise.size(key),
    }


def read_token(path: str) -> bytes:
    """The bearer token in file ``path`` (a mounted Secret's key), surrounding whitespace
    stripped; ValueError if it is empty."""
    token = pathlib.Path(path).read_bytes().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def _error(err: PickerError) -> web.Response:
    e = encode_error(err)
    return web.Response(body=e.body, status=e.status, content_type=CONTENT_TYPE)


def bearer_auth(token: bytes) -> Middleware:
    """Middleware: every request needs ``Authorization: Bearer <token>``, compared in constant
    time; otherwise a JSON 401 (``WWW-Authenticate: Bearer``) and the handler never runs."""
    expected = b"Bearer " + token

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected):
            resp = _error(Unauthorized("missing or wrong bearer token"))
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        return await handler(request)

    return auth


def _middlewares(token: bytes | None) -> list[Middleware]:
    return [bearer_auth(token)] if token else []


def metrics_app(router: Router, telemetry: Telemetry, token: bytes | None = None) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        telemetry.refresh(router.pool, router.index)
        body = generate_latest(telemetry.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=1024, middlewares=_middlewares(token))
    app.router.add_get("/metrics", metrics)
    return app


def debug_app(director: Director, token: bytes) -> web.Application:
    """The debug API; ``token``: the bearer token every request must carry."""
    router = director.router

    async def explain(req: web.Request) -> web.Response:
        body = await req.read()
        try:
            doc = await director.explain(
                req.query.get("path", ""),
                body,
                req.query.get("policy", ""),
                {k.lower(): v for k, v in req.headers.items()},
            )
            return web.json_response(doc)
        except PickerError as err:
            return _error(err)

    async def endpoints(_: web.Request) -> web.Response:
        return web.json_response(
            {
                s.key: {
                    "health": s.health.value,
                    "in_flight_requests": s.load.in_flight_requests,
                    "in_flight_tokens": s.load.in_flight_tokens,
                    "pending_prefill_tokens": s.load.pending_prefill_tokens,
                    "unseen_requests": s.load.unseen_requests,
                    "finished_streams": s.load.finished_streams,
                    "sent_total": s.load.sent_total,
                    "request_success_total": s.metrics.request_success_total,
                    "prefill_rate": s.model.prefill_rate,
                    "prefill_source": s.model.prefill_source,
                    "waiting": s.metrics.waiting,
                    "running": s.metrics.running,
                    "kv_usage": s.metrics.kv_usage,
                    "index_blocks": router.index.size(s.key),
                    **_precise_state(router, s.key),
                }
                for s in router.pool
            }
        )

    if not token:
        raise ValueError("the debug API needs a bearer token (--debug-token-file)")
    app = web.Application(client_max_size=router.cfg.max_body_bytes, middlewares=[bearer_auth(token)])
    app.router.add_post("/debug/explain", explain)
    app.router.add_get("/debug/endpoints", endpoints)
    return app

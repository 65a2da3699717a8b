"""The decode-side P/D sidecar: a small asyncio reverse proxy in front of one decode vLLM.

It speaks llm-d's protocol (llm-d-inference-scheduler's ``pd-sidecar``), so it works behind any
picker that sets the header, and kvpick's picker works with llm-d's sidecar:

- a request **without** ``x-prefiller-host-port`` (and every path other than the two
  generation APIs) is passed through to the local vLLM, body and response streamed;
- a ``POST /v1/completions`` or ``/v1/chat/completions`` **with** it:

  1. the prefill leg: the request, with ``max_tokens`` (and ``max_completion_tokens``) 1,
     ``stream`` false and ``kv_transfer_params`` ``{"do_remote_decode": true,
     "do_remote_prefill": false}``, is sent to that ``ip:port`` (the first of a list);
  2. the decode leg: the original request, with the ``kv_transfer_params`` of the prefill's
     answer, is sent to the local vLLM and its answer streamed back as it comes. vLLM's
     shared-storage connector (``ExampleConnector``) answers none; the decode leg then gets
     ``{"do_remote_decode": false, "do_remote_prefill": true}`` (``--connector shared-storage``).
     NIXL answers its remote engine, host, port and block ids, passed on as they are.

**Failures.** A prefill leg that is refused, times out, answers 4xx or 5xx, or answers no
usable ``kv_transfer_params`` (with ``--connector nixl``) is a *fallback*: the original request
goes to the local vLLM unchanged, which prefills it itself; the client gets that answer. Input
vLLM refuses therefore always gets the local vLLM's own 4xx, unchanged. A body that is not a
JSON object is passed through as it is (vLLM answers it). A ``x-prefiller-host-port`` outside
``--allow-prefillers`` is a fallback too (an SSRF guard: the header names a host to call).

**Streaming.** The decode leg's response is written chunk by chunk as aiohttp reads it
(``iter_any``): no re-framing, no per-token parse, no buffering beyond the socket's. A client
disconnect cancels the handler (``handler_cancellation``), which closes both legs' upstream
connections; vLLM aborts a request whose connection closes.

**Metrics.** ``GET /metrics`` answers the local vLLM's page followed by the sidecar's own
(``kvpick_sidecar_*``): a picker scraping the decode endpoint reads both in one scrape.

Dependencies: aiohttp and prometheus_client, both vLLM's own (the replica image installs kvpick
with ``--no-deps`` on vLLM's image), and the standard library's ``json``.

Writers: each counter and histogram is written only by :class:`Sidecar`'s handlers.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

log = logging.getLogger("replica.pd_sidecar")

PREFILLER_HEADER = "x-prefiller-host-port"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
CONNECTORS = ("shared-storage", "nixl")
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
"""The prefill leg's ``kv_transfer_params`` (llm-d's, and vLLM's P/D examples')."""
SHARED_STORAGE_DECODE_PARAMS = {"do_remote_decode": False, "do_remote_prefill": True}
"""The decode leg's, where the prefill answered none (shared storage: the KV is on the disk)."""
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class SidecarConfig:
    vllm: str = "http://127.0.0.1:8001"
    """The local vLLM's base URL."""
    connector: str = "shared-storage"
    """``shared-storage`` (vLLM's ``ExampleConnector``, LMCache over a shared store) or ``nixl``
    (the decode leg needs the prefill's answered ``kv_transfer_params``)."""
    prefill_timeout_s: float = 60.0
    """Longest wait for a prefill leg's answer; past it, the request is prefilled locally."""
    allow_prefillers: tuple[str, ...] = ()
    """Networks (CIDR) a prefiller's address must be in; empty: any."""

    def __post_init__(self) -> None:
        if self.connector not in CONNECTORS:
            raise ValueError(f"connector must be one of {', '.join(CONNECTORS)}, got {self.connector!r}")
        if self.prefill_timeout_s <= 0:
            raise ValueError("prefill_timeout_s must be > 0")
        for net in self.allow_prefillers:
            ipaddress.ip_network(net, strict=False)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "kvpick_sidecar_requests",
            "Generation requests by path: disaggregated (header set) or passthrough",
            ["path"],
            registry=r,
        )
        self.prefill_legs = Counter(
            "kvpick_sidecar_prefill_legs",
            "Prefill legs sent to a prefiller, by outcome (ok, cancelled, or the fallback's reason)",
            ["outcome"],
            registry=r,
        )
        self.fallbacks = Counter(
            "kvpick_sidecar_fallbacks",
            "Disaggregated requests prefilled locally instead, by reason: refused, timeout, "
            "status_4xx, status_5xx, bad_answer, bad_header, not_allowed",
            ["reason"],
            registry=r,
        )
        self.leg_seconds = Histogram(
            "kvpick_sidecar_leg_seconds",
            "Time of each leg: prefill (send to answer), decode (send to the response's end)",
            ["leg"],
            buckets=_LEG_BUCKETS,
            registry=r,
        )
        self.disconnects = Counter(
            "kvpick_sidecar_client_disconnects",
            "Requests whose client went away before the answer was written; both legs cancelled",
            registry=r,
        )


class PrefillFailed(Exception):
    """A prefill leg that did not give usable ``kv_transfer_params``; ``reason`` is the label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Sidecar:
    cfg: SidecarConfig
    metrics: Metrics = field(default_factory=Metrics)
    _session: aiohttp.ClientSession | None = field(default=None, init=False)
    _nets: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = field(default=(), init=False)

    def __post_init__(self) -> None:
        self._nets = [ipaddress.ip_network(n, strict=False) for n in self.cfg.allow_prefillers]

    # -- life cycle -------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        # No total timeout: a decode stream lasts as long as it lasts; the prefill leg has its own.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)

    async def _stop(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the sidecar's app has not started"
        return self._session

    # -- handlers ---------------------------------------------------------------------------------
    async def metrics_page(self, request: web.Request) -> web.Response:
        async with self.session.get(self.cfg.vllm + "/metrics") as up:
            page = await up.read()
            status = up.status
        ours = generate_latest(self.metrics.registry)
        return web.Response(status=status, body=page + b"\n" + ours, content_type="text/plain")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._handle(request)
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.disconnects.inc()
            raise

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        prefiller = request.headers.get(PREFILLER_HEADER, "").split(",")[0].strip()
        generation = request.method == "POST" and request.path in GENERATION_PATHS
        body = request.content if request.body_exists else None  # streamed through, never read here
        if not generation:
            return await self._forward(request, body)
        if not prefiller:
            self.metrics.requests.labels("passthrough").inc()
            return await self._forward(request, body)
        self.metrics.requests.labels("disaggregated").inc()
        raw = await request.read()
        try:
            doc = json.loads(raw)
        except ValueError:  # not JSON, or not UTF-8
            doc = None
        if not isinstance(doc, dict):  # vLLM's own answer to a body it cannot use
            return await self._forward(request, raw)
        try:
            kv = await self._prefill(request, prefiller, doc)
        except PrefillFailed as exc:
            self.metrics.fallbacks.labels(exc.reason).inc()
            log.warning("prefill on %s failed (%s): prefilling locally", prefiller, exc.reason)
            return await self._forward(request, raw, leg="decode")
        doc["kv_transfer_params"] = kv
        return await self._forward(request, json.dumps(doc).encode(), leg="decode")

    async def _prefill(self, request: web.Request, prefiller: str, doc: dict[str, Any]) -> dict[str, Any]:
        """The prefill leg; the ``kv_transfer_params`` for the decode leg. Raises PrefillFailed."""
        url = self._prefill_url(prefiller, request.path)
        leg = dict(doc)
        leg["max_tokens"] = 1
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        leg["stream"] = False
        leg.pop("stream_options", None)
        leg["kv_transfer_params"] = dict(PREFILL_PARAMS)
        headers = {"content-type": "application/json"}
        if rid := request.headers.get("x-request-id"):
            headers["x-request-id"] = rid
        t0 = time.perf_counter()
        outcome = "ok"
        try:
            timeout = aiohttp.ClientTimeout(total=self.cfg.prefill_timeout_s)
            data = json.dumps(leg).encode()
            async with self.session.post(url, data=data, headers=headers, timeout=timeout) as up:
                answer = await up.read()
                if up.status >= 500:
                    raise PrefillFailed("status_5xx")
                if up.status >= 400:
                    raise PrefillFailed("status_4xx")
            try:
                got = json.loads(answer).get("kv_transfer_params")
            except (ValueError, AttributeError) as exc:
                raise PrefillFailed("bad_answer") from exc
            if isinstance(got, dict):
                return got
            if self.cfg.connector == "shared-storage":
                return dict(SHARED_STORAGE_DECODE_PARAMS)
            raise PrefillFailed("bad_answer")
        except TimeoutError as exc:
            outcome = "timeout"
            raise PrefillFailed("timeout") from exc
        except aiohttp.ClientError as exc:
            outcome = "refused"
            raise PrefillFailed("refused") from exc
        except PrefillFailed as exc:
            outcome = exc.reason
            raise
        except asyncio.CancelledError:  # the client went away: the leg's connection is closed
            outcome = "cancelled"
            raise
        finally:
            self.metrics.prefill_legs.labels(outcome).inc()
            self.metrics.leg_seconds.labels("prefill").observe(time.perf_counter() - t0)

    def _prefill_url(self, prefiller: str, path: str) -> str:
        host, sep, port = prefiller.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise PrefillFailed("bad_header")
        try:
            addr = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            addr = None  # a name: allowed only when no network list is set
        if self._nets and (addr is None or not any(addr in n for n in self._nets)):
            raise PrefillFailed("not_allowed")
        return f"http://{prefiller}{path}"

    async def _forward(self, request: web.Request, data: Any, leg: str = "") -> web.StreamResponse:
        """Send the request (``data``: bytes, or the client's body stream) to the local vLLM and
        stream its answer back chunk by chunk. ``leg`` "decode": time it as the decode leg."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers.pop(PREFILLER_HEADER, None)
        url = self.cfg.vllm + request.rel_url.path_qs
        t0 = time.perf_counter()
        out = web.StreamResponse()
        try:
            async with self.session.request(request.method, url, data=data, headers=headers) as up:
                out.set_status(up.status, up.reason)
                for k, v in up.headers.items():
                    if k.lower() not in HOP_BY_HOP:
                        out.headers[k] = v
                if up.content_length is not None and "chunked" not in up.headers.get("transfer-encoding", ""):
                    out.content_length = up.content_length
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
        except aiohttp.ClientError as exc:
            if out.prepared:  # vLLM went away mid-stream: nothing more can be said to the client
                raise
            log.error("local vLLM %s: %s", self.cfg.vllm, exc)
            return web.json_response(
                {"error": {"message": f"local model server unreachable: {exc}", "type": "bad_gateway"}},
                status=502,
            )
        finally:
            if leg:
                self.metrics.leg_seconds.labels(leg).observe(time.perf_counter() - t0)
        return out


async def serve(cfg: SidecarConfig, host: str, port: int) -> None:
    """Run until cancelled."""
    runner = web.AppRunner(Sidecar(cfg).app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("pd sidecar on %s:%d in front of %s (%s)", host, port, cfg.vllm, cfg.connector)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()

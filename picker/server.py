"""Wiring: the gRPC ext_proc server (with health on the same port, as gateways probe it there),
the plaintext health server, the metrics/debug HTTP server, discovery and scraping."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from picker._proto.kvpick.v1 import explain_pb2_grpc
from picker.config import RouterConfig
from picker.endpoints.pool import Pool
from picker.endpoints.types import EndpointProvider, EndpointState
from picker.explain import ExplainService
from picker.extproc import FULL_DUPLEX, ExtProcService
from picker.http import make_app
from picker.router import Router
from picker.scrape import Scraper
from picker.telemetry import Telemetry
from picker.tls import server_credentials

log = logging.getLogger(__name__)
EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ServerOptions:
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    host: str = "0.0.0.0"
    secure_serving: bool = True
    cert_path: str | None = None
    enable_cert_reload: bool = False
    default_body_mode: int = FULL_DUPLEX


class PickerServer:
    def __init__(self, cfg: RouterConfig, provider: EndpointProvider, opts: ServerOptions) -> None:
        self.cfg, self.provider, self.opts = cfg, provider, opts
        self.pool = Pool()
        self.telemetry = Telemetry()
        self.router = Router(cfg, self.pool, plugin_timer=self.telemetry.plugin_timer)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.pool.on_remove(lambda s: self.telemetry.forget(s.key))
        self._stopping = asyncio.Event()

    def _on_scrape(self, state: EndpointState) -> None:
        self.router.refresh_capacity(state)

    def _on_scrape_error(self, state: EndpointState, reason: str) -> None:
        self.telemetry.scrape_errors.labels(state.key, reason).inc()

    async def _set_health(self, ready: bool) -> None:
        status = SERVING if ready else NOT_SERVING
        for svc in ("", "liveness", EXTPROC_SERVICE):
            await _maybe_await(self.health.set(svc, SERVING))
        await _maybe_await(self.health.set("readiness", status))

    async def _watch_readiness(self) -> None:
        last: bool | None = None
        while True:
            ready = bool(self.pool.routable())
            if ready != last:
                await self._set_health(ready)
                last = ready
            await asyncio.sleep(0.5)

    def _grpc_server(self) -> grpc.aio.Server:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(
            ExtProcService(self.router, self.telemetry, self.opts.default_body_mode), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        explain_pb2_grpc.add_ExplainServicer_to_server(ExplainService(self.router), server)
        addr = f"{self.opts.host}:{self.opts.grpc_port}"
        if self.opts.secure_serving:
            server.add_secure_port(
                addr, server_credentials(self.opts.cert_path, self.opts.enable_cert_reload)
            )
        else:
            server.add_insecure_port(addr)
        return server

    async def run(self) -> None:
        ext = self._grpc_server()
        hs = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, hs)
        hs.add_insecure_port(f"{self.opts.host}:{self.opts.grpc_health_port}")
        runner = web.AppRunner(make_app(self.router, self.telemetry), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.opts.host, self.opts.metrics_port)
        await self._set_health(False)
        async with Scraper(self.pool, self.cfg.scrape, self._on_scrape, self._on_scrape_error):
            tasks = [
                asyncio.create_task(self.provider.run(self.pool)),
                asyncio.create_task(self._watch_readiness()),
            ]
            await ext.start()
            await hs.start()
            await site.start()
            log.info(
                "picker serving ext_proc on :%d (%s), health :%d, metrics :%d, policy %s",
                self.opts.grpc_port,
                "TLS" if self.opts.secure_serving else "plaintext",
                self.opts.grpc_health_port,
                self.opts.metrics_port,
                self.cfg.policy,
            )
            try:
                done, _ = await asyncio.wait(
                    [*tasks, asyncio.create_task(self._stopping.wait())], return_when=asyncio.FIRST_COMPLETED
                )
                for t in done:
                    if t in tasks and t.exception():
                        raise RuntimeError("discovery failed") from t.exception()
            finally:
                for t in tasks:
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t
                await ext.stop(grace=2)
                await hs.stop(grace=0)
                await runner.cleanup()

    def stop(self) -> None:
        self._stopping.set()


async def _maybe_await(x: object) -> None:
    if asyncio.iscoroutine(x):
        await x

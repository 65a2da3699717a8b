"""Wiring: the gRPC ext_proc server (with health on the same port, as gateways probe it there),
the plaintext health server, the metrics HTTP server, the opt-in debug faces, discovery and
scraping, and the lifecycle.

Health (gRPC, services ``liveness``, ``readiness`` and the ext_proc service name):
- ``liveness`` is SERVING while the process runs;
- ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` are SERVING once discovery
  has synced (the provider pushed its first endpoint set) and until shutdown begins. An empty pool
  is still ready: requests then get the protocol's 503, not a gateway error.

Shutdown (SIGTERM): readiness goes NOT_SERVING, the ext_proc server takes no new streams, and
in-flight streams (each lives as long as its generation) finish for up to ``drain_timeout_s``
(130 s, as GIE's termination grace); then the process exits. A second signal skips the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from dataclasses import dataclass, field

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from picker._proto.kvpick.v1 import explain_pb2_grpc
from picker.core.config import RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import EndpointProvider, EndpointState, Health
from picker.core.objectives import ObjectiveSource
from picker.core.router import Router
from picker.feeds.drain import INTERVAL_S, Inbox
from picker.feeds.peers import Peers
from picker.feeds.scrape import Scraper
from picker.feeds.subscribers import Subscribers
from picker.serving.director import Director
from picker.serving.explain import ExplainService
from picker.serving.extproc import FULL_DUPLEX, ExtProcService
from picker.serving.flow import FlowGate
from picker.serving.http import debug_app, metrics_app
from picker.serving.offload import BodyParser
from picker.serving.telemetry import Telemetry
from picker.serving.tls import server_credentials
from picker.serving.tokenization import Tokenization

log = logging.getLogger(__name__)
EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READINESS_SERVICES = ("", "readiness", EXTPROC_SERVICE)
MESSAGE_HEADROOM = 1 << 20
"""Bytes allowed in one ext_proc message beyond the body limit (headers, metadata, framing)."""
GIE_PROBE_SERVICE = "inference-extension"
"""What GIE's chart probes on 9003, for liveness and readiness alike, when leader election is
off: SERVING once discovery has synced, and still while draining (a failing liveness probe would
get the pod killed before its streams finish)."""


@dataclass(frozen=True)
class ServerOptions:
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    host: str = "0.0.0.0"
    secure_serving: bool = True
    cert_path: str | None = None
    enable_cert_reload: bool = False
    client_ca_path: str | None = None
    """A PEM CA bundle: ext_proc clients must present a certificate it signed (mTLS,
    :mod:`picker.serving.tls`); None: any client may connect."""
    default_body_mode: int = FULL_DUPLEX
    enable_debug_api: bool = False
    """Serve ``/debug/explain`` and ``/debug/endpoints`` on ``debug_port`` (needs ``debug_token``)."""
    debug_token: bytes | None = field(default=None, repr=False)
    """The bearer token every debug API request must carry."""
    metrics_token: bytes | None = field(default=None, repr=False)
    """The bearer token ``/metrics`` requests must carry; None: open."""
    debug_port: int = 9091
    debug_bind_address: str = "127.0.0.1"
    enable_explain_grpc: bool = False
    """Serve the ``kvpick.v1.Explain`` gRPC service on the ext_proc port."""
    max_concurrent_streams: int = 4096
    """Concurrent ext_proc streams; over it a stream is refused with RESOURCE_EXHAUSTED and
    Envoy's failure mode applies. Health checks and Explain calls on the same port are not
    counted (a full picker must still answer its health checks). 0: no cap."""
    drain_timeout_s: float = 130.0
    response_headers: str = "when-needed"
    """``when-needed`` or ``always``: see :class:`~picker.serving.extproc.ExtProcService`."""
    reuse_port: bool = False
    """Bind every port with SO_REUSEPORT (``--workers``: N processes share them)."""
    pool_name: str = "kvpick"
    """The ``name`` label of the ``inference_pool_*`` metrics (GIE's: the InferencePool's name)."""
    peer_bind: str = ""
    """ZMQ address this picker publishes its picks on (``tcp://*:5560``; "" = no peers)."""
    peers: tuple[str, ...] = ()
    """The other picker replicas' pick publishers (``tcp://host:5560``), subscribed to."""
    peer_dns: str = ""
    """``host:port`` naming every picker replica (a headless Service), re-resolved for peers."""
    message_interval_s: float = INTERVAL_S
    """KV events and peer messages are read before each pick and otherwise at most this often
    (:class:`~picker.feeds.drain.Inbox`): an upper bound on how late a non-routing picker sees a
    peer's scrape outcome or heartbeat."""


class PickerServer:
    """Builds every part by constructor, in dependency order (pool → inbox → scraper → telemetry
    → router → tokenization → director), then :meth:`run` starts them. The peer channel binds
    its sockets, so it is made in :meth:`run`; it registers itself with the router and the
    scraper it feeds (:meth:`Router.add_pick_listener`, :meth:`Scraper.share_with`)."""

    def __init__(self, cfg: RouterConfig, provider: EndpointProvider, opts: ServerOptions) -> None:
        self.cfg, self.provider, self.opts = cfg, provider, opts
        self.pool = Pool()
        self.inbox = Inbox(opts.message_interval_s)
        self.scraper = Scraper(self.pool, cfg.scrape, self._on_scrape, self._on_scrape_error)
        self.telemetry = Telemetry(
            pool_name=opts.pool_name, inbox=self.inbox, scraper=self.scraper, known_model=self.known_model
        )
        self.router = Router(
            cfg, self.pool, plugin_timer=self.telemetry.plugin_timer, catch_up=self.inbox.catch_up
        )
        for prof in self.router.profiles.values():  # GIE's extension_point label per plugin
            points = self.telemetry.extension_points
            points.update({name: "Filter" for name, _ in prof.filters})
            points.update({name: "Scorer" for name, _, _ in prof.scorers})
            points[prof.picker[0]] = "Picker"
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.pool.on_remove(lambda s: self.telemetry.forget(s.key))
        if isinstance(provider, ObjectiveSource):  # Kubernetes: InferenceObjective objects
            provider.attach_objectives(self.router.objectives)
        self.parser = BodyParser(cfg.parse_offload_bytes)
        self.tokenization = Tokenization.from_config(self.router, cfg.prefix)
        self.telemetry.tokenizer = self.tokenization.local
        self.director = Director(self.router, self.tokenization, self.telemetry, self.parser)
        self.flow: FlowGate | None = None
        """The ext_proc hold (flow control), when ``flow_control.enabled``."""
        if cfg.flow_control.enabled:
            self.flow = self.director.flow = FlowGate(self.director, cfg.flow_control, cfg.scrape.interval_s)
        self._stopping = asyncio.Event()
        self._subs: Subscribers | None = None
        self._force = asyncio.Event()
        self.draining = False
        """Set once shutdown begins; written only by :meth:`run`."""

    def known_model(self, name: str) -> bool:
        """Whether model ``name`` may be a ``/metrics`` label value: a configured LoRA adapter, or
        a name a replica reports serving (its ``model_name`` label, or a LoRA it runs)."""
        if name in self.cfg.lora_adapters:
            return True
        for s in self.pool:
            m = s.metrics
            if name in m.served_models or name in m.running_loras or name in m.waiting_loras:
                return True
        return False

    def _on_scrape(self, state: EndpointState) -> None:
        self.router.on_scrape(state)

    def _on_scrape_error(self, state: EndpointState, reason: str) -> None:
        self.telemetry.scrape_errors.labels(state.key, reason).inc()
        if state.health is Health.UNREACHABLE:
            self.router.on_unreachable(state)
            if self._subs is not None:
                self._subs.suspect(state.key)

    async def _set_health(self, ready: bool) -> None:
        status = SERVING if ready else NOT_SERVING
        await _maybe_await(self.health.set("liveness", SERVING))
        for svc in READINESS_SERVICES:
            await _maybe_await(self.health.set(svc, status))
        synced = SERVING if self.pool.synced else NOT_SERVING
        await _maybe_await(self.health.set(GIE_PROBE_SERVICE, synced))

    async def _watch_readiness(self) -> None:
        """Readiness follows discovery's first sync (checked every 0.1 s until then; once ready,
        every second: only the drain, which sets it itself, turns it off)."""
        last: bool | None = None
        while True:
            ready = self.pool.synced and not self.draining
            if ready != last:
                await self._set_health(ready)
                last = ready
            await asyncio.sleep(1.0 if ready else 0.1)

    def _grpc_server(self) -> grpc.aio.Server:
        reuse = int(self.opts.reuse_port)
        # A BUFFERED body arrives as one message: up to Envoy's buffer limit (the body limit plus
        # 64 KiB, deploy/envoy/render.py), which must reach the picker to get its 413, not
        # gRPC's 4 MiB default receive cap (RESOURCE_EXHAUSTED, a 500 from Envoy).
        max_message = self.cfg.max_body_bytes + MESSAGE_HEADROOM
        options = [("grpc.so_reuseport", reuse), ("grpc.max_receive_message_length", max_message)]
        server = grpc.aio.server(options=options)
        service = ExtProcService(
            self.director,
            self.opts.default_body_mode,
            self.opts.response_headers,
            max_streams=self.opts.max_concurrent_streams,
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if self.opts.enable_explain_grpc:
            explain_pb2_grpc.add_ExplainServicer_to_server(ExplainService(self.director), server)
        addr = f"{self.opts.host}:{self.opts.grpc_port}"
        if self.opts.secure_serving:
            server.add_secure_port(
                addr,
                server_credentials(
                    self.opts.cert_path, self.opts.enable_cert_reload, self.opts.client_ca_path
                ),
            )
        else:
            server.add_insecure_port(addr)
        return server

    async def _http_sites(self) -> list[web.AppRunner]:
        runners: list[web.AppRunner] = []
        o = self.opts
        faces = [(metrics_app(self.router, self.telemetry, o.metrics_token), o.host, o.metrics_port)]
        if o.enable_debug_api:
            faces.append((debug_app(self.director, o.debug_token or b""), o.debug_bind_address, o.debug_port))
        for app, host, port in faces:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, host, port, reuse_port=self.opts.reuse_port or None).start()
            runners.append(runner)
        return runners

    async def run(self) -> None:
        ext = self._grpc_server()
        hs = grpc.aio.server(options=[("grpc.so_reuseport", int(self.opts.reuse_port))])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, hs)
        hs.add_insecure_port(f"{self.opts.host}:{self.opts.grpc_health_port}")
        await self._set_health(False)
        runners: list[web.AppRunner] = []
        inbox, scraper = self.inbox, self.scraper
        inbox.start()
        subs = self._subs = self._subscribers(inbox)
        peers = (
            Peers(
                self.router,
                self.opts.peer_bind,
                self.opts.peers,
                peer_dns=self.opts.peer_dns,
                inbox=inbox,
                scraper=scraper,
            )
            if self.opts.peer_bind
            else None
        )
        async with scraper:
            if subs is not None:
                subs.attach(self.pool)
            tasks = [
                asyncio.create_task(self.provider.run(self.pool)),
                asyncio.create_task(self._watch_readiness()),
                *([asyncio.create_task(self.flow.run())] if self.flow is not None else []),
                *([asyncio.create_task(peers.run())] if peers is not None else []),
            ]
            try:
                self.parser.start()
                await ext.start()
                await hs.start()
                runners = await self._http_sites()
                self._log_started()
                settle_heap()
                done, _ = await asyncio.wait(
                    [*tasks, asyncio.create_task(self._stopping.wait())], return_when=asyncio.FIRST_COMPLETED
                )
                for t in done:
                    if t in tasks and t.exception():
                        raise RuntimeError("discovery failed") from t.exception()
                await self._drain(ext)
            finally:
                for t in tasks:
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t
                await ext.stop(grace=0)
                await hs.stop(grace=0)
                for r in runners:
                    await r.cleanup()
                if subs is not None:
                    await subs.close()
                self.parser.close(wait=True)
                await self.tokenization.close()
                if peers is not None:
                    peers.close()
                inbox.stop()

    async def _drain(self, ext: grpc.aio.Server) -> None:
        """NOT_SERVING, no new streams, in-flight streams finish (up to the drain timeout, or
        until a second signal)."""
        self.draining = True
        await self._set_health(False)
        log.info("draining: no new streams; in-flight streams get up to %.0f s", self.opts.drain_timeout_s)
        if self.flow is not None:
            log.info("draining: %d queued requests dispatched or answered", self.flow.drain())
        stop = asyncio.create_task(ext.stop(grace=self.opts.drain_timeout_s))
        force = asyncio.create_task(self._force.wait())
        await asyncio.wait([stop, force], return_when=asyncio.FIRST_COMPLETED)
        force.cancel()
        if not stop.done():
            log.warning("second signal: ending the drain now")
            await ext.stop(grace=0)
            await stop
        log.info("drained")

    def _log_started(self) -> None:
        o = self.opts
        log.info(
            "picker serving ext_proc on :%d (%s), health :%d, metrics :%d, debug %s, explain gRPC %s, "
            "max streams %s, policy %s",
            o.grpc_port,
            ("mTLS" if o.client_ca_path else "TLS") if o.secure_serving else "plaintext",
            o.grpc_health_port,
            o.metrics_port,
            f"{o.debug_bind_address}:{o.debug_port}" if o.enable_debug_api else "off",
            "on" if o.enable_explain_grpc else "off",
            o.max_concurrent_streams or "unbounded",
            self.cfg.policy,
        )

    def _subscribers(self, inbox: Inbox) -> Subscribers | None:
        """KV-event subscribers feeding the precise index (precise and auto modes)."""
        p = self.cfg.prefix
        if self.router.precise is None:
            return None
        return Subscribers(
            self.router.precise,
            self.router.syncs,
            p.kv_events_port,
            p.kv_events_replay_port,
            p.kv_events_topic,
            p.refill_s,
            p.data_parallel_ports,
            inbox,
        )

    def stop(self) -> None:
        """Begin shutdown; a second call ends the drain at once."""
        if self._stopping.is_set():
            self._force.set()
        self._stopping.set()


async def _maybe_await(x: object) -> None:
    if asyncio.iscoroutine(x):
        await x


GC_YOUNG_THRESHOLD = 20_000
"""Allocations (net of deallocations) between two collections of the youngest generation; the
interpreter's default is 700. A 100k-token request parses, tokenizes and keys tens of thousands
of objects, most of them dead by its end: at 700 it runs dozens of young collections per request,
each promoting what is still live to an older generation, which brings the next full collection
closer."""


def settle_heap() -> None:
    """Run once the picker serves (every module imported, tokenizer and templates loaded): one
    full collection, then :func:`gc.freeze` moves every object still alive into the permanent
    generation, which no later collection walks (about 75,000 objects, the imports, gRPC, the
    tokenizer and the templates), and the youngest generation's threshold is raised to
    :data:`GC_YOUNG_THRESHOLD`. The older generations keep CPython's defaults (10, 10), so a
    cycle that outlives a request is still freed by a full collection, which CPython runs when the
    objects promoted since the last one exceed a quarter of the old generation. The picker's own
    state does not depend on this (it holds no cycles it needs the collector for); what it saves
    is measured by ``python -m bench.progressive_envoy`` (bench/results/2026-11-27-parity.md)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)

"""``python -m picker``: the kvpick endpoint picker (an Envoy ext_proc service, GIE protocol).

Flags shared with GIE's EPP keep GIE's names, so the picker can replace it in a deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import sys
from typing import Any

import yaml

from picker.core import config as config_mod
from picker.core.endpoints.types import EndpointProvider
from picker.feeds.discovery.static import FileProvider, StaticProvider, parse_list
from picker.feeds.drain import INTERVAL_S
from picker.serving import gie_flags, workers
from picker.serving.extproc import BUFFERED, FULL_DUPLEX, RESPONSE_HEADERS
from picker.serving.server import PickerServer, ServerOptions
from picker.serving.workers import WORKER_FLAG


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


BODY_MODES = {"full-duplex": FULL_DUPLEX, "buffered": BUFFERED}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` only for real defaults. A ``None`` default means "not given": the
    routing overrides then keep the config's value, and their help names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _from_config(value: object) -> str:
    return f"(default from config: {value})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m picker", description=__doc__, formatter_class=_HelpFormatter)
    so, cfg = ServerOptions(), config_mod.RouterConfig()
    gie_flags.add_flags(p)  # printed first, after the options group
    g = p.add_argument_group("serving (GIE-compatible names)")
    g.add_argument(
        "--grpc-port", type=int, default=so.grpc_port, help="ext_proc gRPC port (also serves gRPC health)"
    )
    g.add_argument(
        "--grpc-health-port", type=int, default=so.grpc_health_port, help="plaintext gRPC health port"
    )
    g.add_argument("--metrics-port", type=int, default=so.metrics_port, help="Prometheus /metrics HTTP port")
    g.add_argument("--host", default=so.host, help="address to bind all ports on")
    g.add_argument(
        "--secure-serving",
        type=_bool,
        default=so.secure_serving,
        metavar="BOOL",
        help="serve ext_proc over TLS (self-signed unless --cert-path); false for plaintext",
    )
    g.add_argument("--cert-path", default=None, help="directory holding tls.crt and tls.key")
    g.add_argument(
        "--enable-cert-reload",
        type=_bool,
        default=so.enable_cert_reload,
        metavar="BOOL",
        help="re-read the certificate in --cert-path when it changes",
    )
    g.add_argument("--config-file", default=None, help="YAML config (policies, hashing, index, scrape)")
    g.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=so.max_concurrent_streams,
        help="cap on concurrent ext_proc streams (health checks on the same port are not "
        "counted); over it a stream is refused (RESOURCE_EXHAUSTED) and Envoy's failure mode "
        "applies; 0 for no cap",
    )
    g.add_argument(
        "--response-headers",
        choices=RESPONSE_HEADERS,
        default=so.response_headers,
        help="when-needed: where there are no response bodies and no fallbacks, tell Envoy per "
        "request (mode_override) not to send the response headers, one ext_proc message each way "
        "less (the request still ends with the ext_proc stream); always: take what Envoy sends",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=so.drain_timeout_s,
        metavar="SECONDS",
        help="on SIGTERM, how long in-flight streams may run on before the picker exits",
    )
    s = p.add_argument_group("security (debug faces are off unless asked for)")
    s.add_argument(
        "--enable-debug-api",
        action="store_true",
        help="serve /debug/explain and /debug/endpoints on --debug-port (they reveal which "
        "prefixes each endpoint served recently: keep them private)",
    )
    s.add_argument("--debug-port", type=int, default=so.debug_port, help="HTTP port of the debug API")
    s.add_argument(
        "--debug-bind-address", default=so.debug_bind_address, help="address the debug API binds to"
    )
    s.add_argument(
        "--enable-explain-grpc",
        action="store_true",
        help="serve the kvpick.v1.Explain gRPC service on the ext_proc port",
    )
    s.add_argument(
        "--trust-gateway-headers",
        type=_bool,
        default=None,
        metavar="BOOL",
        help="honour x-gateway-model-name-rewrite (only where the gateway strips a client's copy "
        f"and sets its own) {_from_config(cfg.trust_gateway_headers)}",
    )
    d = p.add_argument_group("discovery")
    d.add_argument("--endpoints", default=None, help="static endpoints ip:port,ip:port,...")
    d.add_argument("--endpoints-file", default=None, help="YAML endpoints file, reloaded when it changes")
    d.add_argument("--pool-name", default=None, help="InferencePool to read endpoints from (Kubernetes)")
    d.add_argument("--pool-namespace", default="default", help="namespace of the InferencePool / pods")
    d.add_argument(
        "--endpoint-selector", default=None, help="pod label selector, when no InferencePool is used"
    )
    d.add_argument(
        "--endpoint-target-ports", default=None, help="target ports for --endpoint-selector, e.g. 8000,8001"
    )
    r = p.add_argument_group(
        "routing (override the config file)",
        "Each flag, when given, replaces the --config-file value; the defaults shown are the "
        "built-in config's.",
    )
    r.add_argument(
        "--policy",
        default=None,
        help=f"scheduling policy: {', '.join(cfg.profiles)}, or one the config file defines "
        f"{_from_config(cfg.policy)}",
    )
    r.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"prefix hash block size in bytes of prompt text {_from_config(cfg.hashing.block_size)}",
    )
    r.add_argument(
        "--index-capacity",
        type=int,
        default=None,
        help=f"default per-endpoint LRU capacity in blocks {_from_config(cfg.index.capacity_blocks)}",
    )
    r.add_argument(
        "--fallbacks",
        type=int,
        default=None,
        help=f"fallback endpoints named after the primary {_from_config(cfg.fallbacks)}",
    )
    r.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help=f"largest request body accepted (else 413) {_from_config(cfg.max_body_bytes)}",
    )
    r.add_argument(
        "--scrape-interval",
        type=float,
        default=None,
        help=f"seconds between /metrics polls {_from_config(cfg.scrape.interval_s)}",
    )
    r.add_argument(
        "--prefix-mode",
        choices=["approximate", "precise", "auto"],
        default=None,
        help="prefix matches from our own picks (approximate) or the replicas' KV events (precise; auto: "
        f"precise where an endpoint publishes) {_from_config(cfg.prefix.mode)}",
    )
    r.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help=f"replicas' KV-event PUB port, on every endpoint's address {_from_config(cfg.prefix.kv_events_port)}",
    )
    r.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=None,
        help=f"replicas' KV-event replay (ROUTER) port, 0 for none {_from_config(cfg.prefix.kv_events_replay_port)}",
    )
    r.add_argument(
        "--data-parallel-ports",
        default=None,
        help="serving ports of data-parallel ranks 0..N-1 (e.g. 8000,8001): the endpoint on the r-th "
        "is subscribed at the KV-event ports + r, where vLLM's rank r publishes "
        f"{_from_config(cfg.prefix.data_parallel_ports or 'none')}",
    )
    r.add_argument(
        "--workers",
        type=int,
        default=1,
        help="picker processes in this pod sharing its ports (SO_REUSEPORT), agreeing over the peer channel",
    )
    r.add_argument(WORKER_FLAG, type=int, default=0, help=argparse.SUPPRESS)
    r.add_argument("--worker-dir", default="", help=argparse.SUPPRESS)
    r.add_argument(
        "--peer-bind",
        default="",
        help="publish this picker's picks for its peer replicas on this ZMQ address, e.g. tcp://*:5560",
    )
    r.add_argument(
        "--peers",
        default="",
        help="the other picker replicas' --peer-bind addresses, comma-separated (tcp://10.0.0.7:5560,...)",
    )
    r.add_argument(
        "--peers-dns",
        default="",
        help="HOST:PORT whose addresses are the picker replicas' --peer-bind (a headless Service), "
        "re-resolved every 5 s so restarted and added replicas are found; needs --peer-bind",
    )
    r.add_argument(
        "--message-interval",
        type=float,
        default=INTERVAL_S,
        help="seconds: KV events and peer messages are read before each pick and otherwise at most "
        f"this often, so a burst costs one wake-up (default {INTERVAL_S})",
    )
    r.add_argument(
        "--tokenizer",
        default=None,
        help="directory with the model's tokenizer.json and tokenizer_config.json (precise matching of text prompts)",
    )
    r.add_argument(
        "--tokenize-inline-bytes",
        type=int,
        default=None,
        help="with --tokenizer, tokenize bodies under this many bytes on the event loop, larger ones "
        f"in a thread; 0: always in a thread {_from_config(cfg.prefix.tokenize_inline_bytes)}",
    )
    r.add_argument(
        "--body-mode",
        choices=list(BODY_MODES),
        default=next(k for k, v in BODY_MODES.items() if v == so.default_body_mode),
        help="request body mode assumed when Envoy does not announce it in the stream's protocol_config",
    )
    p.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="level of the picker's own log lines (stderr); default info, or what GIE's -v says",
    )
    return p


def _config_file(path: str | None) -> config_mod.RouterConfig:
    """The config file, or the defaults when there is none or it is GIE's EndpointPickerConfig
    (GIE's chart mounts one; kvpick keeps its own policies and says so once)."""
    if not path:
        return config_mod.RouterConfig()
    with open(path, encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    if gie_flags.is_gie_config(raw):
        logging.getLogger("picker").warning(
            "%s is GIE's EndpointPickerConfig: its plugins are ignored; kvpick runs its default "
            "policy (give a kvpick config file to change it)",
            path,
        )
        return config_mod.RouterConfig()
    return config_mod.load_file(path)


def build_config(args: argparse.Namespace) -> config_mod.RouterConfig:
    cfg = _config_file(args.config_file)
    changes: dict[str, object] = {}
    cfg = dataclasses.replace(cfg, scrape=gie_flags.scrape_config(args, cfg.scrape))
    if args.policy:
        changes["policy"] = args.policy
    if args.fallbacks is not None:
        changes["fallbacks"] = args.fallbacks
    if args.max_body_bytes is not None:
        changes["max_body_bytes"] = args.max_body_bytes
    if args.block_size is not None:
        changes["hashing"] = dataclasses.replace(cfg.hashing, block_size=args.block_size)
    if args.index_capacity is not None:
        changes["index"] = dataclasses.replace(cfg.index, capacity_blocks=args.index_capacity)
    if args.trust_gateway_headers is not None:
        changes["trust_gateway_headers"] = args.trust_gateway_headers
    if args.scrape_interval is not None:
        changes["scrape"] = dataclasses.replace(cfg.scrape, interval_s=args.scrape_interval)
    prefix = {
        k: v
        for k, v in {
            "mode": args.prefix_mode,
            "kv_events_port": args.kv_events_port,
            "kv_events_replay_port": args.kv_events_replay_port,
            "tokenizer": args.tokenizer,
            "tokenize_inline_bytes": args.tokenize_inline_bytes,
            "data_parallel_ports": _ports(args.data_parallel_ports),
        }.items()
        if v is not None
    }
    if prefix:
        changes["prefix"] = dataclasses.replace(cfg.prefix, **prefix)
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


def _ports(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(p) for p in text.split(",") if p)
    except ValueError as exc:
        raise ValueError(f"--data-parallel-ports must be comma-separated ports, got {text!r}") from exc


def build_provider(args: argparse.Namespace) -> EndpointProvider:
    if args.endpoints:
        return StaticProvider(parse_list(args.endpoints))
    if args.endpoints_file:
        return FileProvider(args.endpoints_file)
    if args.pool_name or args.endpoint_selector:
        from picker.feeds.discovery.kube import KubeProvider  # imported lazily: only cluster mode needs it

        provider: EndpointProvider = KubeProvider.from_flags(
            pool_name=args.pool_name,
            pool_namespace=args.pool_namespace,
            endpoint_selector=args.endpoint_selector,
            endpoint_target_ports=args.endpoint_target_ports,
        )
        return provider
    raise ValueError("no endpoints: give --endpoints, --endpoints-file, --pool-name or --endpoint-selector")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print("picker: bad configuration: --workers must be >= 1", file=sys.stderr)
        return 2
    children: list[subprocess.Popen[bytes]] = []
    if args.workers > 1 and args.worker_index == 0:
        args.worker_dir, children = workers.spawn(argv, args.workers)
    try:
        return _serve(args)
    finally:
        workers.stop(children)


def _serve(args: argparse.Namespace) -> int:
    level = args.log_level or gie_flags.log_level(args) or "info"
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gie_flags.report(args)
    try:
        cfg = build_config(args)
        provider = build_provider(args)
        server = PickerServer(cfg, provider, _server_options(args))
    except (ValueError, OSError) as exc:
        print(f"picker: bad configuration: {exc}", file=sys.stderr)
        return 2

    async def _run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.stop)
        if args.worker_index > 0:  # a child worker ends with worker 0
            watchdog = asyncio.create_task(workers.exit_with_parent(os.getppid(), server.stop))
        await server.run()
        if args.worker_index > 0:
            watchdog.cancel()

    asyncio.run(_run())
    return 0


def _server_options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        grpc_port=args.grpc_port,
        grpc_health_port=args.grpc_health_port,
        metrics_port=args.metrics_port,
        host=args.host,
        secure_serving=args.secure_serving,
        cert_path=args.cert_path,
        enable_cert_reload=args.enable_cert_reload,
        default_body_mode=BODY_MODES[args.body_mode],
        enable_debug_api=args.enable_debug_api,
        debug_port=args.debug_port,
        debug_bind_address=args.debug_bind_address,
        enable_explain_grpc=args.enable_explain_grpc,
        max_concurrent_streams=args.max_concurrent_streams,
        response_headers=args.response_headers,
        drain_timeout_s=args.drain_timeout,
        pool_name=args.pool_name or "kvpick",
        message_interval_s=args.message_interval,
        **_peer_options(args),
    )


def _peer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The peer channel: the flags', plus, with ``--workers``, one ipc address per worker."""
    if not 0 < args.message_interval <= 60:
        raise ValueError(f"--message-interval must be in (0, 60] seconds, got {args.message_interval}")
    binds = [b for b in args.peer_bind.split(",") if b]
    peers = [p for p in args.peers.split(",") if p]
    if args.workers > 1:
        local = workers.peer_addresses(args.worker_dir, args.workers)
        binds.append(local[args.worker_index])
        peers += [a for i, a in enumerate(local) if i != args.worker_index]
    if args.peers_dns and not binds:
        raise ValueError("--peers-dns needs --peer-bind (the peers subscribe to this picker there)")
    return {
        "peer_bind": ",".join(binds),
        "peers": tuple(peers),
        "peer_dns": args.peers_dns,
        "reuse_port": args.workers > 1,
    }


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m picker``: the kvpick endpoint picker (an Envoy ext_proc service, GIE protocol).

:func:`build_parser` holds every flag and its help (the flag reference is generated from it).
Flags shared with GIE's EPP keep GIE's names, so the picker can replace it in a deployment; GIE's
own flags are in ``picker.serving.gie_flags``.
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
import textwrap
from typing import Any

import yaml

from picker.core import config as config_mod
from picker.core.endpoints.types import EndpointProvider
from picker.feeds.discovery.static import FileProvider, StaticProvider, parse_list
from picker.feeds.drain import INTERVAL_S
from picker.serving import gie_flags, workers
from picker.serving.extproc import BUFFERED, FULL_DUPLEX, RESPONSE_HEADERS
from picker.serving.http import read_token
from picker.serving.server import PickerServer, ServerOptions
from picker.serving.workers import WORKER_FLAG


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


BODY_MODES = {"full-duplex": FULL_DUPLEX, "buffered": BUFFERED}


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help where X says something: not for a ``None``
    default (the flag is then "not given": a routing flag keeps the config file's value, and its
    help says ``(default from config: X)`` itself), an empty one, or an on/off switch. Never
    breaks a line inside a hyphenated flag name."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, "", argparse.SUPPRESS) or action.nargs == 0:
            return text
        return f"{text} (default: %(default)s)"

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = [" ".join(par.split()) for par in text.split("\n\n")]
        return "\n\n".join(
            textwrap.fill(par, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)
            for par in paragraphs
        )


def _from_config(value: object) -> str:
    return f"(default from config: {value})"


USAGE = """%(prog)s [-h] (--endpoints IP:PORT,... | --endpoints-file PATH |
         --pool-name NAME | --endpoint-selector KEY=VALUE,...) [FLAG ...]"""

DESCRIPTION = """\
kvpick's endpoint picker: an Envoy ext_proc service that sends each LLM request to the model
server holding most of its prompt prefix, unless that one is overloaded. It speaks the Gateway
API Inference Extension (GIE) endpoint-picker protocol, a drop-in for GIE's EPP; GIE's own flags
come last. A flag whose default is "from config" replaces the --config-file value when given."""


def build_parser() -> argparse.ArgumentParser:
    """The picker's flags, in the order a user sets them: endpoints, ports, policy, prefix
    matching, then the rest by topic, GIE's own flags last (``picker.serving.gie_flags``)."""
    p = argparse.ArgumentParser(
        prog="python -m picker",
        usage=USAGE,
        description=DESCRIPTION,
        formatter_class=lambda prog: _HelpFormatter(prog, max_help_position=30),
    )
    so, cfg = ServerOptions(), config_mod.RouterConfig()
    _endpoint_flags(p)
    _port_flags(p, so)
    _policy_flags(p, cfg)
    _prefix_flags(p, cfg)
    _peer_flags(p)
    _tls_flags(p, so, cfg)
    _limit_flags(p, so, cfg)
    _debug_flags(p, so)
    gie_flags.add_flags(p)
    return p


def _endpoint_flags(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group(
        "endpoints",
        "Where the model servers are: one of --endpoints, --endpoints-file, --pool-name, "
        "--endpoint-selector (the first given wins, in that order).",
    )
    d.add_argument(
        "--endpoints",
        default=None,
        metavar="IP:PORT[=ROLE],...",
        help="a fixed list of model-server endpoints, comma-separated; each may name its P/D role "
        "(=prefill, =decode; none: both; docs/pd.md)",
    )
    d.add_argument(
        "--endpoints-file",
        default=None,
        metavar="PATH",
        help="YAML file listing the endpoints; re-read when it changes",
    )
    d.add_argument(
        "--pool-name",
        default=None,
        metavar="NAME",
        help="Kubernetes: read endpoints from this InferencePool's selected pods (watched)",
    )
    d.add_argument(
        "--pool-namespace",
        default="default",
        metavar="NAMESPACE",
        help="Kubernetes namespace of the InferencePool, or of the pods for --endpoint-selector",
    )
    d.add_argument(
        "--endpoint-selector",
        default=None,
        metavar="KEY=VALUE,...",
        help="Kubernetes without an InferencePool: the pods with these labels are the endpoints "
        "(needs --endpoint-target-ports)",
    )
    d.add_argument(
        "--endpoint-target-ports",
        default=None,
        metavar="PORT,...",
        help="with --endpoint-selector: each pod's serving ports, comma-separated (e.g. 8000,8001)",
    )


def _port_flags(p: argparse.ArgumentParser, so: ServerOptions) -> None:
    g = p.add_argument_group("ports")
    g.add_argument(
        "--grpc-port",
        type=int,
        default=so.grpc_port,
        metavar="PORT",
        help="TCP port of the ext_proc gRPC service Envoy calls (it also answers gRPC health)",
    )
    g.add_argument(
        "--grpc-health-port",
        type=int,
        default=so.grpc_health_port,
        metavar="PORT",
        help="TCP port of the plaintext gRPC health service (liveness, readiness) for probes",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=so.metrics_port,
        metavar="PORT",
        help="TCP port of the Prometheus /metrics HTTP endpoint",
    )
    g.add_argument("--host", default=so.host, metavar="ADDRESS", help="IP address the ports above bind to")


def _policy_flags(p: argparse.ArgumentParser, cfg: config_mod.RouterConfig) -> None:
    r = p.add_argument_group("policy and load")
    r.add_argument(
        "--config-file",
        default=None,
        metavar="PATH",
        help="kvpick's YAML config (policies, hashing, index, scrape, prefix); a GIE "
        "EndpointPickerConfig is accepted and its plugins ignored (logged)",
    )
    r.add_argument(
        "--policy",
        default=None,
        metavar="NAME",
        help=f"scheduling policy: {', '.join(cfg.profiles)}, or one the config file defines "
        f"{_from_config(cfg.policy)}",
    )
    r.add_argument(
        "--fallbacks",
        type=int,
        default=None,
        metavar="N",
        help="fallback endpoints named after the primary, a count (> 0 only behind Envoy's "
        f"override_host) {_from_config(cfg.fallbacks)}",
    )
    r.add_argument(
        "--scrape-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"seconds between /metrics polls of each endpoint (its load) {_from_config(cfg.scrape.interval_s)}",
    )


def _prefix_flags(p: argparse.ArgumentParser, cfg: config_mod.RouterConfig) -> None:
    r = p.add_argument_group("prefix matching")
    r.add_argument(
        "--prefix-mode",
        choices=config_mod.PREFIX_MODES,
        default=None,
        help="where prefix matches come from: approximate (the picker's own picks), precise (the "
        "replicas' KV events), auto (precise for each endpoint whose events arrive) "
        f"{_from_config(cfg.prefix.mode)}",
    )
    r.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="directory with the model's tokenizer.json and tokenizer_config.json, to tokenize text "
        "prompts for precise matching (without it: the replicas' /tokenize)",
    )
    r.add_argument(
        "--tokenize-inline-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="with --tokenizer: bodies under this many bytes are tokenized on the event loop, larger "
        f"ones in a thread; 0: always in a thread {_from_config(cfg.prefix.tokenize_inline_bytes)}",
    )
    r.add_argument(
        "--block-size",
        type=int,
        default=None,
        metavar="BYTES",
        help="approximate matching: bytes of prompt text per hashed block "
        f"{_from_config(cfg.hashing.block_size)}",
    )
    r.add_argument(
        "--index-capacity",
        type=int,
        default=None,
        metavar="BLOCKS",
        help="approximate matching: blocks remembered per endpoint (LRU), until its "
        f"cache size is scraped {_from_config(cfg.index.capacity_blocks)}",
    )
    r.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        metavar="PORT",
        help="precise matching: TCP port of the replicas' KV-event ZMQ PUB socket, the same on "
        f"every endpoint's address {_from_config(cfg.prefix.kv_events_port)}",
    )
    r.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=None,
        metavar="PORT",
        help="precise matching: TCP port of the replicas' KV-event replay (ZMQ ROUTER) socket; 0: "
        f"none {_from_config(cfg.prefix.kv_events_replay_port)}",
    )
    r.add_argument(
        "--data-parallel-ports",
        default=None,
        metavar="PORT,...",
        help="serving ports of data-parallel ranks 0..N-1 (e.g. 8000,8001): the endpoint on the r-th "
        "is subscribed at the KV-event ports + r, where vLLM's rank r publishes "
        f"{_from_config(cfg.prefix.data_parallel_ports or 'none')}",
    )


def _peer_flags(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group(
        "peers and workers", "Several pickers (processes or replicas) share their picks over ZMQ."
    )
    r.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="picker processes in this pod, sharing its ports (SO_REUSEPORT) and their picks",
    )
    r.add_argument(WORKER_FLAG, type=int, default=0, help=argparse.SUPPRESS)
    r.add_argument("--worker-dir", default="", help=argparse.SUPPRESS)
    r.add_argument(
        "--peer-bind",
        default="",
        metavar="ZMQ_ADDRESS",
        help="publish this picker's picks to its peer replicas on this ZMQ address (e.g. tcp://*:5560)",
    )
    r.add_argument(
        "--peers",
        default="",
        metavar="ZMQ_ADDRESS,...",
        help="the other picker replicas' --peer-bind addresses, comma-separated (e.g. tcp://10.0.0.7:5560)",
    )
    r.add_argument(
        "--peers-dns",
        default="",
        metavar="HOST:PORT",
        help="a name (a headless Service) whose addresses are the picker replicas' --peer-bind, "
        "re-resolved every 5 s so restarted and added replicas are found; needs --peer-bind",
    )
    r.add_argument(
        "--message-interval",
        type=float,
        default=INTERVAL_S,
        metavar="SECONDS",
        help="KV events and peer messages are read before each pick, and otherwise at most once "
        "per this many seconds, so a burst costs one wake-up; in (0, 60]",
    )


def _tls_flags(p: argparse.ArgumentParser, so: ServerOptions, cfg: config_mod.RouterConfig) -> None:
    s = p.add_argument_group("TLS and trust")
    s.add_argument(
        "--secure-serving",
        type=_bool,
        default=so.secure_serving,
        metavar="BOOL",
        help="serve ext_proc over TLS (self-signed certificate unless --cert-path), as GIE's EPP "
        "does; false: plaintext",
    )
    s.add_argument(
        "--cert-path",
        default=None,
        metavar="DIR",
        help="directory holding tls.crt and tls.key for --secure-serving (without it: a "
        "self-signed certificate made at start)",
    )
    s.add_argument(
        "--enable-cert-reload",
        type=_bool,
        default=so.enable_cert_reload,
        metavar="BOOL",
        help="re-read the certificate in --cert-path (and --client-ca-path) when its files change",
    )
    s.add_argument(
        "--client-ca-path",
        default=None,
        metavar="FILE",
        help="PEM CA bundle: with --secure-serving, every ext_proc client (the gateway) must present "
        "a certificate this CA signed (mTLS); a client with none or another CA's is refused at the "
        "handshake. Health stays on the plaintext --grpc-health-port (default: none, any client)",
    )
    s.add_argument(
        "--trust-gateway-headers",
        type=_bool,
        default=None,
        metavar="BOOL",
        help="honour x-llm-d-model-name-rewrite / x-gateway-model-name-rewrite (only where the gateway strips a client's copy "
        f"and sets its own) {_from_config(cfg.trust_gateway_headers)}",
    )


def _limit_flags(p: argparse.ArgumentParser, so: ServerOptions, cfg: config_mod.RouterConfig) -> None:
    g = p.add_argument_group("limits and the ext_proc stream")
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help=f"largest request body accepted; a larger one gets 413 {_from_config(cfg.max_body_bytes)}",
    )
    g.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=so.max_concurrent_streams,
        metavar="STREAMS",
        help="cap on concurrent ext_proc streams, one per request (health checks not counted); "
        "over it a stream is refused and Envoy's failure mode applies; 0: no cap",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=so.drain_timeout_s,
        metavar="SECONDS",
        help="on SIGTERM, how many seconds in-flight streams may run on before the picker exits",
    )
    g.add_argument(
        "--body-mode",
        choices=list(BODY_MODES),
        default=next(k for k, v in BODY_MODES.items() if v == so.default_body_mode),
        help="Envoy's request body mode, assumed when the stream's protocol_config does not say",
    )
    g.add_argument(
        "--response-headers",
        choices=RESPONSE_HEADERS,
        default=so.response_headers,
        help="when-needed: with no response body and no fallbacks, ask Envoy (mode_override) not "
        "to send the response headers, one ext_proc message each way less; always: take them",
    )


def _debug_flags(p: argparse.ArgumentParser, so: ServerOptions) -> None:
    s = p.add_argument_group("logging and debugging", "The debug faces are off unless asked for.")
    s.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="level of the picker's own log lines on stderr (default: info, or what GIE's -v or "
        "--zap-log-level ask for)",
    )
    s.add_argument(
        "--enable-debug-api",
        action="store_true",
        help="serve /debug/explain and /debug/endpoints on --debug-port (they reveal which "
        "prefixes each endpoint served recently: keep them private); needs --debug-token-file",
    )
    s.add_argument(
        "--debug-token-file",
        default=None,
        metavar="FILE",
        help="file holding the bearer token every debug API request must carry "
        "(Authorization: Bearer <token>; others get 401)",
    )
    s.add_argument(
        "--metrics-token-file",
        default=None,
        metavar="FILE",
        help="file holding a bearer token /metrics requests must carry (default: none, /metrics is open)",
    )
    s.add_argument(
        "--debug-port", type=int, default=so.debug_port, metavar="PORT", help="TCP port of the debug HTTP API"
    )
    s.add_argument(
        "--debug-bind-address",
        default=so.debug_bind_address,
        metavar="ADDRESS",
        help="IP address the debug HTTP API binds to",
    )
    s.add_argument(
        "--enable-explain-grpc",
        action="store_true",
        help="serve the kvpick.v1.Explain gRPC service (a request's scores) on the ext_proc port",
    )


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
        client_ca_path=_client_ca(args),
        default_body_mode=BODY_MODES[args.body_mode],
        enable_debug_api=args.enable_debug_api,
        debug_token=_debug_token(args),
        metrics_token=read_token(args.metrics_token_file) if args.metrics_token_file else None,
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


def _debug_token(args: argparse.Namespace) -> bytes | None:
    if not args.enable_debug_api:
        return None
    if not args.debug_token_file:
        raise ValueError("--enable-debug-api needs --debug-token-file (the API answers only a bearer token)")
    return read_token(args.debug_token_file)


def _client_ca(args: argparse.Namespace) -> str | None:
    if args.client_ca_path and not args.secure_serving:
        raise ValueError("--client-ca-path needs --secure-serving (mTLS is TLS with a client certificate)")
    if args.client_ca_path and not os.path.isfile(args.client_ca_path):
        raise ValueError(f"--client-ca-path {args.client_ca_path}: no such file")
    return str(args.client_ca_path) if args.client_ca_path else None


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

#!/usr/bin/env python3
"""Render an Envoy config for the kvpick picker (GIE endpoint-picker protocol, DESIGN §3).

    python deploy/envoy/render.py -o deploy/envoy/envoy.yaml             # the committed default
    python deploy/envoy/render.py --upstream pool --endpoints 127.0.0.1:8001,127.0.0.1:8002 \\
        -o deploy/envoy/envoy-fallback.yaml                              # committed: fallback retry

Upstreams:
- ``original-dst`` (default, what GIE gateways do): an ORIGINAL_DST cluster keyed by the
  ``x-gateway-destination-endpoint`` header. Works for any endpoint set, but Envoy cannot try a
  fallback host within a request: a dead primary fails the request until the picker's scraper
  marks it unreachable (about 3 scrape intervals).
- ``pool``: a STATIC cluster of the known endpoints with Envoy's ``override_host`` load-balancing
  policy, which reads the picker's ``envoy.lb`` metadata list (primary, then fallbacks). On a
  connect failure Envoy retries the next host in the list. With fail-open, requests that the
  picker did not answer are round-robined over the pool.

Both strip a client-sent ``x-gateway-destination-endpoint`` before ext_proc runs.

Fail-open defaults to BUFFERED bodies: in FULL_DUPLEX_STREAMED mode Envoy streams body bytes to
the processor before it learns the processor is unreachable, and then answers 500 even with
``failure_mode_allow`` (seen with Envoy 1.40). BUFFERED holds the body until the headers are
answered, so a dead picker is detected first and the request goes on without it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

DEST = "x-gateway-destination-endpoint"


def _ext_proc(picker: str, tls: bool, failure_open: bool, body_mode: str) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": "kvpick_picker", "authority": picker},
                "timeout": "10s",
            },
            "failure_mode_allow": failure_open,
            "allow_mode_override": True,
            "message_timeout": "10s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": body_mode,
                "response_body_mode": body_mode,
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
        },
    }


def _strip_header() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": DEST}]},
        },
    }


def _addr(hostport: str) -> dict[str, Any]:
    host, _, port = hostport.rpartition(":")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _picker_cluster(picker: str, tls: bool) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": "kvpick_picker",
        "type": "STATIC",
        "connect_timeout": "5s",
        "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "kvpick_picker",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(picker)}}]}],
        },
    }
    if tls:
        c["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"alpn_protocols": ["h2"]},
            },
        }
    return c


def _upstream_cluster(upstream: str, endpoints: list[str]) -> dict[str, Any]:
    if upstream == "original-dst":
        return {
            "name": "kvpick_upstream",
            "type": "ORIGINAL_DST",
            "connect_timeout": "2s",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DEST},
            "circuit_breakers": {
                "thresholds": [
                    {"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000}
                ]
            },
        }
    assert endpoints, "--upstream pool needs --endpoints"
    return {
        "name": "kvpick_upstream",
        "type": "STATIC",
        "connect_timeout": "2s",
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 40000,
                    "max_pending_requests": 40000,
                    "max_requests": 40000,
                    "max_retries": 1024,
                }
            ]
        },
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                            "override_host_sources": [
                                {"metadata": {"key": "envoy.lb", "path": [{"key": DEST}]}},
                                {"header": DEST},
                            ],
                            "fallback_policy": {
                                "policies": [
                                    {
                                        "typed_extension_config": {
                                            "name": "envoy.load_balancing_policies.round_robin",
                                            "typed_config": {
                                                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
                                            },
                                        }
                                    }
                                ]
                            },
                        },
                    }
                }
            ]
        },
        "load_assignment": {
            "cluster_name": "kvpick_upstream",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(e)}} for e in endpoints]}],
        },
    }


def render(
    listen_port: int = 8080,
    picker: str = "127.0.0.1:9002",
    tls: bool = True,
    failure_open: bool = False,
    body_mode: str = "FULL_DUPLEX_STREAMED",
    upstream: str = "original-dst",
    endpoints: list[str] | None = None,
    admin_port: int = 9901,
    retries: int = 2,
) -> dict[str, Any]:
    route: dict[str, Any] = {"cluster": "kvpick_upstream", "timeout": "0s", "idle_timeout": "3600s"}
    if upstream == "pool":
        route["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset-before-request",
            "num_retries": retries,
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                    },
                }
            ],
            "host_selection_retry_max_attempts": 5,
        }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "kvpick",
        "codec_type": "AUTO",
        "stream_idle_timeout": "3600s",
        "route_config": {
            "name": "kvpick",
            "virtual_hosts": [
                {"name": "kvpick", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": route}]}
            ],
        },
        "http_filters": [
            _strip_header(),
            _ext_proc(picker, tls, failure_open, body_mode),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                    "suppress_envoy_headers": True,
                },
            },
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "kvpick",
                    "address": {"socket_address": {"address": "0.0.0.0", "port_value": listen_port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ],
            "clusters": [_picker_cluster(picker, tls), _upstream_cluster(upstream, endpoints or [])],
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen-port", type=int, default=8080)
    p.add_argument("--admin-port", type=int, default=9901)
    p.add_argument("--picker", default="127.0.0.1:9002", help="picker ext_proc address ip:port")
    p.add_argument(
        "--plaintext", action="store_true", help="talk to the picker without TLS (--secure-serving=false)"
    )
    p.add_argument(
        "--failure-mode",
        choices=["close", "open"],
        default="close",
        help="close: reject when the picker is down; open: route without it",
    )
    p.add_argument(
        "--body-mode",
        choices=["FULL_DUPLEX_STREAMED", "BUFFERED"],
        default=None,
        help="default: FULL_DUPLEX_STREAMED for fail-close, BUFFERED for fail-open (see the module doc)",
    )
    p.add_argument("--upstream", choices=["original-dst", "pool"], default="original-dst")
    p.add_argument("--endpoints", default="", help="ip:port,... (needed for --upstream pool)")
    p.add_argument("-o", "--output", default="-")
    a = p.parse_args(argv)
    body_mode = a.body_mode or ("BUFFERED" if a.failure_mode == "open" else "FULL_DUPLEX_STREAMED")
    doc = render(
        a.listen_port,
        a.picker,
        not a.plaintext,
        a.failure_mode == "open",
        body_mode,
        a.upstream,
        [e for e in a.endpoints.split(",") if e],
        a.admin_port,
    )
    text = "# Generated by deploy/envoy/render.py; edit that, not this.\n" + yaml.safe_dump(
        doc, sort_keys=False
    )
    if a.output == "-":
        sys.stdout.write(text)
    else:
        with open(a.output, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

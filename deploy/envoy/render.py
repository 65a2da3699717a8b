#!/usr/bin/env python3
"""Render an Envoy config for the kvpick picker (GIE endpoint-picker protocol:
docs/design.md#the-endpoint-picker-protocol).

    python deploy/envoy/render.py -o deploy/envoy/envoy.yaml             # committed: the default
    python deploy/envoy/render.py --upstream pool --endpoints 127.0.0.1:8001,127.0.0.1:8002 \\
        -o deploy/envoy/envoy-fallback.yaml                              # committed: fallback retry
    python deploy/envoy/render.py --failure-mode open --fallback 127.0.0.1:8001,127.0.0.1:8002 \\
        -o deploy/envoy/envoy-failopen.yaml                              # committed: fail-open

Upstreams:
- ``original-dst`` (default, what GIE gateways do): an ORIGINAL_DST cluster keyed by the
  ``x-gateway-destination-endpoint`` header. Works for any endpoint set, but Envoy cannot try a
  fallback host within a request: a dead primary fails the request until the picker's scraper
  marks it unreachable. A reset before the request went out is retried once (a stale pooled
  connection), on the same host.
- ``pool``: a STATIC cluster of the known endpoints with Envoy's ``override_host`` load-balancing
  policy, which reads the picker's ``envoy.lb`` metadata list (primary, then fallbacks). On a
  connect failure Envoy retries the next host in the list.

Security (every config): before the route is chosen and ext_proc runs, an early header mutation
removes every client-sent ``x-gateway-destination-endpoint*`` (the header, ``-subset`` and
``-served``), ``x-llm-d-model-name-rewrite`` / ``x-gateway-model-name-rewrite`` and ``x-envoy-*``
header, so only the picker steers
routing and no client sets Envoy's retry or timeout knobs; ``use_remote_address: true`` makes Envoy append the real
peer to ``x-forwarded-for`` instead of trusting the client's.

Paths (every config): only the inference API reaches the model servers (``--allowed-paths``,
:data:`INFERENCE_PATHS`, each with its sub-paths). The first route matches a ``:path`` outside the
list (an inverted regex header match) and answers Envoy's own JSON 404 with ext_proc off for it,
so a replica's ``/reset_prefix_cache``, ``/metrics`` or ``/tokenize`` is out of a client's reach,
the picker up or down. Paths are normalised first (``normalize_path``, ``merge_slashes``), and an
escaped slash is refused (400).

Header limits (every config): a Lua filter before ext_proc answers a JSON 431 past
``--max-request-headers`` (100) headers or 60 KiB of them, far under the connection manager's own
limits (1,000, 96 KiB). ext_proc checks the headers after the picker's mutation against those and
answers 500 past them: with Envoy's defaults (100, 60 KiB), 88-95 client headers got a 500.

Failure mode (``failure_mode_allow``):
- close: a request the picker does not answer fails (500 from Envoy).
- open: it goes on without the picker. With ``pool`` the override_host policy falls back to
  round-robin. With ``original-dst`` there is no header to route on, so a second route catches
  requests that carry no ``x-gateway-destination-endpoint`` and sends them to a fallback cluster
  (``--fallback host:port,...``: the model servers' Service, or their addresses; required).
  Fail-open needs BUFFERED request bodies: in FULL_DUPLEX_STREAMED mode Envoy streams body bytes to
  the processor before it learns the processor is unreachable, and then answers 500 even with
  ``failure_mode_allow`` (checked with Envoy 1.40). BUFFERED holds the body until the headers are
  answered, so the listener's buffer limit is raised to the picker's body limit.

Request bodies are BUFFERED by default, in every config (fail-close too; GIE's own config uses
FULL_DUPLEX_STREAMED, which ``--body-mode FULL_DUPLEX_STREAMED`` still renders and the picker
still serves). Envoy holds a BUFFERED body (up to the picker's limit; past it Envoy answers 413)
and sends it in one message; the picker answers the headers at once, and the body with one message
carrying the destination. In FULL_DUPLEX_STREAMED the body arrives in many chunks and has to be
echoed back: BUFFERED cost about 30% less picker CPU per 220 KB request and about 10% less per
8 KB one (bench.datapath). Sending a small body without waiting for the headers' answer (one
round trip, ``send_body_without_waiting_for_header_response``) was measured and rejected: it cost
more picker CPU per request than it saved latency (bench/results/datapath.md).

Request headers are always SENT. With ``request_header_mode: SKIP`` ext_proc lets the headers
through at once, and the router matches the route and ORIGINAL_DST (or override_host) picks the
host at the headers, before the body is sent; a body answer's header mutation then has no headers
to change (Envoy 1.40, ``ext_proc.cc`` ``decodeHeaders``, ``processor_state.cc``
``handleBodyResponse``). Every request got Envoy's 404 (the route requires the destination
header), or 503 without that requirement
(``tests/picker/test_datapath.py::test_the_destination_cannot_ride_on_the_body_alone``).

Large bodies are streamed (``--stream-bodies-over``, 1 MiB; fail-close and pool configs). A BUFFERED
body reaches the picker as one gRPC message, which its event loop receives and decodes in one step
(9-17 ms for 8 MiB here), stalling every other request. So each route has twins, placed first, for
a ``content-length`` of at least the threshold, or none (a chunked body of unknown size), whose
per-route ext_proc override (``ExtProcPerRoute.overrides.processing_mode``) makes the request body
FULL_DUPLEX_STREAMED: it arrives in chunks of about 1 MiB (the listener's buffer limit is lowered to
the threshold plus 64 KiB, as no buffered body is larger), each a short step, and the parse runs in
the picker's worker process. Envoy also holds at most that much of a request per connection. On
these routes Envoy honours the picker's per-request skip of the response path (``mode_override``)
after the body and then closes the ext_proc stream at once, ending the request's accounting while
it is served; so the picker sends it only with a BUFFERED body (picker/serving/extproc.py). Not
with fail-open: a streamed body cannot fail open once its first chunk went to the picker (Envoy 1.40
answers 500, or resets), so fail-open keeps every body BUFFERED and refuses a threshold.

Response bodies are never BUFFERED: SSE stays streamed. The default, in every config, is NONE: the
picker never touches the response body (the ext_proc stream still ends with the HTTP stream:
Envoy closes it when the filter is destroyed, which ends the picker's accounting). Each response chunk through
the picker costs a gRPC round trip (a 256-token stream cost about 3x a plain response in picker
CPU; bench.datapath), and a picker killed mid-stream cuts no stream (with FULL_DUPLEX_STREAMED it
cuts those it was passing; bench.reliability measures both). FULL_DUPLEX_STREAMED (GIE's own test
config) still works: each chunk is echoed unchanged and the first one ends the request's pending
prefill in the picker's accounting.

Several pickers (``--picker a:9002,b:9002,c:9002``, or one name that resolves to several): the
ext_proc cluster fails over fast, so a dead picker costs little more than the requests it had in
flight. Envoy does not count ext_proc streams as traffic for its active health checks, so without
``no_traffic_interval`` it would check every 60 s. Each picker is therefore gRPC-health-checked
(service ``envoy.service.ext_proc.v3.ExternalProcessor``, on the ext_proc port, as GIE's gateways do)
every ``--picker-health-interval`` (0.5 s), traffic or not, and marked unhealthy at the first failure;
outlier detection ejects a picker at its first local-origin failure (connect refused, reset:
split from the picker's own answers), before its next health check; and the ext_proc stream is
opened with ``grpc_service.retry_policy``, retried on another picker on a connect failure, a refused
stream or a reset before the picker answered anything (checked on Envoy 1.40: a stream whose picker had just been
SIGKILLed is retried on a live one, as ``tests/precise/test_three_pickers.py`` shows). What remains is the
requests whose stream was already on the killed picker: they follow the failure mode.

Access log (``--access-log PATH``; off by default, for benchmarks): one JSON line per request,
keyed by ``x-request-id``, with its status and what answered it (``%RESPONSE_FLAGS%``,
``%RESPONSE_CODE_DETAILS%``: ``via_upstream`` for a model server's answer, ``ext_proc_error_gRPC_error_13{...}``
for a picker's stream that broke, a local reply's flags; the ext_proc calls' gRPC statuses), with
Envoy's timings of it (microseconds from the first byte received
from the client, ``%COMMON_DURATION%``: to the last one, to the first byte sent to the model server,
to the first byte back from it, to the first byte sent to the client) and the ext_proc filter's
own per-call timings of the picker (``%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:...)%``:
the gRPC round trip of the request-headers call and of the request-body calls). ``bench.split``
reads it. Envoy writes the file out every 10 s unless started with ``--file-flush-interval-msec``
(``kvlaunch.Stack`` sets 250 ms). Envoy replaces a client's ``x-request-id`` with its own (the client is external, as
``use_remote_address`` makes every client); ``--preserve-request-id`` keeps the client's, so that one
id names the request in the client's records, this log, the picker's and the model server's (off by
default: an id is then the gateway's, unique, not whatever a client chose).

Slow clients (every config): a client that sends its headers and then trickles the body must not
hold what other requests need. On BUFFERED routes the buffer filter, placed before ext_proc, holds
the body until it is whole, so the request's picker stream opens only then; before, each such
client held a picker stream for as long as it trickled, and Envoy's default circuit breaker on the
picker cluster (1,024 requests) refused every other request past 1,024 of them (500). The whole
request must arrive within ``--request-timeout`` (30 s; Envoy's ``request_timeout``, disarmed once
the last byte of the request is received, so a response may stream for as long as it takes), else
Envoy answers a JSON 408; a chunked or large body (the streamed routes) holds its picker stream
until then. Envoy runs that 408, like its other local replies, through ext_proc's response path;
with BUFFERED bodies the filter's response header and trailer modes are SKIP, so a local reply to
a request ext_proc never saw (a 408 or 413 the buffer filter answered, the header check's 431)
opens no picker stream, and the picker's answer to the request headers turns the response path on
(``mode_override``) for a request it routed and wants the response of; the streamed routes keep it
on, their stream being open from the headers (a burst of response-only streams had ended a few
CANCELLED, and fail-close turned those 408s into 500s). The picker cluster allows ``--picker-streams`` (4,096,
the picker's own default cap) concurrent streams; the overload manager caps open client connections
at ``--max-connections`` (50,000; the admin listener exempt) and, given ``--max-heap-bytes``, shrinks
the heap at 95% of it and refuses new requests at 98%; a client may open 100 streams on one HTTP/2
connection.

Timeouts: no total route timeout (a generation may stream for many minutes); a stream with no bytes
either way for ``--stream-idle-timeout`` (300 s, GIE's HTTPRoute request timeout) is reset; request
headers must arrive in 10 s; idle downstream connections close after 300 s and idle upstream ones
after 4 s (:data:`UPSTREAM_IDLE_TIMEOUT`, under vLLM's 5 s keep-alive); upstream TCP keepalive
(10 s idle, 3 probes 5 s apart) detects a vanished host in about 25 s even mid-stream.
"""

from __future__ import annotations

import argparse
import copy
import ipaddress
import re
import sys
from typing import Any

import yaml

DEST = "x-gateway-destination-endpoint"
REWRITE = ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite")
PREFILLER = "x-prefiller-host-port"
"""llm-d's P/D header: the host a decode pod's sidecar sends the prompt to. Only the picker sets it."""
"""The model rewrite header: llm-d-router's current name and its deprecated (GIE) alias."""
MAX_BODY = 8 * 1024 * 1024
"""The picker's default --max-body-bytes."""
_T = "type.googleapis.com/envoy.extensions."


MESSAGE_TIMEOUT = "10s"
MAX_MESSAGE_TIMEOUT = "90s"
"""The longest ``override_message_timeout`` Envoy honours: the picker's flow control holds a
request's stream unanswered while the pool is saturated, and extends the message timeout to the
longest it may wait (its queue TTL, or the empty pool's, 60 s by default, plus 5 s): above that."""


def _ext_proc(
    picker: str,
    failure_open: bool,
    request_mode: str,
    response_mode: str,
    message_timeout: str = MESSAGE_TIMEOUT,
    max_message_timeout: str = MAX_MESSAGE_TIMEOUT,
) -> dict[str, Any]:
    """The ext_proc filter. It forwards the gateway's ``envoy.lb.subset_hint`` metadata and the
    ``envoy.lb`` namespace (where the served endpoint is reported on the response path). A held
    request (flow control) extends ``message_timeout`` up to ``max_message_timeout``."""
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": "kvpick_picker", "authority": picker},
                "timeout": "10s",
                "retry_policy": _picker_retry(),
            },
            "failure_mode_allow": failure_open,
            # Fail-close answers 503, not Envoy's default 500: the picker unreachable, at its
            # stream cap (the streamed cluster's circuit breaker) or past a message timeout is a
            # service that cannot take the request now, which a client may retry.
            "status_on_error": {"code": 503},
            "allow_mode_override": True,
            "message_timeout": message_timeout,
            "max_message_timeout": max_message_timeout,
            "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]}},
            "processing_mode": _mode(
                request_mode, response_mode, _filter_response_path(request_mode, response_mode)
            ),
        },
    }


def _filter_response_path(request_mode: str, response_mode: str) -> str:
    """The filter's own response header and trailer mode: SKIP with BUFFERED request bodies and
    no response body, else SEND. Envoy runs every local reply through ext_proc's encode path,
    including one for a request ext_proc never saw (the buffer filter's 408 or 413, the header
    check's 431): with SEND it opened a picker stream for the response headers alone, which a
    burst of them could break (CANCELLED, and fail-close turned the 408 into a 500). With SKIP
    only the picker's ``mode_override`` in its answer to the request headers turns the response
    path on, for a request it routed and wants the response of (picker/serving/extproc.py).
    A FULL_DUPLEX_STREAMED request body keeps SEND: the picker sends no override there (Envoy
    1.40 closed the stream once the body was through when it honoured one)."""
    return "SKIP" if request_mode == "BUFFERED" and response_mode == "NONE" else "SEND"


def _mode(request_mode: str, response_mode: str, response_path: str = "SEND") -> dict[str, str]:
    """An ext_proc ``processing_mode``: request headers and trailers SEND, response headers and
    trailers ``response_path`` (:func:`_filter_response_path`)."""
    return {
        "request_header_mode": "SEND",
        "response_header_mode": response_path,
        "request_body_mode": request_mode,
        "response_body_mode": response_mode,
        "request_trailer_mode": "SEND",
        "response_trailer_mode": response_path,
    }


def _strip_headers(objective_header: str = "pass") -> list[dict[str, Any]]:
    """Client-sent routing headers never reach route selection, ext_proc, the router or the
    upstream. An early header mutation runs in the connection manager before the route is chosen:
    a filter would run after it, and a forged destination header would already have picked the
    ORIGINAL_DST route (with fail-open and the picker down, that request then had no host).
    llm-d's ``x-prefiller-host-port`` goes too: it names a host the decode pod's P/D sidecar
    calls, so only the picker may set it. Both spellings of each header go: llm-d's current ``x-llm-d-*`` name and its deprecated
    ``x-gateway-*`` alias (the picker reads either). ``objective_header`` "strip" drops the
    client's ``x-llm-d-inference-objective`` / ``x-gateway-inference-objective`` too (GIE
    lets clients choose it, and so their priority); "pass" keeps it (GIE's behaviour). A route's
    header modifier would not do: Envoy applies it in the router filter, after ext_proc."""
    assert objective_header in OBJECTIVE_HEADER_MODES, f"objective_header {objective_header!r}"
    mutations: list[dict[str, Any]] = [
        {"remove_on_match": {"key_matcher": {"prefix": p, "ignore_case": True}}} for p in (DEST, "x-envoy-")
    ]
    mutations += [{"remove": name} for name in (*REWRITE, PREFILLER)]
    if objective_header == "strip":
        mutations += [{"remove": name} for name in OBJECTIVE]
    return [
        {
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": _T + "http.early_header_mutation.header_mutation.v3.HeaderMutation",
                "mutations": mutations,
            },
        }
    ]


OBJECTIVE = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
OBJECTIVE_HEADER_MODES = ("pass", "strip")
SERVED_STAMP = "x-kvpick-served"
SERVED_LUA = f"""
function envoy_on_response(handle)
  local served = handle:headers():get("{SERVED_STAMP}")
  handle:headers():remove("{SERVED_STAMP}")
  if served then
    handle:streamInfo():dynamicMetadata():set("envoy.lb", "{DEST}-served", served)
  end
end
"""


MAX_REQUEST_HEADERS = 100
"""``--max-request-headers``: a request with more headers than this, as Envoy holds it before
ext_proc (the client's, the pseudo-headers and those Envoy adds: ``x-forwarded-for``,
``x-request-id``, ...), gets a JSON 431 (module doc)."""
MAX_REQUEST_HEADERS_KB = 60
"""A request whose headers' names and values hold more than this many KiB gets the same 431
(Envoy's default ``max_request_headers_kb``)."""
ENVOY_MAX_HEADERS = 1000
ENVOY_MAX_HEADERS_KB = 96
"""The connection manager's own limits (``max_headers_count``, ``max_request_headers_kb``), far
above the check's: room for what the picker's header mutation adds (the destination, a generated
``x-request-id``, a ``content-length``), which ext_proc checks against them (a 500 past them)."""
TOO_MANY_HEADERS_BODY = (
    '{"error":{"message":"request has too many headers","type":"request_header_fields_too_large","code":431}}'
)
HEADER_COUNT_LUA = """
local LIMIT = {limit}
local LIMIT_BYTES = {limit_bytes}
local BODY = '{body}'
function envoy_on_request(handle)
  local n, bytes = 0, 0
  for k, v in pairs(handle:headers()) do
    n = n + 1
    bytes = bytes + #k + #v
  end
  if n > LIMIT or bytes > LIMIT_BYTES then
    handle:respond({{[":status"] = "431", ["content-type"] = "application/json"}}, BODY)
  end
end
"""


def _header_count_check(limit: int) -> dict[str, Any]:
    """A Lua filter before ext_proc: a request with more than ``limit`` headers, or more than
    :data:`MAX_REQUEST_HEADERS_KB` of them, gets a JSON 431. ext_proc refuses (500) a header
    mutation whose result passes the connection manager's limits: with Envoy's defaults (100
    headers, 60 KiB) a request just under them was accepted, and the headers Envoy and the picker
    add pushed it over. Those limits are now :data:`ENVOY_MAX_HEADERS` and
    :data:`ENVOY_MAX_HEADERS_KB`: past them Envoy's HTTP/1 codec refuses the request, and as its
    local reply then passes through ext_proc while the connection closes, the client gets no
    answer (Envoy 1.40)."""
    lua = HEADER_COUNT_LUA.format(
        limit=limit, limit_bytes=MAX_REQUEST_HEADERS_KB * 1024, body=TOO_MANY_HEADERS_BODY
    )
    return {
        "name": "kvpick.header_count",
        "typed_config": {
            "@type": _T + "filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": lua},
        },
    }


def _json_reply(status: int, type_: str, message: str, runtime_key: str) -> dict[str, Any]:
    """A local-reply mapper: every reply of Envoy's own with HTTP ``status`` gets the picker's JSON
    error body, ``{"error": {"message": message, "type": type_, "code": status}}``, so a client sees
    one error shape whichever of the two answered. ``runtime_key``: the runtime key Envoy requires
    on the status comparison's value (``status`` is its default)."""
    error = {"message": message, "type": type_, "code": status}
    status_filter = {
        "comparison": {"op": "EQ", "value": {"default_value": status, "runtime_key": runtime_key}}
    }
    return {
        "filter": {"status_code_filter": status_filter},
        "body_format_override": {"json_format": {"error": error}, "content_type": "application/json"},
    }


def _too_many_headers_reply() -> dict[str, Any]:
    """Any other 431 of Envoy's in the same JSON shape as the Lua check's."""
    return _json_reply(
        431, "request_header_fields_too_large", "request has too many headers", "kvpick.too_many_headers"
    )


def _report_served() -> list[dict[str, Any]]:
    """Filters (before the router) that tell the picker which host served, as the protocol's data
    plane MUST, in every config: with ``pool`` a fallback may serve; with ``ORIGINAL_DST`` the one
    host named is the one that serves, and the report confirms it. Neither Envoy 1.40's
    override_host nor ORIGINAL_DST reports it, so on the response path a header mutation stamps
    ``%UPSTREAM_HOST%`` and a Lua filter moves it into ``envoy.lb`` metadata, which ext_proc
    forwards (the client never sees the stamp). Responses run the filter chain backwards: stamp, Lua, then ext_proc."""
    stamp = {
        "header": {"key": SERVED_STAMP, "value": "%UPSTREAM_HOST%"},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }
    return [
        {
            "name": "envoy.filters.http.lua",
            "typed_config": {
                "@type": _T + "filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": SERVED_LUA},
            },
        },
        {
            "name": "kvpick.served_stamp",
            "typed_config": {
                "@type": _T + "filters.http.header_mutation.v3.HeaderMutation",
                "mutations": {"response_mutations": [{"append": stamp}]},
            },
        },
    ]


def _addr(hostport: str) -> dict[str, Any]:
    host, _, port = hostport.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def _is_ip(hostport: str) -> bool:
    try:
        ipaddress.ip_address(hostport.rpartition(":")[0].strip("[]"))
    except ValueError:
        return False
    return True


def _load_assignment(name: str, endpoints: list[str]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(e)}} for e in endpoints]}],
    }


EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def _picker_retry() -> dict[str, Any]:
    """The ext_proc stream is retried on another picker when the first never answered: it was not
    taken (connect failure, refused stream) or the picker died before sending anything (reset,
    before response headers). Nothing the dead picker did is lost: its accounting died with it."""
    return {
        "retry_on": "connect-failure,refused-stream,reset-before-request,reset",
        "num_retries": 2,
        "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": _T + "retry.host.previous_hosts.v3.PreviousHostsPredicate"},
            }
        ],
        "host_selection_retry_max_attempts": 5,
    }


def _picker_failover(health_interval: str) -> dict[str, Any]:
    """Active gRPC health checks (traffic or not) and outlier detection (module doc)."""
    return {
        "health_checks": [
            {
                "timeout": "1s",
                "interval": health_interval,
                "no_traffic_interval": health_interval,
                "no_traffic_healthy_interval": health_interval,
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
            }
        ],
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "consecutive_gateway_failure": 2,
            "enforcing_consecutive_gateway_failure": 100,
            "interval": "1s",
            "base_ejection_time": "2s",
            "max_ejection_percent": 50,
        },
    }


def _picker_tls(client_cert_dir: str) -> dict[str, Any]:
    """The ext_proc cluster's TLS. With ``client_cert_dir`` (mTLS, the picker's
    ``--client-ca-path``): Envoy presents ``tls.crt``/``tls.key`` from it and accepts only a picker
    certificate that chains to its ``ca.crt`` (a Kubernetes TLS Secret's layout). Envoy reads the
    files at start: a rotated certificate takes effect when Envoy restarts."""
    common: dict[str, Any] = {"alpn_protocols": ["h2"]}
    if client_cert_dir:
        d = client_cert_dir.rstrip("/")
        common["tls_certificates"] = [
            {"certificate_chain": {"filename": f"{d}/tls.crt"}, "private_key": {"filename": f"{d}/tls.key"}}
        ]
        common["validation_context"] = {"trusted_ca": {"filename": f"{d}/ca.crt"}}
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _T + "transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": common,
        },
    }


def _picker_cluster(
    pickers: list[str], tls: bool, health_interval: str, client_cert_dir: str = ""
) -> dict[str, Any]:
    """The ext_proc cluster: HTTP/2 with Envoy's default codec (nghttp2)."""
    c: dict[str, Any] = {
        "name": "kvpick_picker",
        "type": "STATIC" if all(_is_ip(p) for p in pickers) else "STRICT_DNS",
        "connect_timeout": "5s",
        "lb_policy": "ROUND_ROBIN",
        **_picker_failover(health_interval),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": _load_assignment("kvpick_picker", pickers),
    }
    if tls:
        c["transport_socket"] = _picker_tls(client_cert_dir)
    return c


UPSTREAM_IDLE_TIMEOUT = "4s"
"""How long Envoy keeps an idle connection to a model server. Under the server's own keep-alive,
so that Envoy, not the server, closes an idle connection: vLLM's API server (uvicorn) closes one
after ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default, and a request Envoy sends on a connection
the server is closing gets a 503 ("upstream connect error or disconnect/reset before headers.
reset reason: connection termination"), which the route's ``reset-before-request`` retry does not
cover (the request went out). With 60 s here, about 1 request in 1,000-3,000 of ``bench.real``
and ``bench.flow_real`` got that 503 (bench/results/2026-11-27-real-routers.md); ``bench.keepalive``
aims at the race and shows each such 503 is a request on a connection the server's keep-alive
timer closed, and none with this value (bench/results/2026-11-28-keepalive.md). A model server
with a keep-alive of 4 s or less needs a lower value."""


def _model_server_cluster(name: str, retries_budget: int) -> dict[str, Any]:
    """What every cluster of model servers shares: timeouts, keepalive, limits."""
    return {
        "name": name,
        "connect_timeout": "2s",
        "upstream_connection_options": {
            "tcp_keepalive": {"keepalive_time": 10, "keepalive_interval": 5, "keepalive_probes": 3}
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "upstreams.http.v3.HttpProtocolOptions",
                "common_http_protocol_options": {"idle_timeout": UPSTREAM_IDLE_TIMEOUT},
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 40000,
                    "max_pending_requests": 40000,
                    "max_requests": 40000,
                    "max_retries": retries_budget,
                }
            ]
        },
    }


def _lb_policy(name: str, typed: str) -> dict[str, Any]:
    return {"typed_extension_config": {"name": name, "typed_config": {"@type": _T + typed}}}


def _original_dst_cluster() -> dict[str, Any]:
    c = _model_server_cluster("kvpick_upstream", 1024)
    c.update(
        type="ORIGINAL_DST",
        lb_policy="CLUSTER_PROVIDED",
        original_dst_lb_config={"use_http_header": True, "http_header_name": DEST},
    )
    return c


def _pool_cluster(endpoints: list[str]) -> dict[str, Any]:
    override = {
        "typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": _T + "load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [
                    {"metadata": {"key": "envoy.lb", "path": [{"key": DEST}]}},
                    {"header": DEST},
                ],
                "fallback_policy": {
                    "policies": [
                        _lb_policy(
                            "envoy.load_balancing_policies.round_robin",
                            "load_balancing_policies.round_robin.v3.RoundRobin",
                        )
                    ]
                },
            },
        }
    }
    c = _model_server_cluster("kvpick_upstream", 1024)
    c.update(
        type="STATIC",
        load_balancing_policy={"policies": [override]},
        load_assignment=_load_assignment("kvpick_upstream", endpoints),
    )
    return c


def _fallback_cluster(fallback: list[str]) -> dict[str, Any]:
    """Fail-open with ORIGINAL_DST: where a request the picker never saw goes (least request)."""
    c = _model_server_cluster("kvpick_fallback", 1024)
    c.update(
        type="STATIC" if all(_is_ip(e) for e in fallback) else "STRICT_DNS",
        lb_policy="LEAST_REQUEST",
        load_assignment=_load_assignment("kvpick_fallback", fallback),
    )
    return c


def _retry_policy(retry_on: str, retries: int, other_hosts: bool) -> dict[str, Any]:
    policy: dict[str, Any] = {"retry_on": retry_on, "num_retries": retries}
    if other_hosts:
        policy["retry_host_predicate"] = [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": _T + "retry.host.previous_hosts.v3.PreviousHostsPredicate"},
            }
        ]
        policy["host_selection_retry_max_attempts"] = 5
    return policy


CONNECT_RETRY = "connect-failure,refused-stream,reset-before-request"


def _route(
    name: str, cluster: str, idle: str, retry: dict[str, Any], header: str | None = None
) -> dict[str, Any]:
    """A route; its ``name`` (the access log's ``route``) says which body mode a request had."""
    match: dict[str, Any] = {"prefix": "/"}
    if header:
        match["headers"] = [{"name": header, "present_match": True}]
    action = {"cluster": cluster, "timeout": "0s", "idle_timeout": idle, "retry_policy": retry}
    return {"name": name, "match": match, "route": action}


def _routes(upstream: str, retries: int, idle: str, fallback: list[str]) -> list[dict[str, Any]]:
    if upstream == "pool":  # override_host: each retry takes the next host of the picker's list
        return [_route("upstream", "kvpick_upstream", idle, _retry_policy(CONNECT_RETRY, retries, True))]
    # ORIGINAL_DST has one host per request: retry a reset before the request went out, once.
    routes = [
        _route("upstream", "kvpick_upstream", idle, _retry_policy("reset-before-request", 1, False), DEST)
    ]
    if fallback:  # no destination header: the picker did not answer (fail-open)
        routes.append(
            _route("fallback", "kvpick_fallback", idle, _retry_policy(CONNECT_RETRY, retries, True))
        )
    return routes


INFERENCE_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
    "/v1/models",
)
"""``--allowed-paths``' default: the inference API. A path routes to the pool when it is one of
these or below one (``/v1/models/m``, ``/v1/responses/<id>``); every other gets a JSON 404 from
Envoy and never reaches a replica (module doc)."""
PATH_CHARS = re.compile(r"^/[-A-Za-z0-9/._~]*$")
"""What an allowed path may hold (the chart's ``httpRoute.paths`` schema says the same)."""
NOT_FOUND_ROUTE = "not_found"
NOT_FOUND_BODY = (
    '{"error":{"message":"this gateway routes only the inference API\'s paths",'
    '"type":"not_found","code":404}}'
)


def path_regex(paths: list[str] | tuple[str, ...]) -> str:
    """An RE2 regex for a ``:path`` (query string included) that is one of ``paths`` or below one."""
    alts = "|".join(p.rstrip("/").replace(".", "\\.") for p in paths)
    return f"^(?:{alts})(?:/[^?#]*)?(?:[?#].*)?$"


def _not_found_route(paths: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The first route: a ``:path`` outside ``paths`` gets Envoy's own JSON 404, with ext_proc off
    (the picker never sees it, and it answers the same with the picker down)."""
    outside = {
        "name": ":path",
        "string_match": {"safe_regex": {"regex": path_regex(paths)}},
        "invert_match": True,
    }
    json_type = {"header": {"key": "content-type", "value": "application/json"}}
    return {
        "name": NOT_FOUND_ROUTE,
        "match": {"prefix": "/", "headers": [outside]},
        "direct_response": {"status": 404, "body": {"inline_string": NOT_FOUND_BODY}},
        "response_headers_to_add": [{**json_type, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        "typed_per_filter_config": {
            "envoy.filters.http.ext_proc": {
                "@type": _T + "filters.http.ext_proc.v3.ExtProcPerRoute",
                "disabled": True,
            }
        },
    }


INT64_MAX = 2**63 - 1
STREAMED_ROUTE = "streamed"
"""The suffix of the size twins' route names (``upstream:streamed``): the access log's ``route``
says which body mode a request had."""
STREAM_BODIES_OVER = 1024 * 1024
"""``--stream-bodies-over``: request bodies of at least this many bytes (or of unknown size) are
FULL_DUPLEX_STREAMED to the picker, smaller ones BUFFERED (module doc)."""


def _request_body_override(request_mode: str, response_mode: str) -> dict[str, Any]:
    """A route's ext_proc override: the filter's modes with the request body ``request_mode``
    (a per-route ``processing_mode`` replaces the whole mode)."""
    mode = _mode(request_mode, response_mode)
    return {
        "envoy.filters.http.ext_proc": {
            "@type": _T + "filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {"processing_mode": mode},
        }
    }


def _twins(
    routes: list[dict[str, Any]], sizes: list[dict[str, Any]], per_route: dict[str, Any], kind: str
) -> list[dict[str, Any]]:
    """``routes``' twins for the request sizes ``sizes`` (``content-length`` header matchers, one
    twin set each): the same match and action plus the size, with the ext_proc override
    ``per_route``, named ``ORIGINAL:kind``. Envoy reads the per-route ext_proc config when the request headers arrive,
    before the picker has set the destination, so the last twin drops the destination-header
    condition: a body of that size always matches some twin before the pick. After the pick
    (``clear_route_cache``) the twins route exactly as their originals."""
    twins = []
    for size in sizes:
        for i, r in enumerate(routes):
            headers = [h for h in r["match"].get("headers", []) if i < len(routes) - 1 or h["name"] != DEST]
            match = dict(r["match"], headers=[*headers, size])
            twins.append(
                {
                    "name": f"{r['name']}:{kind}",
                    "match": match,
                    "route": copy.deepcopy(r["route"]),
                    "typed_per_filter_config": copy.deepcopy(per_route),
                }
            )
    return twins


def _sized_routes(
    routes: list[dict[str, Any]],
    stream_over: int,
    response_mode: str,
) -> list[dict[str, Any]]:
    """``routes`` (whose requests keep the filter's BUFFERED body) preceded by twins that change
    the request body mode by size (module doc): a ``content-length`` of at least ``stream_over``,
    or none (a chunked body of unknown size), FULL_DUPLEX_STREAMED. 0 turns them off."""
    out = []
    if stream_over > 0:
        large = [
            {"name": "content-length", "range_match": {"start": stream_over, "end": INT64_MAX}},
            {"name": "content-length", "present_match": False},
        ]
        out += _twins(
            routes,
            large,
            _request_body_override("FULL_DUPLEX_STREAMED", response_mode) | _no_body_buffer(),
            STREAMED_ROUTE,
        )
    return [*out, *routes]


REQUEST_TIMEOUT = "30s"
"""``--request-timeout``: the whole request (headers and body) must arrive within this, or Envoy
answers a JSON 408 (module doc, "Slow clients")."""
MAX_CONNECTIONS = 50_000
"""``--max-connections``: open downstream connections, all listeners together (the overload
manager's ``global_downstream_max_connections`` monitor); past it a new one is closed at accept."""
PICKER_STREAMS = 4096
"""``--picker-streams``: concurrent ext_proc streams this Envoy opens to the pickers (the picker
cluster's circuit breaker; Envoy's default is 1,024). The picker's own cap, ``--max-concurrent-streams``,
is the same 4,096 by default."""
H2_MAX_STREAMS = 100
"""Concurrent streams a client may open on one HTTP/2 connection (Envoy's edge guidance)."""
BUFFER_FILTER = "envoy.filters.http.buffer"


STREAMED_PICKER = "kvpick_picker_streamed"


def _stream_cap(streams: int) -> dict[str, Any]:
    return {"thresholds": [{"max_requests": streams, "max_pending_requests": streams}]}


def _streamed_picker_cluster(
    picker: dict[str, Any], ext_proc: dict[str, Any], routes: list[dict[str, Any]], streams: int
) -> dict[str, Any]:
    """The streamed routes' own picker cluster: the same pickers, health checks and transport, with
    its own cap of ``streams``. A streamed body (chunked, or 1 MiB and more) holds its picker stream
    while it arrives; slow ones fill this cap, never the one the BUFFERED routes' requests use.
    Points the streamed routes' ext_proc override (in ``routes``) at it."""
    cluster = copy.deepcopy(picker)
    cluster["name"] = cluster["load_assignment"]["cluster_name"] = STREAMED_PICKER
    cluster["circuit_breakers"] = _stream_cap(streams)
    service = copy.deepcopy(ext_proc["typed_config"]["grpc_service"])
    service["envoy_grpc"]["cluster_name"] = STREAMED_PICKER
    for route in routes:
        if route["name"].endswith(":" + STREAMED_ROUTE):
            overrides = route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
            overrides["grpc_service"] = copy.deepcopy(service)
    return cluster


def _body_buffer(max_bytes: int) -> dict[str, Any]:
    """The buffer filter, before ext_proc on BUFFERED routes: Envoy holds the body until it is
    whole (past ``max_bytes``: 413), and only then does ext_proc open the request's picker stream.
    A client trickling its body holds a connection and its buffer, never a picker stream."""
    return {
        "name": BUFFER_FILTER,
        "typed_config": {"@type": _T + "filters.http.buffer.v3.Buffer", "max_request_bytes": max_bytes},
    }


def _no_body_buffer() -> dict[str, Any]:
    """A route's override that turns the buffer filter off (streamed bodies, the 404 route)."""
    return {BUFFER_FILTER: {"@type": _T + "filters.http.buffer.v3.BufferPerRoute", "disabled": True}}


def _slow_request_reply() -> dict[str, Any]:
    """Envoy's 408 (the request timeout fired before the request was whole) as JSON."""
    return _json_reply(408, "request_timeout", "request not received in time", "kvpick.slow_request")


def _overload_manager(max_connections: int, max_heap_bytes: int) -> dict[str, Any]:
    """The overload manager: at most ``max_connections`` downstream connections (the admin
    listener exempt); with ``max_heap_bytes`` (the container's memory limit, say), Envoy shrinks
    its heap at 95% of it and answers new requests 503 at 98% (Envoy's edge guidance)."""
    monitors: list[dict[str, Any]] = [
        {
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": _T + "resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": max_connections,
            },
        }
    ]
    actions: list[dict[str, Any]] = []
    if max_heap_bytes > 0:
        heap = "envoy.resource_monitors.fixed_heap"
        monitors.append(
            {
                "name": heap,
                "typed_config": {
                    "@type": _T + "resource_monitors.fixed_heap.v3.FixedHeapConfig",
                    "max_heap_size_bytes": max_heap_bytes,
                },
            }
        )
        for action, value in (("shrink_heap", 0.95), ("stop_accepting_requests", 0.98)):
            actions.append(
                {
                    "name": f"envoy.overload_actions.{action}",
                    "triggers": [{"name": heap, "threshold": {"value": value}}],
                }
            )
    return {"refresh_interval": "0.25s", "resource_monitors": monitors, "actions": actions}


def _too_large_reply(max_body_bytes: int) -> dict[str, Any]:
    """Envoy's own 413 (a BUFFERED body past the listener's buffer limit) in the picker's JSON error
    format, so a client sees one error shape whichever of the two refused the body."""
    return _json_reply(
        413, "request_too_large", f"request body exceeds {max_body_bytes} bytes", "kvpick.too_large"
    )


_EXT_PROC_FIELDS = (
    "request_header_latency_us",
    "request_body_call_count",
    "request_body_total_latency_us",
    "response_header_latency_us",
)
"""The ext_proc filter state's per-call timings the access log carries (Envoy's ext_proc docs,
"Access Log Fields")."""
_EXT_PROC_STATUSES = (
    "request_header_call_status",
    "request_body_last_call_status",
    "response_header_call_status",
)
"""The gRPC status of those calls (0 OK; 4 a message timeout; 14 the picker unreachable): which
side of a failed request gave up, beside ``%RESPONSE_FLAGS%`` and ``%RESPONSE_CODE_DETAILS%``."""
_SPANS = {
    "rx_end_us": "DS_RX_END",
    "upstream_tx_us": "US_TX_BEG",
    "upstream_rx_us": "US_RX_BEG",
    "downstream_tx_us": "DS_TX_BEG",
}
"""Access-log key -> the point in the stream whose time after the first byte from the client
(``DS_RX_BEG``) it records, in microseconds."""


def access_log_format() -> dict[str, str]:
    """The access log's JSON line (module doc): ``x-request-id``, the start time (Unix seconds),
    the status with Envoy's response flags and code details (which component answered it: a
    local reply, an upstream reset, the ext_proc filter), the host that served, and the timings."""
    fmt = {
        "id": "%REQ(X-REQUEST-ID)%",
        "start": "%START_TIME(%s.%6f)%",
        "status": "%RESPONSE_CODE%",
        "flags": "%RESPONSE_FLAGS%",
        "details": "%RESPONSE_CODE_DETAILS%",
        "upstream": "%UPSTREAM_HOST%",
        "upstream_failure": "%UPSTREAM_TRANSPORT_FAILURE_REASON%",
        "route": "%ROUTE_NAME%",
        "duration_ms": "%DURATION%",
    }
    fmt |= {k: f"%COMMON_DURATION(DS_RX_BEG:{point}:us)%" for k, point in _SPANS.items()}
    fmt |= {
        f"ext_proc_{f}": f"%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:{f})%"
        for f in (*_EXT_PROC_FIELDS, *_EXT_PROC_STATUSES)
    }
    return fmt


def _access_log(path: str) -> list[dict[str, Any]]:
    return [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": _T + "access_loggers.file.v3.FileAccessLog",
                "path": path,
                "log_format": {"json_format": access_log_format()},
            },
        }
    ]


def _hcm(
    routes: list[dict[str, Any]],
    ext_proc: dict[str, Any],
    idle: str,
    served: list[dict[str, Any]],
    max_body_bytes: int = MAX_BODY,
    objective_header: str = "pass",
    access_log: str = "",
    preserve_request_id: bool = False,
    max_request_headers: int = MAX_REQUEST_HEADERS,
    request_timeout: str = REQUEST_TIMEOUT,
    body_buffer: int = 0,
) -> dict[str, Any]:
    """The connection manager; ``body_buffer`` > 0 puts the buffer filter (that many bytes) before ext_proc."""
    local_reply = {
        "mappers": [_too_large_reply(max_body_bytes), _too_many_headers_reply(), _slow_request_reply()]
    }
    hcm: dict[str, Any] = {
        "@type": _T + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "kvpick",
        "codec_type": "AUTO",
        "use_remote_address": True,
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "early_header_mutation_extensions": _strip_headers(objective_header),
        "stream_idle_timeout": idle,
        "request_headers_timeout": "10s",
        "request_timeout": request_timeout,
        "http2_protocol_options": {
            "max_concurrent_streams": H2_MAX_STREAMS,
            "initial_stream_window_size": 65536,
            "initial_connection_window_size": 1048576,
        },
        "common_http_protocol_options": {
            "idle_timeout": "300s",
            "max_headers_count": max(ENVOY_MAX_HEADERS, 2 * max_request_headers),
        },
        "max_request_headers_kb": ENVOY_MAX_HEADERS_KB,
        "local_reply_config": local_reply,
        "route_config": {
            "name": "kvpick",
            "virtual_hosts": [{"name": "kvpick", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [
            _header_count_check(max_request_headers),
            *([_body_buffer(body_buffer)] if body_buffer else []),
            ext_proc,
            *served,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": _T + "filters.http.router.v3.Router",
                    "suppress_envoy_headers": True,
                },
            },
        ],
    }
    if access_log:
        hcm["access_log"] = _access_log(access_log)
    if preserve_request_id:
        hcm["preserve_external_request_id"] = True
    return hcm


def _check(
    failure_open: bool,
    body_mode: str,
    response_body_mode: str,
    upstream: str,
    endpoints: list[str] | None,
    fallback: list[str] | None,
    stream_bodies_over: int = 0,
) -> None:
    """Refuse the combinations that render a config which cannot work (ValueError says which)."""
    if response_body_mode == "BUFFERED":
        raise ValueError("a BUFFERED response body would hold SSE streams until generation ends")
    if failure_open and body_mode == "FULL_DUPLEX_STREAMED":
        raise ValueError("fail-open needs BUFFERED request bodies (FULL_DUPLEX_STREAMED 500s, picker down)")
    if failure_open and stream_bodies_over > 0:
        raise ValueError("fail-open cannot stream large bodies: with the picker down they would fail (500)")
    if failure_open and upstream == "original-dst" and not fallback:
        raise ValueError("fail-open with ORIGINAL_DST needs --fallback: without the header there is no host")
    if upstream == "pool" and not endpoints:
        raise ValueError("--upstream pool needs --endpoints")


def render(
    listen_port: int = 8080,
    picker: str = "127.0.0.1:9002",
    tls: bool = True,
    failure_open: bool = False,
    body_mode: str = "BUFFERED",
    upstream: str = "original-dst",
    endpoints: list[str] | None = None,
    admin_port: int = 9901,
    retries: int = 2,
    response_body_mode: str = "NONE",
    fallback: list[str] | None = None,
    stream_idle_timeout: str = "300s",
    max_body_bytes: int = MAX_BODY,
    picker_health_interval: str = "0.5s",
    objective_header: str = "pass",
    stream_bodies_over: int | None = None,
    access_log: str = "",
    preserve_request_id: bool = False,
    listen_address: str = "0.0.0.0",
    allowed_paths: list[str] | tuple[str, ...] | None = INFERENCE_PATHS,
    max_request_headers: int = MAX_REQUEST_HEADERS,
    client_cert_dir: str = "",
    request_timeout: str = REQUEST_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    picker_streams: int = PICKER_STREAMS,
    max_heap_bytes: int = 0,
    message_timeout: str = MESSAGE_TIMEOUT,
    max_message_timeout: str = MAX_MESSAGE_TIMEOUT,
) -> dict[str, Any]:
    """The whole Envoy bootstrap. ``body_mode`` is the request body's; ``picker`` is one or more
    comma-separated ext_proc addresses; see the module doc."""
    pickers = _split(picker)
    picker = pickers[0]  # the ext_proc stream's :authority
    if stream_bodies_over is None:  # fail-open cannot stream a body (module doc)
        stream_bodies_over = 0 if failure_open else STREAM_BODIES_OVER
    _check(
        failure_open,
        body_mode,
        response_body_mode,
        upstream,
        endpoints,
        fallback,
        stream_bodies_over,
    )
    routes = _routes(upstream, retries, stream_idle_timeout, (fallback or []) if failure_open else [])
    if body_mode == "BUFFERED":
        routes = _sized_routes(routes, stream_bodies_over, response_body_mode)
    buffered = 0  # the largest body Envoy holds whole (BUFFERED routes)
    if body_mode == "BUFFERED":
        buffered = min(stream_bodies_over, max_body_bytes) if stream_bodies_over > 0 else max_body_bytes
    if allowed_paths:
        bad = [p for p in allowed_paths if not PATH_CHARS.match(p)]
        if bad:
            raise ValueError(f"--allowed-paths: not a plain absolute path: {bad}")
        not_found = _not_found_route(allowed_paths)
        if buffered:  # answered at the headers, whatever the body does
            not_found["typed_per_filter_config"] |= _no_body_buffer()
        routes = [not_found, *routes]
    ext_proc = _ext_proc(
        picker, failure_open, body_mode, response_body_mode, message_timeout, max_message_timeout
    )
    listener: dict[str, Any] = {
        "name": "kvpick",
        "address": {"socket_address": {"address": listen_address, "port_value": listen_port}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": _hcm(
                            routes,
                            ext_proc,
                            stream_idle_timeout,
                            _report_served(),
                            max_body_bytes,
                            objective_header,
                            access_log,
                            preserve_request_id,
                            max_request_headers,
                            request_timeout,
                            buffered,
                        ),
                    }
                ]
            }
        ],
    }
    if buffered:  # a buffered body is held whole in Envoy: allow the largest one
        listener["per_connection_buffer_limit_bytes"] = buffered + 64 * 1024
    if client_cert_dir and not tls:
        raise ValueError("--client-cert-dir needs TLS to the picker (drop --plaintext)")
    clusters = [_picker_cluster(pickers, tls, picker_health_interval, client_cert_dir)]
    clusters[0]["circuit_breakers"] = _stream_cap(picker_streams)
    if any(r["name"].endswith(":" + STREAMED_ROUTE) for r in routes):
        clusters.append(_streamed_picker_cluster(clusters[0], ext_proc, routes, picker_streams // 4))
    clusters.append(_pool_cluster(endpoints or []) if upstream == "pool" else _original_dst_cluster())
    if failure_open and upstream == "original-dst":
        clusters.append(_fallback_cluster(fallback or []))
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}},
            "ignore_global_conn_limit": True,
        },
        "static_resources": {"listeners": [listener], "clusters": clusters},
        "overload_manager": _overload_manager(max_connections, max_heap_bytes),
    }


def _split(text: str) -> list[str]:
    return [e for e in text.split(",") if e]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen-port", type=int, default=8080)
    p.add_argument(
        "--listen-address",
        default="0.0.0.0",
        help="address of the listener (127.0.0.1: this machine only; make run's default)",
    )
    p.add_argument("--admin-port", type=int, default=9901, help="bound to 127.0.0.1")
    p.add_argument(
        "--picker",
        default="127.0.0.1:9002",
        help="picker ext_proc address host:port, or several comma-separated (one ext_proc cluster)",
    )
    p.add_argument(
        "--picker-health-interval",
        default="0.5s",
        help="how often each picker is gRPC-health-checked, traffic or not",
    )
    p.add_argument(
        "--plaintext", action="store_true", help="talk to the picker without TLS (--secure-serving=false)"
    )
    p.add_argument(
        "--client-cert-dir",
        default="",
        help="mTLS to the picker (its --client-ca-path): a directory holding tls.crt, tls.key (the "
        "certificate Envoy presents) and ca.crt (the CA the picker's certificate must chain to), as a "
        "mounted Kubernetes TLS Secret does; default: none (TLS without a client certificate)",
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
        help="request body: BUFFERED (default; needed for fail-open), or FULL_DUPLEX_STREAMED (GIE's)",
    )
    p.add_argument(
        "--response-body-mode",
        choices=["FULL_DUPLEX_STREAMED", "NONE"],
        default="NONE",
        help="response body: not sent to the picker (default), or streamed through it",
    )
    p.add_argument("--upstream", choices=["original-dst", "pool"], default="original-dst")
    p.add_argument("--endpoints", default="", help="ip:port,... (needed for --upstream pool)")
    p.add_argument(
        "--fallback",
        default="",
        help="host:port,... where fail-open sends requests with ORIGINAL_DST (e.g. the replicas' Service)",
    )
    p.add_argument("--stream-idle-timeout", default="300s", help="reset a stream idle this long")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY, help="the picker's --max-body-bytes")
    p.add_argument(
        "--objective-header",
        choices=OBJECTIVE_HEADER_MODES,
        default="pass",
        help="strip: drop the client's x-llm-d-inference-objective (and its alias "
        "x-gateway-inference-objective) before ext_proc (clients cannot "
        "claim a priority); pass: keep it (GIE's design: the client chooses its objective)",
    )
    p.add_argument(
        "--stream-bodies-over",
        type=int,
        default=None,
        help=f"with BUFFERED request bodies, stream (FULL_DUPLEX_STREAMED) those of at least this many "
        f"bytes, or of unknown size, to the picker; 0: buffer every body (default {STREAM_BODIES_OVER}; "
        "0 with fail-open, which cannot stream)",
    )
    p.add_argument(
        "--access-log",
        default="",
        help="write a JSON access log with per-request timings (Envoy's and ext_proc's) to this file "
        "(default: none)",
    )
    p.add_argument(
        "--preserve-request-id",
        action="store_true",
        help="keep the client's x-request-id instead of generating one (default: Envoy generates it)",
    )
    p.add_argument(
        "--max-request-headers",
        type=int,
        default=MAX_REQUEST_HEADERS,
        help="a request with more headers than this (as Envoy holds it, its own additions included) "
        f"gets a JSON 431 (as do {MAX_REQUEST_HEADERS_KB} KiB of headers); Envoy's own limits are "
        f"{ENVOY_MAX_HEADERS} headers and {ENVOY_MAX_HEADERS_KB} KiB, room for the picker's",
    )
    p.add_argument(
        "--allowed-paths",
        default=",".join(INFERENCE_PATHS),
        help="comma-separated paths routed to the model servers (each with its sub-paths); any other "
        "path gets a JSON 404 from Envoy and never reaches a replica (a replica's /metrics, /tokenize, "
        "/reset_prefix_cache, ...). Empty: route every path",
    )
    p.add_argument(
        "--request-timeout",
        default=REQUEST_TIMEOUT,
        help="the whole request (headers and body) must arrive within this, else a JSON 408; "
        "the response is not limited by it (default %(default)s)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="open client connections Envoy accepts (the overload manager; default %(default)s)",
    )
    p.add_argument(
        "--picker-streams",
        type=int,
        default=PICKER_STREAMS,
        help="concurrent ext_proc streams to the pickers, one per request in flight (default "
        "%(default)s, the picker's --max-concurrent-streams); past it a request fails",
    )
    p.add_argument(
        "--max-heap-bytes",
        type=int,
        default=0,
        help="Envoy's memory limit: shrink the heap at 95%% of it, refuse new requests (503) at 98%% "
        "(default 0: no heap monitor)",
    )
    p.add_argument(
        "--message-timeout",
        default=MESSAGE_TIMEOUT,
        help="ext_proc's per-message timeout (the picker answers each message in well under it)",
    )
    p.add_argument(
        "--max-message-timeout",
        default=MAX_MESSAGE_TIMEOUT,
        help="the longest timeout the picker may extend it to while it holds a request (flow control)",
    )
    p.add_argument("-o", "--output", default="-")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    failure_open = a.failure_mode == "open"
    body_mode = a.body_mode or "BUFFERED"
    try:
        doc = render(
            a.listen_port,
            a.picker,
            not a.plaintext,
            failure_open,
            body_mode,
            a.upstream,
            _split(a.endpoints),
            a.admin_port,
            response_body_mode=a.response_body_mode,
            fallback=_split(a.fallback),
            stream_idle_timeout=a.stream_idle_timeout,
            max_body_bytes=a.max_body_bytes,
            picker_health_interval=a.picker_health_interval,
            objective_header=a.objective_header,
            stream_bodies_over=a.stream_bodies_over,
            access_log=a.access_log,
            preserve_request_id=a.preserve_request_id,
            listen_address=a.listen_address,
            allowed_paths=_split(a.allowed_paths),
            max_request_headers=a.max_request_headers,
            client_cert_dir=a.client_cert_dir,
            request_timeout=a.request_timeout,
            max_connections=a.max_connections,
            picker_streams=a.picker_streams,
            max_heap_bytes=a.max_heap_bytes,
            message_timeout=a.message_timeout,
            max_message_timeout=a.max_message_timeout,
        )
    except ValueError as err:
        parser().error(str(err))
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

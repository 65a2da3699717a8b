"""Envoy ``ext_proc`` protocol for the GIE endpoint-picker contract (DESIGN §3). Protocol only:
what to route is decided by :class:`~picker.core.router.Router`; this module turns Envoy messages into
calls on it and its answers into Envoy messages.

Message order per HTTP request (one gRPC stream):
- ``FULL_DUPLEX_STREAMED`` request body: answer nothing until the body's end-of-stream, then send
  the request-headers response (destination header, ``envoy.lb`` metadata, ``clear_route_cache``)
  followed by the body as ``StreamedBodyResponse`` chunks of at most ``MAX_CHUNK`` bytes.
- ``BUFFERED`` request body: answer the headers at once (no mutation), then answer the whole body
  with a ``BodyResponse`` carrying the mutation.
- One trip: a ``STREAMED`` request body that Envoy sends without waiting for the headers' answer
  (``send_body_without_waiting_for_header_response``, announced in ``protocol_config``): answer
  nothing until the body is whole (its end-of-stream, or its declared ``content-length``), then
  the request-headers response (destination header, ``envoy.lb`` metadata,
  ``clear_route_cache``) and one ``BodyResponse`` per chunk received (Envoy holds each chunk until
  then; an unchanged body passes as it is). Envoy continues the headers, and so chooses the route
  and host, only once that answer has come. A chunk after the pick (HTTP/1.1's empty
  end-of-stream chunk after a body of the declared length) is answered as it comes.
- Response headers, body and trailers are answered in order as they arrive; in full-duplex mode
  the response body is echoed back chunk by chunk (SSE passes through unchanged).
- Response headers are asked for only where the picker uses them (``skip_response_headers``; not
  in one-trip mode, where Envoy ignores every ``mode_override`` and the config decides):
  with no response body and no fallbacks (under ORIGINAL_DST the primary is the only host that can
  serve, so there is nothing to re-credit), the request-headers response carries a
  ``mode_override`` (Envoy's ``allow_mode_override``) that SKIPs response headers and trailers for
  this request. That saves a message each way per request. The ext_proc stream still ends with the
  HTTP stream (Envoy closes it when the filter is destroyed), which ends the accounting; what is
  lost is the response status in the ``kvpick_requests_total`` decision label.

:class:`~picker.core.errors.PickerError` is translated here, and only here, into an
``ImmediateResponse`` with a JSON error body. Any other exception is logged with its traceback and
becomes an :class:`~picker.core.errors.InternalError` (500) at the same boundary.

When the client sent no ``x-request-id``, the one generated for it is set on the upstream request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from picker.core import request as request_mod
from picker.core.accounting import Ticket
from picker.core.endpoints.types import Endpoint
from picker.core.errors import BodyTooLarge, InternalError, PickerError
from picker.core.request import Parsed
from picker.core.router import Router
from picker.serving.errors import CONTENT_TYPE
from picker.serving.errors import encode as encode_error
from picker.serving.offload import BodyParser
from picker.serving.telemetry import Telemetry

log = logging.getLogger(__name__)

DEST_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
MAX_CHUNK = 62_000
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
NO_BODY = processing_mode_pb2.ProcessingMode.NONE
REQUEST_ID = "x-request-id"
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
RESPONSE_HEADERS = ("when-needed", "always")
"""``--response-headers``: skip them per request where the picker has no use for them, or not."""
MESSAGE_KINDS = (
    "request_headers",
    "request_body",
    "request_trailers",
    "response_headers",
    "response_body",
    "response_trailers",
)


def _without_response_headers(request_body_mode: int) -> processing_mode_pb2.ProcessingMode:
    """The processing mode that keeps the request side as the shipped configs set it and sends
    nothing of the response (headers, body, trailers) to the picker."""
    pm = processing_mode_pb2.ProcessingMode
    return pm(
        request_header_mode=pm.SEND,
        response_header_mode=pm.SKIP,
        request_body_mode=request_body_mode,
        response_body_mode=pm.NONE,
        request_trailer_mode=pm.SEND,
        response_trailer_mode=pm.SKIP,
    )


STATUS_LINGER_S = 2.0
"""How long a finished ext_proc stream waits for Envoy's reset before sending its status
(:meth:`ExtProcService.Process`)."""
EMPTY_LAST_CHUNK = pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True))
"""What :meth:`ExtProcService._offload` passes on once it has buffered a body's last chunk itself
(in one-trip mode, the chunk that completes the declared length)."""
EMPTY_CHUNK = pb.ProcessingRequest(request_body=pb.HttpBody())
"""What :meth:`ExtProcService._offload` passes on for a one-trip chunk it has buffered itself."""
SKIP_RESPONSE = {mode: _without_response_headers(mode) for mode in (FULL_DUPLEX, BUFFERED, STREAMED, NO_BODY)}
"""Built once: ``mode_override`` per request body mode."""


def _headers_ack(skip_mode: processing_mode_pb2.ProcessingMode | None) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
    if skip_mode is not None:
        resp.mode_override.CopyFrom(skip_mode)
    return resp


HEADERS_ACK = {False: _headers_ack(None), True: _headers_ack(SKIP_RESPONSE[BUFFERED])}
"""Built once, never modified (sent as they are, by many streams): the BUFFERED answer to the
request headers, which changes nothing, keyed by whether it skips the response path."""
BODY_ACK = pb.ProcessingResponse(request_body=pb.BodyResponse())
BODY_CLEAR = pb.ProcessingResponse(
    request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(clear_body=True)))
)
TRAILERS_ACK = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
RESPONSE_HEADERS_ACK = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
RESPONSE_BODY_ACK = pb.ProcessingResponse(response_body=pb.BodyResponse())
RESPONSE_TRAILERS_ACK = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=OVERWRITE
    )


def _headers_map(msg: pb.HttpHeaders) -> dict[str, str]:
    return {
        h.key.lower(): (raw.decode("utf-8", "replace") if (raw := h.raw_value) else h.value)
        for h in msg.headers.headers
    }


def _lb_value(msg: pb.ProcessingRequest, namespace: str, key: str) -> struct_pb2.Value | None:
    """``metadata_context.filter_metadata[namespace][key]``, or None where Envoy set none."""
    fm = msg.metadata_context.filter_metadata
    if namespace not in fm:
        return None
    fields = fm[namespace].fields
    return fields.get(key)


def subset_hint(msg: pb.ProcessingRequest) -> frozenset[str] | None:
    """The gateway's subset (endpoint keys), or None when it sent no hint. A list of strings,
    or one comma-separated string, both normalised to endpoint keys; an entry that is not
    ``ip:port`` is dropped (it names nothing we could pick)."""
    value = _lb_value(msg, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        raw = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        raw = value.string_value.split(",")
    else:
        raw = []
    return frozenset(k for k in map(endpoint_key, raw) if k)


def served_endpoint(msg: pb.ProcessingRequest) -> str | None:
    """The endpoint Envoy says served the request (response path), as an endpoint key."""
    value = _lb_value(msg, LB_NAMESPACE, SERVED_KEY)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return endpoint_key(value.string_value) or None


def endpoint_key(hostport: str) -> str:
    """``hostport`` as :attr:`Endpoint.key` spells it, or "" when it is not ``ip:port``."""
    try:
        return Endpoint.parse(hostport).key
    except ValueError:
        return ""


def immediate(err: PickerError) -> pb.ProcessingResponse:
    e = encode_error(err)
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=e.status),
            headers=pb.HeaderMutation(set_headers=[_header("content-type", CONTENT_TYPE)]),
            body=e.body,
            details=e.details,
        )
    )


def body_chunks(
    body: bytes | Sequence[bytes], kind: str, eos: bool = True
) -> Iterator[pb.ProcessingResponse]:
    """``body`` (one buffer, or the chunks it arrived in) as StreamedBodyResponse messages of at
    most MAX_CHUNK bytes; the last carries ``end_of_stream=eos`` (false when trailers end the
    stream instead). Chunks that already fit are sent as they are (no join, no re-slicing);
    messages are made one at a time, as the caller sends them."""
    parts = [body] if isinstance(body, bytes) else body
    pieces = [
        (part, start, min(len(part), start + MAX_CHUNK))
        for part in parts
        for start in (range(0, len(part), MAX_CHUNK) if len(part) > MAX_CHUNK else (0,))
        if part
    ] or [(b"", 0, 0)]
    last = len(pieces) - 1
    for i, (part, start, end) in enumerate(pieces):
        data = part if end - start == len(part) else bytes(memoryview(part)[start:end])
        streamed = pb.StreamedBodyResponse(body=data, end_of_stream=i == last and eos)
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        yield pb.ProcessingResponse(**{kind: pb.BodyResponse(response=common)})


ONE_TRIP_KEY = "one-trip:"
""":class:`BodyAnswers` key prefix of a one-trip headers answer (a destination never has it)."""


class BodyAnswers:
    """The answer to a BUFFERED body that leaves it unchanged and sends the client's own
    ``x-request-id`` depends on the destination alone (its header mutation and ``envoy.lb``
    metadata): built once per destination, then sent as it is by every stream that picks it
    (building one costs more than the rest of the handler's protocol work). The same holds for
    a one-trip body's headers answer, kept under ``ONE_TRIP_KEY`` + destination. Never modified once
    stored. Bounded: cleared when it holds ``limit`` destinations (there are as many as endpoints,
    times their orders where fallbacks are sent). Writer: the event loop, through :class:`Exchange`."""

    def __init__(self, limit: int = 4096) -> None:
        assert limit >= 1, f"limit must be positive, got {limit}"
        self.limit = limit
        self._by_destination: dict[str, pb.ProcessingResponse] = {}

    def get(self, destination: str, build: Callable[[], pb.ProcessingResponse]) -> pb.ProcessingResponse:
        answer = self._by_destination.get(destination)
        if answer is None:
            if len(self._by_destination) >= self.limit:
                self._by_destination.clear()
            answer = self._by_destination[destination] = build()
        return answer

    def __len__(self) -> int:
        return len(self._by_destination)


def _chunk_answers(n: int, new_body: bytes | None) -> list[pb.ProcessingResponse]:
    """One answer per STREAMED body chunk Envoy holds (``n`` of them): each passes its chunk on
    unchanged; a rewritten body replaces the first chunk and clears the others."""
    if new_body is None:
        return [BODY_ACK] * n
    first = pb.CommonResponse(body_mutation=pb.BodyMutation(body=new_body))
    return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=first)), *[BODY_CLEAR] * (n - 1)]


@dataclass
class Exchange:
    """State of one HTTP request's exchange. Protocol state only; lifecycle is the ticket's."""

    router: Router
    telemetry: Telemetry | None
    max_body: int
    request_mode: int
    response_mode: int
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    picked: bool = False
    ticket: Ticket | None = None
    chosen: list[str] = field(default_factory=list)
    """Endpoint keys, primary first."""
    decision_label: str = "none"
    request_id: str = ""
    """The client's ``x-request-id``, or the one generated for it at the pick."""
    subset: frozenset[str] | None = None
    """The gateway's subset hint (endpoint keys), None when it sent none."""
    measurable: bool = False
    """The response is a 2xx event stream: its first byte times the prefill (a cross-check)."""
    parsed: Parsed | None = None
    """The body's parse, when it was made off the event loop before the pick."""
    skip_response_headers: bool = False
    """Ask Envoy (``mode_override``) not to send the response path, where the modes allow it."""
    body_answers: BodyAnswers | None = None
    """The service's shared answers to unchanged BUFFERED bodies (None: built per request)."""
    one_trip: bool = False
    """STREAMED request body sent without waiting for the headers' answer (Envoy's
    ``send_body_without_waiting_for_header_response``): the headers are answered with the
    destination once the whole body is in, followed by one answer per body chunk received."""
    unanswered: int = 0
    """Body chunks received in one-trip mode and not yet answered (Envoy holds each until then)."""
    declared: int = -1
    """The request's ``content-length`` (-1: none). In one-trip mode the body is whole once this
    many bytes arrived, even if its end-of-stream comes with trailers instead."""

    # -- request path -------------------------------------------------------------------------
    def on_request_headers(
        self,
        msg: pb.HttpHeaders,
        cfg: pb.ProtocolConfiguration | None,
        subset: frozenset[str] | None = None,
    ) -> list[pb.ProcessingResponse]:
        self.subset = subset
        if cfg is not None:
            # Envoy sets protocol_config (presence-tracked) on the first message only, with its
            # configured modes; there NONE (0) is a real mode: no body message will follow.
            self.request_mode, self.response_mode = cfg.request_body_mode, cfg.response_body_mode
            if cfg.send_body_without_waiting_for_header_response:
                # Envoy ignores a mode_override then (for every request of the filter); the
                # rendered config skips the response path itself where it can (render.py).
                self.skip_response_headers = False
                self.one_trip = cfg.request_body_mode == STREAMED
        self.headers = _headers_map(msg)
        self.skip_response_headers = self.skip_response_headers and self.response_mode == NO_BODY
        if msg.end_of_stream or self.request_mode == NO_BODY:
            # Bodiless (GET /v1/models), or a body Envoy will not send: any ready endpoint.
            self._pick(())
            return [self._override(self._headers_response(body_len=None))]
        if self.request_mode == FULL_DUPLEX:
            return []  # answered once the body's end-of-stream arrives
        if self.one_trip:
            length = self.headers.get("content-length", "")
            self.declared = int(length) if length.isdigit() else -1
            return []  # answered with the destination once the body is in
        return [HEADERS_ACK[self.skip_response_headers and self.request_mode == BUFFERED]]

    def _override(self, resp: pb.ProcessingResponse) -> pb.ProcessingResponse:
        """``resp`` (the request-headers response: Envoy honours a mode override only there),
        with response headers skipped where :attr:`skip_response_headers` says so."""
        mode = SKIP_RESPONSE.get(self.request_mode) if self.skip_response_headers else None
        if mode is not None:
            resp.mode_override.CopyFrom(mode)
        return resp

    def absorb(self, body: bytes) -> None:
        """Buffer a request body chunk (413 past ``max_body``). Takes the bytes, not the message:
        each read of ``HttpBody.body`` copies the whole chunk into a new ``bytes``."""
        if body:
            self.size += len(body)
            if self.size > self.max_body:
                raise BodyTooLarge(f"request body exceeds {self.max_body} bytes")
            self.chunks.append(body)

    def on_request_body(self, msg: pb.HttpBody) -> Iterable[pb.ProcessingResponse]:
        self.absorb(msg.body)
        if self.one_trip:
            if self.picked:  # the empty end-of-stream chunk after a body of the declared length
                return [BODY_ACK]
            self.unanswered += 1
            if msg.end_of_stream or self.size == self.declared:
                return self._finish_request_body()
            return []
        if not msg.end_of_stream:
            if self.request_mode == FULL_DUPLEX or self.request_mode == BUFFERED:
                return []
            return [BODY_ACK]  # STREAMED: ack each chunk
        return self._finish_request_body()

    def on_request_trailers(self) -> Iterable[pb.ProcessingResponse]:
        out = () if self.picked else self._finish_request_body(eos=False)
        return itertools.chain(out, (TRAILERS_ACK,))

    def _finish_request_body(self, eos: bool = True) -> Iterable[pb.ProcessingResponse]:
        """Pick, then answer: full duplex, the headers response and the body streamed back
        lazily (the caller sends each message before the next is made); buffered, one body
        response carrying the mutation."""
        chunks, self.chunks = self.chunks, []
        new_body = self._pick(chunks)
        if self.request_mode == FULL_DUPLEX:
            head = self._override(self._headers_response(len(new_body) if new_body is not None else None))
            out = new_body if new_body is not None else chunks
            return itertools.chain((head,), body_chunks(out, "request_body", eos))
        unchanged = new_body is None and self.request_id == self.headers.get(REQUEST_ID)
        shared = self.body_answers if unchanged else None  # the answer depends on the destination alone
        if self.one_trip:
            n, self.unanswered = self.unanswered, 0
            if shared is not None:
                head = shared.get(ONE_TRIP_KEY + self.destination, self._headers_response)
            else:
                head = self._headers_response(len(new_body) if new_body is not None else None)
            return [head, *_chunk_answers(n, new_body)]
        if shared is not None:
            return [shared.get(self.destination, self._body_answer)]
        return [self._body_answer(new_body)]

    def _body_answer(self, new_body: bytes | None = None) -> pb.ProcessingResponse:
        """The BUFFERED body's answer: the mutation, and the body where it was rewritten."""
        common = self._mutation(body_len=len(new_body) if new_body is not None else None)
        if new_body is not None:
            common.body_mutation.body = new_body
        return pb.ProcessingResponse(
            request_body=pb.BodyResponse(response=common), dynamic_metadata=self._metadata()
        )

    def _pick(self, chunks: Sequence[bytes]) -> bytes | None:
        """Parse (unless done off the loop), route and start accounting. Returns a rewritten
        body, or None if unchanged. A bodiless request skips scheduling: any ready endpoint, no
        index or accounting."""
        self.picked = True
        if not any(chunks):
            self.request_id = request_mod.request_id_of(self.headers)
            self.chosen = [self.router.any_ready(self.subset).key]
            self.decision_label = "bodiless"
            return None
        if self.parsed is None:
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            path = self.headers.get(":path", "")
            self.parsed = request_mod.parse_and_rewrite(body, path, self.headers, self.router.parse_options)
        req, new_body, doc = self.parsed
        if doc is not None:
            req = self.router.tokenize(req, doc, self.headers.get(":path", ""))
        self.request_id = req.request_id
        decision = self.router.route(req, subset=self.subset)
        self.ticket = self.router.start(decision)
        self.chosen = [e.key for e in decision.chosen]
        self.decision_label = "prefix_hit" if decision.cycle.matches.get(self.chosen[0], 0) else "prefix_miss"
        if self.telemetry:
            self.telemetry.count_request(req.model, req.model)
        if self.telemetry and decision.cycle.n_blocks:
            self.telemetry.prefix_hit_ratio.observe(self.ticket.matched_blocks / decision.cycle.n_blocks)
        return new_body

    @property
    def destination(self) -> str:
        """The one value of both the destination header and the ``envoy.lb`` metadata (the
        protocol forbids two different values): primary first, then fallbacks, comma-separated."""
        return ",".join(self.chosen)

    def _mutation(self, body_len: int | None) -> pb.CommonResponse:
        hdrs = [_header(DEST_HEADER, self.destination)]
        if self.request_id != self.headers.get(REQUEST_ID):  # generated here: send it upstream
            hdrs.append(_header(REQUEST_ID, self.request_id))
        if body_len is not None:
            hdrs.append(_header("content-length", str(body_len)))
        return pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=hdrs), clear_route_cache=True)

    def _metadata(self) -> struct_pb2.Struct:
        """``{"envoy.lb": {DEST_HEADER: destination}}``, built directly (``Struct.update`` walks
        the dict in Python)."""
        lb = struct_pb2.Struct(fields={DEST_HEADER: struct_pb2.Value(string_value=self.destination)})
        return struct_pb2.Struct(fields={LB_NAMESPACE: struct_pb2.Value(struct_value=lb)})

    def _headers_response(self, body_len: int | None = None) -> pb.ProcessingResponse:
        common = self._mutation(body_len)
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=common), dynamic_metadata=self._metadata()
        )

    # -- response path ------------------------------------------------------------------------
    def on_response_headers(
        self, msg: pb.HttpHeaders, served: str | None = None
    ) -> list[pb.ProcessingResponse]:
        if served and self.ticket is not None:
            primary = bool(self.chosen) and served == self.chosen[0]
            if self.telemetry:
                (self.telemetry.served_primary if primary else self.telemetry.served_other).inc()
            if not primary and self.router.recredit(self.ticket, served):
                self.chosen = [served, *(k for k in self.chosen if k != served)]
        headers = _headers_map(msg)
        status = headers.get(":status", "")
        self.measurable = status.startswith("2") and headers.get("content-type", "").startswith(
            "text/event-stream"
        )
        self.decision_label = f"{self.decision_label}:{status[:1]}xx" if status else self.decision_label
        if msg.end_of_stream:
            self.close()
        return [RESPONSE_HEADERS_ACK]

    def on_response_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.ticket is not None:
            self.router.first_token(self.ticket, self.measurable)
        if msg.end_of_stream:
            self.close()
        if self.response_mode == FULL_DUPLEX:
            streamed = pb.StreamedBodyResponse(body=msg.body, end_of_stream=msg.end_of_stream)
            common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
            return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))]
        return [RESPONSE_BODY_ACK]

    def on_response_trailers(self) -> list[pb.ProcessingResponse]:
        self.close()
        return [RESPONSE_TRAILERS_ACK]

    def close(self, outcome: str = "ok") -> None:
        """End accounting (idempotent): end of stream, error, reset or client disconnect."""
        if self.ticket is not None and not self.ticket.done:
            self.router.finish(self.ticket)
            if self.telemetry:
                self.telemetry.requests.labels(self.decision_label, outcome).inc()


class ExtProcService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        router: Router,
        telemetry: Telemetry | None = None,
        default_mode: int = FULL_DUPLEX,
        parser: BodyParser | None = None,
        response_headers: str = "when-needed",
        max_streams: int = 0,
    ) -> None:
        assert response_headers in RESPONSE_HEADERS, f"response_headers {response_headers!r}"
        assert max_streams >= 0, f"max_streams must be >= 0, got {max_streams}"
        self.router = router
        self.telemetry = telemetry
        self.default_mode = default_mode
        self.parser = parser
        """Parses large bodies off the event loop; None parses every body inline."""
        self.skip_response_headers = response_headers == "when-needed" and router.cfg.fallbacks == 0
        """No fallbacks: the primary serves or nothing does, so the served endpoint tells nothing."""
        self.max_streams = max_streams
        """Cap on concurrent ext_proc streams (0: none). Counted here, not by the gRPC server,
        so health checks and Explain calls on the same port never take a stream's slot."""
        self.open_streams = 0
        """Ext_proc streams in progress; written only by :meth:`exchange`."""
        self._counted = {k: telemetry.extproc_messages.labels(k) for k in MESSAGE_KINDS} if telemetry else {}
        """Pre-bound counter children: one ``inc`` per message, no label lookup."""
        self.status_linger_s = STATUS_LINGER_S
        """How long a finished stream waits for Envoy's reset before it ends with a status."""
        self.body_answers = BodyAnswers()
        """Shared by every stream's :class:`Exchange`."""

    async def _offload(self, ex: Exchange, msg: pb.ProcessingRequest) -> pb.ProcessingRequest:
        """A body's last chunk is buffered here (its one copy out of the message: the last chunk
        of a BUFFERED body is the whole body) and the exchange finishes on an empty end-of-stream
        chunk; in one-trip mode every chunk is, and the one that completes the declared
        ``content-length`` is the last (its end-of-stream may follow in an empty chunk). Before that, work that must leave the event loop is done: a large body is parsed
        in the worker process; with a tokenizer (precise mode) the prompt is tokenized here when
        the body is under ``prefix.tokenize_inline_bytes`` and no other encode is running (a
        thread hop costs more than a short prompt), else in a thread (HF ``tokenizers`` releases
        the GIL); with none, by a replica's ``/tokenize`` (awaited, bounded). Other messages pass unchanged."""
        if msg.WhichOneof("request") != "request_body" or ex.picked:
            return msg
        chunk = msg.request_body
        if not (chunk.end_of_stream or ex.one_trip):
            return msg
        body = chunk.body  # one copy out of the message; the last chunk may be the whole body
        size = ex.size + len(body)
        if not chunk.end_of_stream and size != ex.declared:  # one trip: the body is not whole yet
            ex.absorb(body)
            return EMPTY_CHUNK
        offload = self.parser is not None and self.parser.offloads(size)
        tokenize = (
            self.router.tokenizer is not None or self.router.remote_tokenizer is not None
        ) and size > 0
        ex.absorb(body)
        if not (offload or tokenize):
            return EMPTY_LAST_CHUNK
        path = ex.headers.get(":path", "")
        if offload:
            assert self.parser is not None, "offload without a parser"
            ex.parsed = await self.parser.parse(ex.chunks, path, ex.headers, self.router.parse_options)
        else:
            body = ex.chunks[0] if len(ex.chunks) == 1 else b"".join(ex.chunks)
            ex.parsed = request_mod.parse_and_rewrite(body, path, ex.headers, self.router.parse_options)
        req, new_body, doc = ex.parsed
        if tokenize and doc is not None:
            if self.router.tokenizer is not None:
                short = size < self.router.cfg.prefix.tokenize_inline_bytes
                now = self.router.tokenize_now(req, doc, path) if short else None
                req = (
                    now if now is not None else await asyncio.to_thread(self.router.tokenize, req, doc, path)
                )
            else:
                req = await self.router.tokenize_remote(req, doc, path, ex.subset)
            ex.parsed = (req, new_body, doc)
        return EMPTY_LAST_CHUNK

    async def Process(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        """The gRPC handler, as a coroutine on grpc.aio's reader/writer API: each message is one
        ``context.read()`` and each answer one ``context.write()``. (An async-generator handler
        costs two more async-generator steps per message: grpc.aio's request iterator wraps
        ``read()`` in one and drains the handler's with another.)"""
        await self.exchange(context.read, context.write, context)
        # Envoy half-closes the stream and then resets it. Returning now would send the status
        # on a call about to be reset, and grpcio's aio server leaks that failed batch's op array
        # (about 80 bytes per stream; grpc/grpc#43360, unfixed in 1.85): the soak's RSS grew by
        # that per request. Waiting for the reset (a CancelledError here) sends no status at all;
        # a client that waits for the status instead gets it after status_linger_s.
        await asyncio.sleep(self.status_linger_s)

    async def answers(self, requests: AsyncIterable[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
        """One exchange over an in-process message source (tests, tools): every answer, in order."""
        source = aiter(requests)
        out: list[pb.ProcessingResponse] = []

        async def read() -> pb.ProcessingRequest | object:
            return await anext(source, grpc.aio.EOF)

        async def write(resp: pb.ProcessingResponse) -> None:
            out.append(resp)

        await self.exchange(read, write, None)
        return out

    async def exchange(
        self,
        read: Callable[[], Awaitable[pb.ProcessingRequest | object]],
        write: Callable[[pb.ProcessingResponse], Awaitable[None]],
        context: grpc.aio.ServicerContext | None,
    ) -> None:
        """One ext_proc stream: read messages until Envoy closes its side (``grpc.aio.EOF``),
        writing each answer as it is made. A :class:`PickerError` ends the stream with its
        ``ImmediateResponse``; the exchange's accounting ends here, however the stream ends."""
        if self.max_streams and self.open_streams >= self.max_streams:
            # Refused before a message is read: Envoy's failure mode applies to this request.
            assert context is not None, "a stream cap needs the gRPC context to refuse with"
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"over {self.max_streams} concurrent ext_proc streams"
            )
        ex = Exchange(
            self.router, self.telemetry, self.router.cfg.max_body_bytes, self.default_mode, self.default_mode
        )
        ex.skip_response_headers = self.skip_response_headers
        ex.body_answers = self.body_answers
        outcome = "aborted"
        self.open_streams += 1
        try:
            while (msg := await read()) is not grpc.aio.EOF:
                assert isinstance(msg, pb.ProcessingRequest), f"read() gave {type(msg).__name__}"
                try:
                    out = self._step(ex, await self._offload(ex, msg))
                except PickerError as err:
                    outcome = f"error_{err.status}"
                    if self.telemetry and ex.ticket is None:  # else counted by close()
                        self.telemetry.requests.labels("rejected", outcome).inc()
                    await write(immediate(err))
                    return
                for resp in out:
                    await write(resp)
            outcome = "ok"
        finally:
            self.open_streams -= 1
            ex.close(outcome)

    def _step(self, ex: Exchange, msg: pb.ProcessingRequest) -> Iterable[pb.ProcessingResponse]:
        """:meth:`_dispatch`, timing only the call that makes the pick (the e2e histogram holds
        one sample per picked request). Raises only :class:`PickerError`."""
        try:
            if self.telemetry is None or ex.picked:
                return self._dispatch(ex, msg)
            start = time.perf_counter()
            out = self._dispatch(ex, msg)
            if ex.picked:
                self.telemetry.e2e.observe(time.perf_counter() - start)
            return out
        except PickerError:
            raise
        except Exception as exc:
            rid = ex.request_id or ex.headers.get(REQUEST_ID, "-")
            log.exception(
                "ext_proc: unexpected error on %s (x-request-id %s)", msg.WhichOneof("request"), rid
            )
            raise InternalError("the endpoint picker failed to process the request") from exc

    def _dispatch(self, ex: Exchange, msg: pb.ProcessingRequest) -> Iterable[pb.ProcessingResponse]:
        kind = msg.WhichOneof("request")
        counter = self._counted.get(kind)
        if counter is not None:
            counter.inc()
        if kind == "request_headers":
            cfg = msg.protocol_config if msg.HasField("protocol_config") else None
            return ex.on_request_headers(msg.request_headers, cfg, subset_hint(msg))
        if kind == "request_body":
            return ex.on_request_body(msg.request_body)
        if kind == "request_trailers":
            return ex.on_request_trailers()
        if kind == "response_headers":
            return ex.on_response_headers(msg.response_headers, served_endpoint(msg))
        if kind == "response_body":
            return ex.on_response_body(msg.response_body)
        if kind == "response_trailers":
            return ex.on_response_trailers()
        log.warning("ignoring unknown ext_proc message %r", kind)
        return []

"""Envoy ``ext_proc`` protocol for the GIE endpoint-picker contract
(docs/design.md#the-endpoint-picker-protocol). Protocol only: each request's steps (parse,
tokenize, route, start, recredit, finish, telemetry) are the
:class:`~picker.serving.director.Director`'s; this module turns Envoy messages into calls on it
and its answers into Envoy messages. Each exchange's progress is one :class:`Phase`.

Message order per HTTP request (one gRPC stream):
- ``FULL_DUPLEX_STREAMED`` request body: answer nothing until the body's end-of-stream, then send
  the request-headers response (destination header, ``envoy.lb`` metadata, ``clear_route_cache``)
  followed by the body as ``StreamedBodyResponse`` chunks of at most ``MAX_CHUNK`` bytes.
- ``BUFFERED`` request body: answer the headers at once (no mutation), then answer the whole body
  with a ``BodyResponse`` carrying the mutation.
- Response headers, body and trailers are answered in order as they arrive; in full-duplex mode
  the response body is echoed back chunk by chunk (SSE passes through unchanged).
- Response headers are asked for only where the picker uses them (``skip_response_headers``):
  with no response body and no fallbacks (under ORIGINAL_DST the primary is the only host that can
  serve, so there is nothing to re-credit), the request-headers response carries a
  ``mode_override`` (Envoy's ``allow_mode_override``) that SKIPs response headers and trailers for
  this request. That saves a message each way per request. The ext_proc stream still ends with the
  HTTP stream (Envoy closes it when the filter is destroyed), which ends the accounting; what is
  lost is the response status in the ``kvpick_requests_total`` decision label. Otherwise the
  override turns the response path on: the rendered configs skip it unless told, so that a local
  reply of Envoy's to a request ext_proc never saw (a 408 while the buffer filter held the body,
  a 413, a 431) opens no picker stream (:data:`SEND_RESPONSE`). Neither override with a
  ``FULL_DUPLEX_STREAMED`` request body (the shipped configs' large and chunked bodies, GIE's every
  body): there the headers are answered after the body, and where that mode comes from a route's
  ``ExtProcPerRoute`` override Envoy 1.40 honours the skip and closes the ext_proc stream as soon
  as the request body has gone upstream, which ended the accounting the moment the request was
  routed (issue 23). The response headers keep the stream, and the accounting, open until the
  HTTP stream ends.

:class:`~picker.core.errors.PickerError` is translated here, and only here, into an
``ImmediateResponse`` with a JSON error body. Any other exception is logged with its traceback and
becomes an :class:`~picker.core.errors.InternalError` (500) at the same boundary.

When the client sent no ``x-request-id``, the one generated for it is set on the upstream request.

With flow control on (:mod:`picker.serving.flow`), a whole body is admitted through the gate
before its pick: while the pool is saturated the stream's only answer is a message-timeout
override, and the request is answered with the pick the gate made when it dispatched it (or the
gate's 429/503).
"""

from __future__ import annotations

import asyncio
import enum
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

from picker.core.endpoints.types import Endpoint
from picker.core.errors import BodyTooLarge, InternalError, PickerError
from picker.core.request import Parsed
from picker.core.scheduling.pd import PREFILLER_HEADER
from picker.serving.director import Director, Pick
from picker.serving.errors import CONTENT_TYPE
from picker.serving.errors import encode as encode_error

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
PREFILLER = PREFILLER_HEADER
"""The prefill endpoint of a disaggregated request (llm-d's ``x-prefiller-host-port``): set
from the pick, and removed when the client sent one (it names a host the sidecar will call)."""
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


def _response_path(request_body_mode: int, send: bool) -> processing_mode_pb2.ProcessingMode:
    """The processing mode that keeps the request side as the shipped configs set it, no response
    body, and the response headers and trailers sent to the picker (``send``) or not."""
    pm = processing_mode_pb2.ProcessingMode
    path = pm.SEND if send else pm.SKIP
    return pm(
        request_header_mode=pm.SEND,
        response_header_mode=path,
        request_body_mode=request_body_mode,
        response_body_mode=pm.NONE,
        request_trailer_mode=pm.SEND,
        response_trailer_mode=path,
    )


STATUS_LINGER_S = 2.0
"""How long a finished ext_proc stream waits for Envoy's reset before sending its status
(:meth:`ExtProcService.Process`)."""
EMPTY_LAST_CHUNK = pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True))
"""What :meth:`ExtProcService._prepare` passes on once it has buffered a body's last chunk itself."""
SKIP_RESPONSE = {mode: _response_path(mode, False) for mode in (FULL_DUPLEX, BUFFERED, STREAMED, NO_BODY)}
"""Built once: the ``mode_override`` that skips the response path, per request body mode."""
SEND_RESPONSE = {mode: _response_path(mode, True) for mode in (BUFFERED, STREAMED, NO_BODY)}
"""Built once: the ``mode_override`` that turns the response path on, per request body mode. The
rendered configs SKIP it by default (deploy/envoy/render.py ``_filter_response_path``), so that
Envoy's local replies to requests ext_proc never saw open no picker stream; the picker turns it
on for the requests it routes and wants the response of. None with a FULL_DUPLEX_STREAMED body:
those routes keep the response path on in the config, and the picker sends no override there."""


def _headers_ack(skip_mode: processing_mode_pb2.ProcessingMode | None) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
    if skip_mode is not None:
        resp.mode_override.CopyFrom(skip_mode)
    return resp


HEADERS_ACK = {False: _headers_ack(SEND_RESPONSE[BUFFERED]), True: _headers_ack(SKIP_RESPONSE[BUFFERED])}
"""Built once, never modified (sent as they are, by many streams): the BUFFERED answer to the
request headers, which changes nothing, keyed by whether it skips the response path (else it
turns it on: :data:`SEND_RESPONSE`)."""
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
    headers = [_header("content-type", CONTENT_TYPE)]
    if err.retry_after_s > 0:
        headers.append(_header("retry-after", str(err.retry_after_s)))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=e.status),
            headers=pb.HeaderMutation(set_headers=headers),
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


class BodyAnswers:
    """The answer to a BUFFERED body that leaves it unchanged and sends the client's own
    ``x-request-id`` depends on the destination alone (its header mutation and ``envoy.lb``
    metadata): built once per destination, then sent as it is by every stream that picks it
    (building one costs more than the rest of the handler's protocol work). Never modified once
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


class Phase(enum.Enum):
    """Where one exchange stands. It only moves forward: HEADERS → BODY → ROUTED → DONE (a
    bodiless request goes from HEADERS to ROUTED; an error from any phase ends the stream)."""

    HEADERS = "headers"
    """Nothing received yet."""
    BODY = "body"
    """Request headers received; the body is being buffered (up to ``max_body``)."""
    ROUTED = "routed"
    """The destination is chosen and answered; the response path is being passed through."""
    DONE = "done"
    """The request's accounting has ended (end of response, error, reset or disconnect)."""


@dataclass
class Exchange:
    """Protocol state of one HTTP request's ext_proc stream. The request's decision and
    accounting are the director's (:attr:`pick`)."""

    director: Director
    max_body: int
    request_mode: int
    response_mode: int
    phase: Phase = Phase.HEADERS
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    pick: Pick | None = None
    """Set when the phase becomes ROUTED."""
    subset: frozenset[str] | None = None
    """The gateway's subset hint (endpoint keys), None when it sent none."""
    parsed: Parsed | None = None
    """The body's parse, when :meth:`Director.prepare` made it before the pick."""
    skip_response_headers: bool = False
    """Ask Envoy (``mode_override``) not to send the response path, where the modes allow it."""
    body_answers: BodyAnswers | None = None
    """The service's shared answers to unchanged BUFFERED bodies (None: built per request)."""
    request_id: str = ""
    """The client's ``x-request-id``, or the one generated for it at the pick."""
    destination: str = ""
    """The pick's destination as the request path answers it (:attr:`Pick.destination`)."""
    prefill: str = ""
    """The pick's prefill endpoint (:attr:`Pick.prefill`), "" when not disaggregated."""
    held: tuple[Pick, bytes | None] | None = None
    """The pick flow control made when it dispatched this request (:mod:`picker.serving.flow`)."""

    @property
    def routed(self) -> bool:
        return self.phase is Phase.ROUTED or self.phase is Phase.DONE

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
        self.headers = _headers_map(msg)
        self.phase = Phase.BODY
        # Never with a FULL_DUPLEX_STREAMED request body: its headers are answered after the body,
        # and where that mode is a route's override (large and chunked bodies) Envoy 1.40 honours
        # the skip and then closes the ext_proc stream as soon as the request body is through,
        # which would end the request's accounting while it is still being served.
        self.skip_response_headers = (
            self.skip_response_headers and self.response_mode == NO_BODY and self.request_mode != FULL_DUPLEX
        )
        if msg.end_of_stream or self.request_mode == NO_BODY:
            # Bodiless (GET /v1/models), or a body Envoy will not send: any ready endpoint.
            self._pick(())
            return [self._override(self._headers_response(body_len=None))]
        if self.request_mode == FULL_DUPLEX:
            return []  # answered once the body's end-of-stream arrives
        if self.request_mode == BUFFERED and self.response_mode == NO_BODY:
            return [HEADERS_ACK[self.skip_response_headers]]
        return [self._override(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))]

    def _override(self, resp: pb.ProcessingResponse) -> pb.ProcessingResponse:
        """``resp`` (the request-headers response: Envoy honours a mode override only there),
        with the response path skipped where :attr:`skip_response_headers` says so, and turned on
        otherwise (the rendered configs skip it unless told: :data:`SEND_RESPONSE`). No override
        with a FULL_DUPLEX_STREAMED request body or a response body the picker is sent."""
        mode = None
        if self.request_mode != FULL_DUPLEX and self.response_mode == NO_BODY:
            mode = (SKIP_RESPONSE if self.skip_response_headers else SEND_RESPONSE).get(self.request_mode)
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
        if not msg.end_of_stream:
            if self.request_mode == FULL_DUPLEX or self.request_mode == BUFFERED:
                return []
            return [BODY_ACK]  # STREAMED: ack each chunk
        return self._finish_request_body()

    def on_request_trailers(self) -> Iterable[pb.ProcessingResponse]:
        out = () if self.routed else self._finish_request_body(eos=False)
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
        unchanged = (
            new_body is None
            and self.request_id == self.headers.get(REQUEST_ID)
            and not self.prefill
            and PREFILLER not in self.headers
        )
        if unchanged and self.body_answers is not None:  # the answer depends on the destination alone
            return [self.body_answers.get(self.destination, self._body_answer)]
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
        """Route through the director (parsing inline unless :meth:`Director.prepare` already
        did). Returns a rewritten body, or None if unchanged."""
        self.phase = Phase.ROUTED
        director = self.director
        if not any(chunks):
            pick = self.pick = director.pick_bodiless(self.headers, self.subset)
            new_body = None
        elif self.held is not None:
            pick, new_body = self.held
            self.pick = pick
        else:
            parsed = self.parsed if self.parsed is not None else director.parse(chunks, self.headers)
            pick, new_body = director.pick(parsed, self.subset)
            self.pick = pick
        self.request_id, self.destination, self.prefill = pick.request_id, pick.destination, pick.prefill
        return new_body

    def _mutation(self, body_len: int | None) -> pb.CommonResponse:
        hdrs = [_header(DEST_HEADER, self.destination)]
        if self.request_id != self.headers.get(REQUEST_ID):  # generated here: send it upstream
            hdrs.append(_header(REQUEST_ID, self.request_id))
        if body_len is not None:
            hdrs.append(_header("content-length", str(body_len)))
        if self.prefill:
            hdrs.append(_header(PREFILLER, self.prefill))
        elif PREFILLER in self.headers:  # a client's own: never passed to a sidecar
            mutation = pb.HeaderMutation(set_headers=hdrs, remove_headers=[PREFILLER])
            return pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
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
        headers = _headers_map(msg)
        status = headers.get(":status", "")
        if self.pick is not None:
            self.director.served(self.pick, served, status)
        if msg.end_of_stream:
            self.close()
        return [RESPONSE_HEADERS_ACK]

    def on_response_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.pick is not None:
            self.director.first_byte(self.pick)
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
        if self.pick is not None:
            self.director.finish(self.pick, outcome)
            self.phase = Phase.DONE


class ExtProcService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        director: Director,
        default_mode: int = FULL_DUPLEX,
        response_headers: str = "when-needed",
        max_streams: int = 0,
    ) -> None:
        assert response_headers in RESPONSE_HEADERS, f"response_headers {response_headers!r}"
        assert max_streams >= 0, f"max_streams must be >= 0, got {max_streams}"
        self.director = director
        telemetry = self.telemetry = director.telemetry
        self.max_body = director.router.cfg.max_body_bytes
        self.default_mode = default_mode
        self.skip_response_headers = response_headers == "when-needed" and director.router.cfg.fallbacks == 0
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

    async def _prepare(
        self,
        ex: Exchange,
        msg: pb.ProcessingRequest,
        write: Callable[[pb.ProcessingResponse], Awaitable[None]],
    ) -> pb.ProcessingRequest:
        """Before the message that completes a request body is handled: the body's last chunk
        is buffered here (its one copy out of the message: the last chunk of a BUFFERED body is
        the whole body) and the exchange finishes on an empty end-of-stream chunk; where the
        director says so (:meth:`Director.needs_prepare`: a large body, or tokenization on), its
        async :meth:`Director.prepare` runs first, off the event loop's critical path. A body
        ended by trailers is prepared when they arrive. Other messages pass unchanged."""
        if ex.phase is not Phase.BODY:
            return msg
        kind = msg.WhichOneof("request")
        if kind == "request_body":
            chunk = msg.request_body
            if not chunk.end_of_stream:
                return msg
            ex.absorb(chunk.body)  # one copy out of the message; the last chunk may be the whole body
            result = EMPTY_LAST_CHUNK
        elif kind == "request_trailers":
            result = msg
        else:
            return msg
        if self.director.needs_prepare(ex.size):
            ex.parsed = await self.director.prepare(ex.chunks, ex.size, ex.headers, ex.subset)
        gate = self.director.flow
        if gate is not None and ex.size:
            parsed = ex.parsed if ex.parsed is not None else self.director.parse(ex.chunks, ex.headers)
            ex.parsed = parsed
            room = gate.pass_through(parsed[0], ex.subset)
            if room is False:
                ex.held = await gate.admit(parsed, ex.subset, ex.size, write)
            else:  # routed now, bound to the endpoints with room (None: anywhere)
                ex.subset = room
        return result

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
        ex = Exchange(self.director, self.max_body, self.default_mode, self.default_mode)
        ex.skip_response_headers = self.skip_response_headers
        ex.body_answers = self.body_answers
        outcome = "aborted"
        self.open_streams += 1
        try:
            while (msg := await read()) is not grpc.aio.EOF:
                assert isinstance(msg, pb.ProcessingRequest), f"read() gave {type(msg).__name__}"
                try:
                    out = self._step(ex, await self._prepare(ex, msg, write))
                except PickerError as err:
                    outcome = f"error_{err.status}"
                    if ex.pick is None or ex.pick.ticket is None:  # else counted by close()
                        self.director.reject(outcome)
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
            phase = ex.phase  # identity checks, not the property: this runs for every message
            if self.telemetry is None or not (phase is Phase.HEADERS or phase is Phase.BODY):
                return self._dispatch(ex, msg)
            start = time.perf_counter()
            out = self._dispatch(ex, msg)
            if ex.phase is Phase.ROUTED:
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

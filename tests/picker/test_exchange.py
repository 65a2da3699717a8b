"""The ext_proc state machine, message by message (real protobuf messages, no network)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from picker.core.config import RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint
from picker.core.router import Router
from picker.serving.extproc import (
    BUFFERED,
    DEST_HEADER,
    FULL_DUPLEX,
    MAX_CHUNK,
    NO_BODY,
    Exchange,
    ExtProcService,
)
from picker.serving.telemetry import Telemetry
from tests.support.picking import director, service


def make(mode: int = FULL_DUPLEX, **cfg: object) -> tuple[Exchange, Pool]:
    pool = Pool()
    pool.set_endpoints([Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000), Endpoint("10.0.0.3", 8000)])
    router = Router(RouterConfig(fallbacks=2, **cfg), pool)  # type: ignore[arg-type]
    return Exchange(director(router), 1 << 20, mode, mode), pool


def headers(eos: bool = False, **extra: str) -> pb.HttpHeaders:
    hs = [
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
    ]
    hs += [base_pb2.HeaderValue(key=k.replace("_", "-"), raw_value=v.encode()) for k, v in extra.items()]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs), end_of_stream=eos)


def dest(resp: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in resp.header_mutation.set_headers}


def test_full_duplex_answers_only_after_end_of_stream_then_headers_then_chunks() -> None:
    ex, _ = make()
    body = json.dumps({"model": "m", "prompt": "x" * 150_000}).encode()
    assert ex.on_request_headers(headers(), None) == []
    third = len(body) // 3
    assert list(ex.on_request_body(pb.HttpBody(body=body[:third]))) == []
    assert list(ex.on_request_body(pb.HttpBody(body=body[third : 2 * third]))) == []
    out = list(ex.on_request_body(pb.HttpBody(body=body[2 * third :], end_of_stream=True)))
    first, *chunks = out
    assert first.WhichOneof("response") == "request_headers"
    common = first.request_headers.response
    assert common.clear_route_cache
    header = dest(common)[DEST_HEADER]
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST_HEADER].string_value
    keys = lb.split(",")
    assert lb == header, "the protocol forbids two different values in header and metadata"
    assert len(keys) == 3 and len(set(keys)) == 3
    assert all(c.WhichOneof("response") == "request_body" for c in chunks)
    streamed = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert all(len(s.body) <= MAX_CHUNK for s in streamed)
    assert [s.end_of_stream for s in streamed] == [False] * (len(streamed) - 1) + [True]
    assert b"".join(s.body for s in streamed) == body
    assert ex.pick.ticket is not None and ex.pick.ticket.state.load.in_flight_requests == 1
    ex.on_response_headers(headers())
    ex.on_response_body(pb.HttpBody(body=b"data: 1\n\n"))
    assert ex.on_response_body(pb.HttpBody(body=b"", end_of_stream=True))
    assert ex.pick.ticket.state.load.in_flight_requests == 0


def test_buffered_mode_mutates_in_the_body_response() -> None:
    ex, _ = make(BUFFERED)
    [hdr] = ex.on_request_headers(headers(), None)
    assert (
        hdr.WhichOneof("response") == "request_headers"
        and not hdr.request_headers.response.header_mutation.set_headers
    )
    [resp] = list(ex.on_request_body(pb.HttpBody(body=b'{"model": "m", "prompt": "hi"}', end_of_stream=True)))
    assert resp.WhichOneof("response") == "request_body"
    assert DEST_HEADER in dest(resp.request_body.response)
    assert resp.request_body.response.clear_route_cache


def test_model_rewrite_is_ignored_unless_the_gateway_is_trusted() -> None:
    ex, _ = make()
    ex.on_request_headers(headers(x_gateway_model_name_rewrite="evil"), None)
    out = list(
        ex.on_request_body(pb.HttpBody(body=b'{"model": "alias", "prompt": "hi"}', end_of_stream=True))
    )
    body = b"".join(o.request_body.response.body_mutation.streamed_response.body for o in out[1:])
    assert json.loads(body)["model"] == "alias"
    assert "content-length" not in dest(out[0].request_headers.response)


def test_bodiless_request_skips_scheduling_and_accounting() -> None:
    ex, pool = make()
    for s in pool:
        s.metrics.waiting = 1000  # saturated: a bodiless GET is still answered, never shed
    (resp,) = ex.on_request_headers(headers(eos=True), None)
    assert dest(resp.request_headers.response)[DEST_HEADER] in {s.key for s in pool}
    assert ex.pick.ticket is None and all(s.load.in_flight_requests == 0 for s in pool)
    assert ex.director.router.index.size() == 0


def test_model_rewrite_changes_body_and_content_length() -> None:
    ex, _ = make(trust_gateway_headers=True)
    ex.on_request_headers(headers(x_gateway_model_name_rewrite="target"), None)
    out = list(
        ex.on_request_body(pb.HttpBody(body=b'{"model": "alias", "prompt": "hi"}', end_of_stream=True))
    )
    new_body = b"".join(o.request_body.response.body_mutation.streamed_response.body for o in out[1:])
    assert json.loads(new_body)["model"] == "target"
    assert dest(out[0].request_headers.response)["content-length"] == str(len(new_body))


def test_trailers_end_the_body_without_end_of_stream_on_the_last_chunk() -> None:
    ex, _ = make()
    ex.on_request_headers(headers(), None)
    ex.on_request_body(pb.HttpBody(body=b'{"model": "m", "prompt": "hi"}'))
    out = list(ex.on_request_trailers())
    kinds = [o.WhichOneof("response") for o in out]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    assert not out[1].request_body.response.body_mutation.streamed_response.end_of_stream


def test_bodiless_request_is_answered_at_headers() -> None:
    ex, _ = make()
    [resp] = ex.on_request_headers(headers(eos=True), None)
    assert DEST_HEADER in dest(resp.request_headers.response)


def test_close_is_idempotent_and_releases_accounting() -> None:
    ex, pool = make()
    ex.on_request_headers(headers(), None)
    list(ex.on_request_body(pb.HttpBody(body=b'{"model": "m", "prompt": "hi"}', end_of_stream=True)))
    ex.close("aborted")
    ex.close("aborted")
    assert all(s.load.in_flight_requests == 0 and s.load.in_flight_tokens == 0 for s in pool)


def _respond(ex: Exchange, status: str, content_type: str) -> None:
    """A long prompt (4,096 tokens, nothing queued), then a response."""
    ex.on_request_headers(headers(), None)
    ex.on_request_body(
        pb.HttpBody(body=json.dumps({"model": "m", "prompt": "x" * 16384}).encode(), end_of_stream=True)
    )
    assert ex.pick.ticket is not None
    hs = [
        base_pb2.HeaderValue(key=":status", raw_value=status.encode()),
        base_pb2.HeaderValue(key="content-type", raw_value=content_type.encode()),
    ]
    ex.on_response_headers(pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs)))
    ex.on_response_body(pb.HttpBody(body=b'{"error": {}}', end_of_stream=True))


@pytest.mark.parametrize(
    ("status", "content_type"),
    [
        ("400", "application/json"),  # a fast error: the 1,000x jump of the issue
        ("503", "text/event-stream"),
        ("200", "application/json"),  # not streamed: the first byte is the whole answer
        ("200", "text/event-stream"),
    ],
)
def test_a_response_releases_the_prefill_and_moves_no_estimate(status: str, content_type: str) -> None:
    """No response moves an estimate: the calibrated model is fed by scrapes only."""
    ex, pool = make()
    models = {s.key: dataclasses.replace(s.model) for s in pool}
    _respond(ex, status, content_type)
    assert all(s.load.pending_prefill_tokens == 0 for s in pool), "the prefill is no longer pending"
    assert {s.key: s.model for s in pool} == models


# ---- x-request-id ----------------------------------------------------------------------------


def _mutated(out: list[pb.ProcessingResponse]) -> dict[str, str]:
    """The header mutation the picker returned, wherever the mode put it."""
    for o in out:
        kind = o.WhichOneof("response")
        if kind in ("request_headers", "request_body"):
            common = getattr(o, kind).response
            if common.header_mutation.set_headers:
                return dest(common)
    raise AssertionError(f"no header mutation in {out}")


def _run(ex: Exchange, mode: int, eos_at_headers: bool = False, **hdrs: str) -> list[pb.ProcessingResponse]:
    out = ex.on_request_headers(headers(eos=eos_at_headers, **hdrs), None)
    if not eos_at_headers:
        out += list(
            ex.on_request_body(pb.HttpBody(body=b'{"model": "m", "prompt": "hi"}', end_of_stream=True))
        )
    return out


def test_generated_request_id_is_sent_upstream() -> None:
    for mode, bodiless in [(FULL_DUPLEX, False), (BUFFERED, False), (FULL_DUPLEX, True)]:
        ex, _ = make(mode)
        sent = _mutated(_run(ex, mode, eos_at_headers=bodiless))
        rid = sent.get("x-request-id", "")
        assert len(rid) == 32 and int(rid, 16) >= 0, f"mode {mode}, bodiless {bodiless}: {sent}"
        assert rid == ex.request_id, "the id sent upstream is the one the picker uses"
        ex.close()


def test_client_request_id_is_kept_and_not_rewritten() -> None:
    for bodiless in (False, True):
        ex, _ = make()
        sent = _mutated(_run(ex, FULL_DUPLEX, eos_at_headers=bodiless, x_request_id="client-id-1"))
        assert "x-request-id" not in sent, sent
        assert ex.request_id == "client-id-1"
        ex.close()


# ---- body mode NONE --------------------------------------------------------------------------


def test_body_mode_none_picks_at_request_headers() -> None:
    """With request_body_mode NONE Envoy sends no body: a POST whose headers do not end the stream
    is answered at once, with a destination. protocol_config is a message field, so an all-default
    one (NONE, NONE) still arrives as present over the wire."""
    on_wire = pb.ProcessingRequest(
        request_headers=headers(),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=NO_BODY, response_body_mode=NO_BODY),
    ).SerializeToString()
    msg = pb.ProcessingRequest.FromString(on_wire)
    assert msg.HasField("protocol_config")
    ex, pool = make(FULL_DUPLEX)  # the picker's default mode is full duplex
    [resp] = ex.on_request_headers(msg.request_headers, msg.protocol_config)
    assert resp.WhichOneof("response") == "request_headers"
    assert DEST_HEADER in dest(resp.request_headers.response)
    assert sum(s.load.in_flight_requests for s in pool) == 0, "no body to schedule on: no accounting"
    ex.on_response_headers(headers(eos=True))
    assert sum(s.load.in_flight_requests for s in pool) == 0


def test_announced_full_duplex_still_waits_for_the_body() -> None:
    ex, _ = make(BUFFERED)
    cfg = pb.ProtocolConfiguration(request_body_mode=FULL_DUPLEX, response_body_mode=FULL_DUPLEX)
    assert ex.on_request_headers(headers(), cfg) == []


# ---- the service: pick latency and unexpected errors -----------------------------------------


def _service(linger: float = 0.0) -> tuple[ExtProcService, Telemetry, Pool]:
    ex, pool = make()
    telemetry = Telemetry()
    svc = service(ex.director.router, telemetry)
    svc.status_linger_s = linger
    return svc, telemetry, pool


def _stream(*msgs: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingRequest]:
    async def gen() -> AsyncIterator[pb.ProcessingRequest]:
        for m in msgs:
            yield m

    return gen()


BODY = pb.HttpBody(body=b'{"model": "m", "prompt": "hi"}', end_of_stream=True)


def _sample_count(telemetry: Telemetry, name: str) -> float:
    value = telemetry.registry.get_sample_value(f"{name}_count")
    return value or 0.0


async def test_pick_latency_has_one_sample_per_picked_request() -> None:
    svc, telemetry, _ = _service()
    e2e = "inference_extension_scheduler_e2e_duration_seconds"
    streams = [
        # full duplex: headers (no pick), body end (the pick), response
        [
            pb.ProcessingRequest(request_headers=headers()),
            pb.ProcessingRequest(request_body=BODY),
            pb.ProcessingRequest(response_headers=headers(eos=True)),
        ],
        # bodiless: the pick is at the headers
        [pb.ProcessingRequest(request_headers=headers(eos=True))],
        # a bad body: no pick, no sample
        [
            pb.ProcessingRequest(request_headers=headers()),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{nope", end_of_stream=True)),
        ],
    ]
    for msgs in streams:
        await svc.answers(_stream(*msgs))
    assert _sample_count(telemetry, e2e) == 2


async def test_unexpected_error_becomes_a_json_500_and_releases_accounting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    svc, telemetry, pool = _service()

    def boom(*_: object) -> None:
        raise KeyError("bug after the pick")

    monkeypatch.setattr(svc.director.router, "first_token", boom)  # fails once the request is in flight
    msgs = [
        pb.ProcessingRequest(request_headers=headers(x_request_id="rid-7")),
        pb.ProcessingRequest(request_body=BODY),
        pb.ProcessingRequest(response_headers=headers()),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1\n\n")),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)),
    ]
    with caplog.at_level(logging.ERROR, logger="picker.serving.extproc"):
        out = await svc.answers(_stream(*msgs))
    last = out[-1]
    assert last.WhichOneof("response") == "immediate_response", "the stream ends with a 500, not an RPC error"
    assert last.immediate_response.status.code == 500
    err = json.loads(last.immediate_response.body)["error"]
    assert err["code"] == 500 and err["type"] == "internal_error" and err["message"]
    assert len(out) == 4, "nothing is answered after the error"
    assert all(s.load.in_flight_requests == 0 and s.load.in_flight_tokens == 0 for s in pool)
    [rec] = [r for r in caplog.records if r.name == "picker.serving.extproc"]
    assert rec.exc_info is not None and isinstance(rec.exc_info[1], KeyError), "logged with its traceback"
    assert "rid-7" in rec.getMessage()
    counted = {"decision": "prefix_miss", "outcome": "error_500"}
    assert telemetry.registry.get_sample_value("kvpick_requests_total", counted) == 1, "counted once"


async def test_unexpected_error_before_the_pick_is_a_500_too(monkeypatch: pytest.MonkeyPatch) -> None:
    svc, _, pool = _service()

    def boom(*_: object) -> None:
        raise ZeroDivisionError("bug in scoring")

    monkeypatch.setattr(svc.director.router, "route", boom)
    msgs = [pb.ProcessingRequest(request_headers=headers()), pb.ProcessingRequest(request_body=BODY)]
    [resp] = await svc.answers(_stream(*msgs))
    assert resp.immediate_response.status.code == 500
    assert json.loads(resp.immediate_response.body)["error"]["type"] == "internal_error"
    assert all(s.load.in_flight_requests == 0 for s in pool)


@pytest.mark.parametrize(
    ("request_mode", "response_mode", "skipped"),
    [(BUFFERED, NO_BODY, True), (BUFFERED, FULL_DUPLEX, False), (NO_BODY, NO_BODY, True)],
)
def test_response_headers_are_skipped_only_where_nothing_of_the_response_is_wanted(
    request_mode: int, response_mode: int, skipped: bool
) -> None:
    ex, _ = make(request_mode)
    ex.skip_response_headers = True
    cfg = pb.ProtocolConfiguration(request_body_mode=request_mode, response_body_mode=response_mode)  # type: ignore[arg-type]
    [hdr] = ex.on_request_headers(headers(), cfg)
    assert hdr.HasField("mode_override") is skipped
    if skipped:
        mode = hdr.mode_override
        pm = processing_mode_pb2.ProcessingMode
        assert mode.response_header_mode == pm.SKIP and mode.response_body_mode == pm.NONE
        assert mode.request_body_mode == request_mode, "the request side keeps its mode"
        assert mode.request_header_mode == pm.SEND and mode.request_trailer_mode == pm.SEND


def test_a_full_duplex_request_body_never_skips_the_response_path() -> None:
    """Issue 23: with a FULL_DUPLEX_STREAMED request body the headers are answered after the body,
    and where that mode is a route's override Envoy honours a skip there and closes the ext_proc
    stream once the body is through, ending the accounting the moment the request is routed. So
    the late headers answer carries no override, and the request stays in flight until the
    stream ends."""
    ex, pool = make(FULL_DUPLEX)
    ex.skip_response_headers = True
    cfg = pb.ProtocolConfiguration(request_body_mode=FULL_DUPLEX, response_body_mode=NO_BODY)  # type: ignore[arg-type]
    assert ex.on_request_headers(headers(), cfg) == []
    hdr, *_ = ex.on_request_body(BODY)
    assert hdr.HasField("request_headers") and not hdr.HasField("mode_override"), hdr
    assert sum(s.load.in_flight_requests for s in pool) == 1
    ex.on_response_headers(pb.HttpHeaders(headers=base_pb2.HeaderMap()))
    assert sum(s.load.in_flight_requests for s in pool) == 1, "the response headers ended the accounting"
    ex.close()
    assert sum(s.load.in_flight_requests for s in pool) == 0


def test_the_service_skips_response_headers_only_without_fallbacks() -> None:
    pool = Pool()
    assert service(Router(RouterConfig(fallbacks=0), pool)).skip_response_headers
    assert not service(Router(RouterConfig(fallbacks=1), pool)).skip_response_headers
    assert not service(Router(RouterConfig(), pool), response_headers="always").skip_response_headers


async def test_a_finished_stream_waits_for_envoys_reset_instead_of_ending_with_a_status() -> None:
    """Envoy half-closes a finished stream, then resets it. Ending the call at the half-close
    makes grpcio send a status on a call being reset, and leak that failed batch's op array
    (grpc/grpc#43360): the handler ends the request's accounting, then waits to be cancelled."""
    svc, _, pool = _service(linger=30.0)
    msgs = [pb.ProcessingRequest(request_headers=headers()), pb.ProcessingRequest(request_body=BODY)]

    class Context:  # the part of grpc.aio's ServicerContext that Process uses
        out: list[pb.ProcessingResponse] = []

        async def read(self) -> object:
            return msgs.pop(0) if msgs else grpc.aio.EOF

        async def write(self, resp: pb.ProcessingResponse) -> None:
            self.out.append(resp)

    ctx = Context()
    task = asyncio.create_task(svc.Process(None, ctx))  # type: ignore[arg-type]
    await asyncio.sleep(0.2)
    assert ctx.out and not task.done(), "the handler returned at the half-close: grpcio would send a status"
    assert all(s.load.in_flight_requests == 0 for s in pool), "the request ended at the half-close"
    assert svc.open_streams == 0, "a lingering stream takes no stream slot"
    task.cancel()  # Envoy's reset
    with pytest.raises(asyncio.CancelledError):
        await task

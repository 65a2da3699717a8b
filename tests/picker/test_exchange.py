"""The ext_proc state machine, message by message (real protobuf messages, no network)."""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from picker.config import RouterConfig
from picker.endpoints.pool import Pool
from picker.endpoints.types import Endpoint
from picker.extproc import BUFFERED, DEST_HEADER, FULL_DUPLEX, MAX_CHUNK, Exchange
from picker.router import Router


def make(mode: int = FULL_DUPLEX) -> tuple[Exchange, Pool]:
    pool = Pool()
    pool.set_endpoints([Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000), Endpoint("10.0.0.3", 8000)])
    router = Router(RouterConfig(fallbacks=2), pool)
    return Exchange(router, None, 1 << 20, mode, mode), pool


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
    assert ex.on_request_body(pb.HttpBody(body=body[:third])) == []
    assert ex.on_request_body(pb.HttpBody(body=body[third : 2 * third])) == []
    out = ex.on_request_body(pb.HttpBody(body=body[2 * third :], end_of_stream=True))
    first, *chunks = out
    assert first.WhichOneof("response") == "request_headers"
    common = first.request_headers.response
    assert common.clear_route_cache
    primary = dest(common)[DEST_HEADER]
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST_HEADER].string_value
    keys = lb.split(",")
    assert keys[0] == primary and len(keys) == 3 and len(set(keys)) == 3
    assert all(c.WhichOneof("response") == "request_body" for c in chunks)
    streamed = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert all(len(s.body) <= MAX_CHUNK for s in streamed)
    assert [s.end_of_stream for s in streamed] == [False] * (len(streamed) - 1) + [True]
    assert b"".join(s.body for s in streamed) == body
    assert ex.ticket is not None and ex.ticket.state.in_flight_requests == 1
    ex.on_response_headers(headers())
    ex.on_response_body(pb.HttpBody(body=b"data: 1\n\n"))
    assert ex.on_response_body(pb.HttpBody(body=b"", end_of_stream=True))
    assert ex.ticket.state.in_flight_requests == 0


def test_buffered_mode_mutates_in_the_body_response() -> None:
    ex, _ = make(BUFFERED)
    [hdr] = ex.on_request_headers(headers(), None)
    assert (
        hdr.WhichOneof("response") == "request_headers"
        and not hdr.request_headers.response.header_mutation.set_headers
    )
    [resp] = ex.on_request_body(pb.HttpBody(body=b'{"model": "m", "prompt": "hi"}', end_of_stream=True))
    assert resp.WhichOneof("response") == "request_body"
    assert DEST_HEADER in dest(resp.request_body.response)
    assert resp.request_body.response.clear_route_cache


def test_model_rewrite_changes_body_and_content_length() -> None:
    ex, _ = make()
    ex.on_request_headers(headers(x_gateway_model_name_rewrite="target"), None)
    out = ex.on_request_body(pb.HttpBody(body=b'{"model": "alias", "prompt": "hi"}', end_of_stream=True))
    new_body = b"".join(o.request_body.response.body_mutation.streamed_response.body for o in out[1:])
    assert json.loads(new_body)["model"] == "target"
    assert dest(out[0].request_headers.response)["content-length"] == str(len(new_body))


def test_trailers_end_the_body_without_end_of_stream_on_the_last_chunk() -> None:
    ex, _ = make()
    ex.on_request_headers(headers(), None)
    ex.on_request_body(pb.HttpBody(body=b'{"model": "m", "prompt": "hi"}'))
    out = ex.on_request_trailers()
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
    ex.on_request_body(pb.HttpBody(body=b'{"model": "m", "prompt": "hi"}', end_of_stream=True))
    ex.close("aborted")
    ex.close("aborted")
    assert all(s.in_flight_requests == 0 and s.in_flight_tokens == 0 for s in pool)

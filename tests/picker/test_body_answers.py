"""The answer to an unchanged BUFFERED body is built once per destination and shared; answers
that carry anything of the request itself are never shared."""

from __future__ import annotations

from collections.abc import AsyncIterator

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from picker.core.config import RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint
from picker.core.router import Router
from picker.serving.extproc import BUFFERED, DEST_HEADER, REQUEST_ID, BodyAnswers, ExtProcService
from tests.support import picking

BODY = b'{"model": "m", "prompt": "the same prompt every time"}'


def service(**cfg: object) -> ExtProcService:
    pool = Pool()
    pool.set_endpoints([Endpoint("10.0.0.1", 8000)])
    svc = picking.service(Router(RouterConfig(**cfg), pool), default_mode=BUFFERED)  # type: ignore[arg-type]
    svc.status_linger_s = 0.0
    return svc


async def body_answer(svc: ExtProcService, body: bytes = BODY, **headers: str) -> pb.ProcessingResponse:
    """The answer to the body of one BUFFERED request with these headers (besides ``:path``)."""
    hs = [base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")]
    hs += [base_pb2.HeaderValue(key=k.replace("_", "-"), raw_value=v.encode()) for k, v in headers.items()]
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs)))
    first.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.BUFFERED
    first.protocol_config.response_body_mode = processing_mode_pb2.ProcessingMode.NONE

    async def stream() -> AsyncIterator[pb.ProcessingRequest]:
        yield first
        yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))

    out = await svc.answers(stream())
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    return out[1]


def set_headers(answer: pb.ProcessingResponse) -> dict[str, str]:
    mutation = answer.request_body.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def test_an_unchanged_body_gets_the_destinations_shared_answer() -> None:
    svc = service()
    first = await body_answer(svc, x_request_id="client-1")
    second = await body_answer(svc, x_request_id="client-2")
    assert second is first, "built once for the destination"
    assert set_headers(first) == {DEST_HEADER: "10.0.0.1:8000"}, "nothing of either request in it"
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST_HEADER].string_value
    assert lb == "10.0.0.1:8000"
    assert first.request_body.response.clear_route_cache
    assert len(svc.body_answers) == 1


async def test_answers_carrying_the_request_are_never_shared() -> None:
    svc = service(trust_gateway_headers=True)
    shared = await body_answer(svc, x_request_id="client-1")
    generated = await body_answer(svc)  # no x-request-id: the picker's own goes upstream
    assert generated is not shared
    assert set(set_headers(generated)) == {DEST_HEADER, REQUEST_ID}
    rewritten = await body_answer(svc, x_request_id="client-3", x_gateway_model_name_rewrite="other")
    assert rewritten is not shared and b'"other"' in rewritten.request_body.response.body_mutation.body
    assert await body_answer(svc, x_request_id="client-4") is shared, "neither replaced the shared one"
    assert set_headers(shared) == {DEST_HEADER: "10.0.0.1:8000"}


def test_the_shared_answers_are_bounded() -> None:
    answers = BodyAnswers(limit=2)
    built = [answers.get(d, pb.ProcessingResponse) for d in ("a:1", "b:1", "c:1", "c:1")]
    assert built[3] is built[2]
    assert len(answers) <= 2

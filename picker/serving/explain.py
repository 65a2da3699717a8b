"""The gRPC face of :meth:`picker.core.router.Router.explain` (``kvpick.v1.Explain``, proto/kvpick/v1)."""

from __future__ import annotations

from typing import Any

import grpc

from picker._proto.kvpick.v1 import explain_pb2 as pb
from picker._proto.kvpick.v1 import explain_pb2_grpc as pb_grpc
from picker.core import request as request_mod
from picker.core.errors import BadRequest, PickerError
from picker.core.router import Router
from picker.serving.errors import encode as encode_error


async def explain(
    router: Router, path: str, body: bytes, policy: str, headers: dict[str, str]
) -> dict[str, Any]:
    """Shared by the HTTP and gRPC faces: parse, validate the policy, explain."""
    if policy and policy not in router.profiles:
        raise BadRequest(f"unknown policy {policy!r}; known: {sorted(router.profiles)}")
    path = path or "/v1/completions"
    req, doc = request_mod.parse(body, path, headers, opts=router.parse_options)
    req = await router.tokenize_remote(router.tokenize(req, doc, path), doc, path)
    return router.explain(req, policy or None)


class ExplainService(pb_grpc.ExplainServicer):  # type: ignore[misc]
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Explain(
        self, request: pb.ExplainRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExplainResponse:
        try:
            doc = await explain(
                self.router,
                request.path,
                request.body,
                request.policy,
                {k.lower(): v for k, v in request.headers.items()},
            )
        except PickerError as err:
            e = encode_error(err)
            await context.abort(e.grpc_code, e.message)
            raise AssertionError("unreachable: abort raises") from err
        endpoints = [
            pb.EndpointExplain(
                endpoint=key,
                matched_blocks=e["matched_blocks"],
                cached_tokens_est=e["cached_tokens_est"],
                ttft_estimate_s=e["ttft_estimate_s"],
                score=e["score"] or 0.0,
                scores={n: v for n, v in e["scores"].items() if v is not None},
                health=e["health"],
                in_flight_requests=e["in_flight_requests"],
                waiting=e["waiting"],
                kv_usage=e["kv_usage"],
                model=pb.LoadModel(**e["model"]),
            )
            for key, e in doc["endpoints"].items()
        ]
        return pb.ExplainResponse(
            policy=doc["policy"],
            prompt_tokens_est=doc["prompt_tokens_est"],
            blocks=doc["blocks"],
            chosen=doc["chosen"],
            endpoints=endpoints,
        )

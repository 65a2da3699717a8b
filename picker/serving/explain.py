"""The gRPC face of :meth:`picker.serving.director.Director.explain` (``kvpick.v1.Explain``,
proto/kvpick/v1): a body is parsed, tokenized and scored as a routed request is, and nothing is
committed."""

from __future__ import annotations

import grpc

from picker._proto.kvpick.v1 import explain_pb2 as pb
from picker._proto.kvpick.v1 import explain_pb2_grpc as pb_grpc
from picker.core.errors import PickerError
from picker.serving.director import Director
from picker.serving.errors import encode as encode_error


class ExplainService(pb_grpc.ExplainServicer):  # type: ignore[misc]
    def __init__(self, director: Director) -> None:
        self.director = director

    async def Explain(
        self, request: pb.ExplainRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExplainResponse:
        try:
            doc = await self.director.explain(
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

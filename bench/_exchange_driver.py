"""``bench.exchange``'s driver, run as a script in a child process whose ``PYTHONPATH`` is the
source tree under test: prints one JSON line, ``{"us_per_request": ...}``.

    python bench/_exchange_driver.py SIZE REQUESTS
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.datapath import make_body
from picker.core.config import RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint
from picker.core.router import Router
from picker.serving.extproc import BUFFERED, ExtProcService
from picker.serving.telemetry import Telemetry

WARMUP = 300


def wire(size: int) -> list[bytes]:
    """The two messages Envoy sends for one request in the shipped default config, serialized."""
    body = make_body(size, False)
    headers = {
        ":authority": "127.0.0.1:10000",
        ":path": "/v1/chat/completions",
        ":method": "POST",
        ":scheme": "http",
        "user-agent": "wrk",
        "content-type": "application/json",
        "content-length": str(len(body)),
        "x-forwarded-for": "127.0.0.1",
        "x-forwarded-proto": "http",
        "x-request-id": "5b1c9f0e-8a9b-4c5d-9e1f-0a1b2c3d4e5f",
    }
    hmap = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hmap))
    first.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.BUFFERED
    first.protocol_config.response_body_mode = processing_mode_pb2.ProcessingMode.NONE
    second = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    return [first.SerializeToString(), second.SerializeToString()]


def service() -> ExtProcService:
    pool = Pool()
    pool.set_endpoints([Endpoint("127.0.0.1", 18001), Endpoint("127.0.0.1", 18002)])
    telemetry = Telemetry()
    router = Router(RouterConfig(), pool, plugin_timer=telemetry.plugin_timer)
    try:  # trees since the director (picker/serving/director.py)
        from picker.serving.director import Director
        from picker.serving.tokenization import Tokenization
    except ImportError:  # an older tree, run side by side: its own constructor
        return ExtProcService(router, telemetry, BUFFERED, None, "when-needed", max_streams=4096)  # type: ignore[call-arg, arg-type, misc, unused-ignore]
    director = Director(router, Tokenization(router), telemetry, None)
    if os.environ.get("KVPICK_EXCHANGE_FLOW") == "on":  # flow control on, the pool never saturated
        from picker.core.flowcontrol import FlowControlConfig
        from picker.serving.flow import FlowGate

        director.flow = FlowGate(director, FlowControlConfig(enabled=True), tick_s=0.2)
    return ExtProcService(director, BUFFERED, "when-needed", max_streams=4096)


async def requests(svc: ExtProcService, messages: list[bytes], n: int) -> None:
    parse = pb.ProcessingRequest.FromString
    for _ in range(n):

        async def read(it: Iterator[bytes] = iter(messages)) -> object:
            raw = next(it, None)
            return grpc.aio.EOF if raw is None else parse(raw)

        async def write(resp: pb.ProcessingResponse) -> None:
            resp.SerializeToString()

        await svc.exchange(read, write, None)


async def main(size: int, n: int) -> float:
    svc, messages = service(), wire(size)
    await requests(svc, messages, WARMUP)
    start = time.thread_time()
    await requests(svc, messages, n)
    return (time.thread_time() - start) / n * 1e6


if __name__ == "__main__":
    us = asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
    print(json.dumps({"us_per_request": us}))

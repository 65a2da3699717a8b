"""The ext_proc hold in process (real protobuf messages, no network): a request that arrives while
the pool is saturated gets only a message-timeout override until room frees, then its pick; a
cancelled stream leaves the queue with nothing in flight; a shed request gets 429 with
Retry-After. (Through a real Envoy: test_envoy_flow.py.)"""

from __future__ import annotations

import asyncio
import json

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from picker.core.config import RouterConfig
from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint, EndpointMetrics
from picker.core.flowcontrol import FlowControlConfig
from picker.core.router import Router
from picker.serving.extproc import DEST_HEADER, ExtProcService
from picker.serving.flow import FlowGate
from picker.serving.telemetry import Telemetry
from tests.picker.test_exchange import headers
from tests.support.picking import director

BODY = json.dumps({"model": "m", "prompt": "hold me"}).encode()


def stack(**objectives: int) -> tuple[ExtProcService, FlowGate, Pool]:
    pool = Pool()
    pool.set_endpoints([Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)])
    router = Router(RouterConfig(objectives=objectives), pool)
    d = director(router, Telemetry())
    gate = d.flow = FlowGate(d, FlowControlConfig(enabled=True, ttl_s=30), tick_s=0.05)
    return ExtProcService(d), gate, pool


def saturate(pool: Pool, on: bool) -> None:
    for s in pool:
        s.metrics = EndpointMetrics(waiting=500.0 if on else 0.0)


class Stream:
    """One ext_proc stream driven by the test: messages in, answers out."""

    def __init__(self, svc: ExtProcService, **extra: str) -> None:
        self.inbox: asyncio.Queue[object] = asyncio.Queue()
        self.out: list[pb.ProcessingResponse] = []
        self.inbox.put_nowait(pb.ProcessingRequest(request_headers=headers(**extra)))
        self.inbox.put_nowait(pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True)))
        self.task = asyncio.create_task(svc.exchange(self.inbox.get, self._write, None))

    async def _write(self, resp: pb.ProcessingResponse) -> None:
        self.out.append(resp)

    async def until(self, n: int) -> None:
        for _ in range(200):
            if len(self.out) >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{len(self.out)} answers, wanted {n}")


async def test_held_until_room_then_routed() -> None:
    svc, gate, pool = stack()
    saturate(pool, True)
    s = Stream(svc)
    await s.until(1)
    [hold] = s.out
    assert hold.WhichOneof("response") is None
    assert hold.override_message_timeout.seconds == int(gate.hold_timeout_s) > 30
    assert len(gate.fc.queue) == 1 and gate.held == 1
    assert all(e.load.in_flight_requests == 0 for e in pool), "a queued request is not in flight"
    saturate(pool, False)
    gate.fc.pump(gate.clock())
    await s.until(2)
    assert s.out[1].WhichOneof("response") == "request_headers"
    dest = {
        h.header.key: h.header.raw_value.decode()
        for h in s.out[1].request_headers.response.header_mutation.set_headers
    }
    assert dest[DEST_HEADER] in {e.key for e in pool}
    assert sum(e.load.in_flight_requests for e in pool) == 1
    s.inbox.put_nowait(grpc.aio.EOF)
    await s.task
    assert sum(e.load.in_flight_requests for e in pool) == 0
    assert gate.fc.queue.counts == {(0, "dispatched"): 1}


async def test_cancelled_while_queued_leaves_at_once() -> None:
    svc, gate, pool = stack()
    saturate(pool, True)
    s = Stream(svc)
    await s.until(1)
    s.task.cancel()
    await asyncio.gather(s.task, return_exceptions=True)
    assert len(gate.fc.queue) == 0 and gate.held == 0
    assert gate.fc.queue.counts == {(0, "cancelled"): 1}
    saturate(pool, False)
    gate.fc.pump(gate.clock())
    assert all(e.load.in_flight_requests == 0 for e in pool)


async def test_shed_at_once_gets_429_with_retry_after() -> None:
    svc, gate, pool = stack(batch=-1)
    saturate(pool, True)
    s = Stream(svc, **{"x-llm-d-inference-objective": "batch", "x-llm-d-slo-ttft-ms": "1"})
    await s.task
    [answer] = s.out
    imm = answer.immediate_response
    assert imm.status.code == 429
    hdrs = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    assert int(hdrs["retry-after"]) >= 1
    assert json.loads(imm.body)["error"]["code"] == 429
    assert gate.fc.queue.counts == {(-1, "shed_predicted_slo_miss"): 1}

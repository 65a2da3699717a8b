"""An OTLP/gRPC trace receiver for vLLM's per-request spans (``--otlp-traces-endpoint``), used by
``bench.split``. Needs ``opentelemetry-proto`` (a dependency of vLLM)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

from kvlaunch import free_port

from .split import Span

SPAN = "llm_request"
"""vLLM's per-request span (``vllm/v1/engine/output_processor.py``, ``do_tracing``)."""
ATTRS = {
    "gen_ai.latency.time_to_first_token": "ttft",
    "gen_ai.latency.time_in_queue": "queue",
    "gen_ai.latency.time_in_model_prefill": "prefill",
}
"""The span's attributes kept, by short name (vLLM's ``SpanAttributes``)."""


class TraceSink(otlp_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on loopback that keeps vLLM's ``llm_request`` spans by
    request id. Written by the gRPC server's one worker thread; read after :meth:`wait_for`."""

    def __init__(self) -> None:
        self.spans: dict[str, Span] = {}
        self._lock = threading.Lock()
        self.port = free_port()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        otlp_grpc.add_TraceServiceServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Export(
        self, request: otlp.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> otlp.ExportTraceServiceResponse:
        got: dict[str, Span] = {}
        for rs in request.resource_spans:
            res = {a.key: a.value.string_value for a in rs.resource.attributes}
            pid = int(res.get("vllm.process_id") or 0)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    if s.name != SPAN:
                        continue
                    attrs = {a.key: a.value for a in s.attributes}
                    rid = attrs["gen_ai.request.id"].string_value if "gen_ai.request.id" in attrs else ""
                    vals = {short: attrs[k].double_value for k, short in ATTRS.items() if k in attrs}
                    got[rid] = Span(s.start_time_unix_nano / 1e9, **vals, process=pid)
        with self._lock:
            self.spans.update(got)
        return otlp.ExportTraceServiceResponse()

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)

    def wait_for(self, ids: Iterable[str], timeout: float = 10.0) -> dict[str, Span]:
        """The spans of ``ids`` (vLLM's id is ``cmpl-ID-0``), waiting for the exporter's next
        batches; those still missing after ``timeout`` are left out."""
        want = set(ids)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                found = {_client_id(k): v for k, v in self.spans.items() if _client_id(k) in want}
            if len(found) == len(want) or time.monotonic() > deadline:
                return found
            time.sleep(0.1)


def _client_id(vllm_id: str) -> str:
    """``cmpl-ID-0`` (vLLM's completions id for the first prompt of request ``ID``) → ``ID``."""
    return vllm_id.removeprefix("cmpl-").rsplit("-", 1)[0]

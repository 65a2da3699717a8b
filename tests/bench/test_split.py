"""bench.split: the per-request split of TTFT, joined on x-request-id (Envoy's real access log,
vLLM's span format over a real OTLP exporter), and the /proc readings beside it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from bench.loadgen import Outcome
from bench.split import PIECES, Span, access_log, renice_engines, schedstat, segments, summarize, trace_sink
from kvlaunch import http
from kvlaunch.stack import stack


def _pieces_add_up(seg: dict[str, float]) -> None:
    parts = seg["to_envoy"] + seg["envoy_picker"] + seg["api_server"] + seg["engine"] + seg["back"]
    assert abs(parts - seg["client_ttft"]) < 1e-9, seg
    assert abs(seg["before_engine"] - (seg["to_envoy"] + seg["envoy_picker"] + seg["api_server"])) < 1e-9


def test_segments_add_up_to_the_clients_ttft() -> None:
    o = Outcome(0, ok=True, ttft=0.050, request_id="r-0", sent_wall=1000.0)
    envoy = {
        "start": "1000.001000",
        "upstream_tx_us": "4000",
        "ext_proc_request_header_latency_us": "1000",
        "ext_proc_request_body_total_latency_us": "2000",
    }
    span = Span(arrival=1000.010, ttft=0.030, queue=0.001, prefill=0.025)
    seg = segments(o, span, envoy)
    assert seg is not None
    assert seg["to_envoy"] == pytest.approx(0.001)
    assert seg["envoy_picker"] == pytest.approx(0.004)
    assert seg["ext_proc_calls"] == pytest.approx(0.003)
    assert seg["api_server"] == pytest.approx(0.005)
    assert seg["back"] == pytest.approx(0.010)
    _pieces_add_up(seg)
    peer = segments(o, span, None)  # no Envoy: the router's time is inside api_server
    assert peer is not None and peer["api_server"] == pytest.approx(0.010) and peer["envoy_picker"] == 0.0
    _pieces_add_up(peer)
    assert segments(o, None, envoy) is None  # no span from vLLM: nothing to split
    assert segments(Outcome(1, ok=False), span, envoy) is None
    streamed = segments(o, span, {**envoy, "route": "upstream:streamed"})  # the body's calls overlap
    assert streamed is not None and streamed["ext_proc_calls"] == pytest.approx(0.001)
    med = summarize([seg, peer, seg])
    assert set(PIECES) <= set(med) and med["n"] == 3 and med["api_server"] == pytest.approx(0.005)


def test_envoy_access_log_carries_the_clients_id_and_timings(tmp_path: pathlib.Path) -> None:
    """Real Envoy (render.py --access-log): the client's x-request-id is kept only with
    --preserve-request-id, and the ext_proc filter's per-call timings are there."""
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1}).encode()
    headers = {"content-type": "application/json", "x-request-id": "client-7"}
    for preserve in (True, False):
        log = tmp_path / f"access-{preserve}.log"
        args = ("--access-log", str(log), *(["--preserve-request-id"] if preserve else []))
        run_dir = tmp_path / str(preserve)
        run_dir.mkdir()
        with stack(run_dir, envoy_args=args) as st:
            assert http("POST", st.url + "/v1/completions", body, headers)[0] == 200
            deadline = time.monotonic() + 10
            while len(access_log(log)) < 2 and time.monotonic() < deadline:  # warm-up + ours
                time.sleep(0.1)
        docs = access_log(log)
        assert ("client-7" in docs) is preserve, docs.keys()
        doc = docs["client-7"] if preserve else list(docs.values())[-1]
        assert doc["status"] == 200
        assert 0 < int(doc["upstream_tx_us"]) <= int(doc["upstream_rx_us"]) <= int(doc["downstream_tx_us"])
        assert int(doc["ext_proc_request_header_latency_us"]) > 0
        assert doc["route"] == "upstream", doc  # a small body: BUFFERED, one body call
        assert int(doc["ext_proc_request_body_call_count"]) == 1
        assert int(doc["ext_proc_request_body_total_latency_us"]) > 0


def test_trace_sink_keeps_vllms_request_spans() -> None:
    """vLLM's span, as its tracer exports it (OTLP/gRPC), keyed back to the client's id."""
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    export = pytest.importorskip("opentelemetry.sdk.trace.export")
    grpc_exporter = pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
    with trace_sink() as sink:
        provider = sdk.TracerProvider()
        exporter = grpc_exporter.OTLPSpanExporter(endpoint=sink.endpoint, insecure=True)
        provider.add_span_processor(export.SimpleSpanProcessor(exporter))
        attrs = {
            "gen_ai.request.id": "cmpl-abc-3-0",
            "gen_ai.latency.time_to_first_token": 0.02,
            "gen_ai.latency.time_in_queue": 0.001,
            "gen_ai.latency.time_in_model_prefill": 0.015,
        }
        provider.get_tracer("t").start_span("llm_request", start_time=1_000_000_000, attributes=attrs).end()
        provider.get_tracer("t").start_span("other", attributes=attrs).end()
        spans = sink.wait_for(["abc-3"], timeout=5) | sink.wait_for(["missing-1"], timeout=0)
        provider.shutdown()
    assert spans == {"abc-3": Span(arrival=1.0, ttft=0.02, queue=0.001, prefill=0.015)}


def test_schedstat_and_renice_read_and_set_a_process_group() -> None:
    """A group leader and its child: the child's threads are set, the leader (vLLM's API server)
    is not; schedstat counts the group's CPU time."""
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        children: list[int] = []
        while not children and time.monotonic() < deadline:
            children = [
                int(p) for p in pathlib.Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            ]
        assert children, "sleep did not start"
        assert renice_engines(proc.pid, 7) == 1
        assert os.getpriority(os.PRIO_PROCESS, children[0]) == 7
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        proc.kill()
        proc.wait()
    # a busy group of its own, whose one task lives through both readings (a task that exits in
    # between takes its counts with it, so the pytest group's own sum can go down)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        before = schedstat([busy.pid])
        deadline = time.monotonic() + 10
        after = before.minus(before)
        while after.run_ns < 30_000_000 and time.monotonic() < deadline:
            time.sleep(0.05)
            after = schedstat([busy.pid]).minus(before)
        assert after.run_ns >= 30_000_000 and after.wait_ns >= 0, after
    finally:
        busy.kill()
        busy.wait()


def test_report_pairs_the_same_request_across_routers(tmp_path: pathlib.Path) -> None:
    from bench.split import report

    def row(i: int, ttft: float, before: float) -> dict[str, float]:
        return {"index": i, **dict.fromkeys(PIECES, 0.0), "client_ttft": ttft, "before_engine": before}

    for router, extra in (("cost", 0.004), ("sglang-router", 0.0)):
        d = tmp_path / "r0" / router
        d.mkdir(parents=True)
        rows = [row(i, 0.010 * (i + 1) + extra, 0.001 + extra) for i in range(10)]
        (d / "w@nice0.split.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report(tmp_path, "sglang-router")
    paired = next(line for line in text.splitlines() if "paired" in line)
    assert "| w@nice0 | cost | 10 |" in paired and paired.count("+4.0") == 2, paired

"""The picker's lifecycle through a real Envoy: SIGTERM drains in-flight streams, readiness
means "discovery synced" (an empty pool is ready and answers 503)."""

from __future__ import annotations

import json
import pathlib
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvlaunch import Procs, Stack, free_port, http, post_json, stack

pytestmark = pytest.mark.envoy


def _health(st: Stack, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{st.health_port}") as ch:
        req = health_pb2.HealthCheckRequest(service=service)
        return int(health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status)


def test_sigterm_mid_stream_loses_no_chunk_and_exits(tmp_path: pathlib.Path) -> None:
    chunks = 40
    with stack(tmp_path, picker_args=("--drain-timeout", "60")) as st:
        picker = next(p for n, p in st.procs.procs if n == "picker")
        body = json.dumps(
            {"model": "m", "prompt": "drain me", "stream": True, "chunks": chunks, "delay": 0.1}
        ).encode()
        got: list[tuple[int, bytes]] = []
        t = threading.Thread(
            target=lambda: got.append(http("POST", st.url + "/v1/completions", body, timeout=60)[:2])
        )
        t.start()
        time.sleep(1.0)  # about 10 of the 40 events are through
        picker.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert _health(st, "readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert picker.poll() is None, "the picker must wait for the in-flight stream"
        t.join(timeout=60)
        [(status, raw)] = got
        events = [e for e in raw.decode().split("\n\n") if e]
        assert status == 200 and events[-1] == "data: [DONE]", raw[-300:]
        assert [json.loads(e[6:])["i"] for e in events[:-1]] == list(range(chunks)), "chunks lost"
        assert picker.wait(timeout=15) == 0, st.procs.log("picker")
        assert "drained" in st.procs.log("picker")


def test_empty_pool_is_ready_and_answers_503(tmp_path: pathlib.Path) -> None:
    """Readiness is "discovery has synced": with every replica down the picker stays in its
    Service and clients get the protocol's 503, not a gateway error."""
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port()])  # nothing listens on the upstream port
    try:
        st.start_picker("--scrape-interval", "0.05")
        st.start_envoy()
        deadline = time.monotonic() + 10
        while st.endpoints()[f"127.0.0.1:{st.upstreams[0]}"]["health"] != "unreachable":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        serving = health_pb2.HealthCheckResponse.SERVING
        for svc in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert _health(st, svc) == serving, svc
        status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "x"})
        assert status == 503 and body["error"]["type"] == "no_endpoints", body
    finally:
        procs.stop()


def _children(pid: int) -> set[int]:
    """Live processes whose parent is ``pid`` (from /proc)."""
    out = set()
    for d in pathlib.Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_a_sigkilled_picker_leaves_no_parse_worker_behind(tmp_path: pathlib.Path) -> None:
    """The body-parsing worker (and spawn's resource tracker) die with the picker, even when
    the picker is killed with no chance to clean up."""
    procs = Procs(tmp_path)
    st = Stack(procs, upstreams=[free_port()])
    try:
        st.start_picker()
        picker = next(p for n, p in procs.procs if n == "picker")
        deadline = time.monotonic() + 30
        while len(kids := _children(picker.pid)) < 2:  # the parse worker and the resource tracker
            assert time.monotonic() < deadline, f"the picker started {kids}, not its parse worker"
            time.sleep(0.1)
        picker.send_signal(signal.SIGKILL)
        picker.wait(timeout=10)
        deadline = time.monotonic() + 10
        while left := [k for k in kids if _alive(k)]:
            assert time.monotonic() < deadline, f"processes outlived the SIGKILLed picker: {left}"
            time.sleep(0.1)
    finally:
        procs.stop()

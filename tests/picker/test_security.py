"""The picker's attack surface: debug faces off by default, loopback when on, streams capped
(through a real Envoy, whose failure mode then applies)."""

from __future__ import annotations

import json
import pathlib
import socket
import threading
import time

import grpc
import pytest

from kvlaunch import Procs, Stack, free_port, http, post_json, wait_port
from picker._proto.kvpick.v1 import explain_pb2, explain_pb2_grpc

pytestmark = pytest.mark.envoy


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return True
    return False


def _non_loopback_ipv4() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_debug_faces_are_off_by_default(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port()])
    try:
        st.start_upstreams()
        st.start_picker(debug=False)
        status, _, _ = http("GET", f"http://127.0.0.1:{st.metrics_port}/metrics")
        assert status == 200
        doc = json.dumps({"model": "m", "prompt": "x"}).encode()
        assert http("POST", f"http://127.0.0.1:{st.metrics_port}/debug/explain", doc)[0] == 404
        assert http("GET", f"http://127.0.0.1:{st.metrics_port}/debug/endpoints")[0] == 404
        assert _refused("127.0.0.1", st.debug_port)
        creds = st.grpc_credentials()
        opts = (("grpc.ssl_target_name_override", "kvpick-picker"),)
        with grpc.secure_channel(f"127.0.0.1:{st.grpc_port}", creds, options=opts) as ch:
            with pytest.raises(grpc.RpcError) as err:
                explain_pb2_grpc.ExplainStub(ch).Explain(explain_pb2.ExplainRequest(body=doc), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        procs.stop()


def test_debug_api_binds_loopback_only(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port()])
    try:
        st.start_upstreams()
        st.start_picker("--host", "0.0.0.0")  # --enable-debug-api, no --debug-bind-address
        wait_port(st.debug_port)
        url = f"http://127.0.0.1:{st.debug_port}/debug/endpoints"
        assert http("GET", url, headers=st.debug_headers)[0] == 200
        addr = _non_loopback_ipv4()
        if addr is None:
            pytest.skip("this machine has no non-loopback IPv4 address to probe")
        assert _refused(addr, st.debug_port), f"debug API reachable on {addr}"
        assert not _refused(addr, st.metrics_port), "metrics stay on every address"
    finally:
        procs.stop()


def _stream(st: Stack, out: list[int], delay: float) -> None:
    doc = {"model": "m", "prompt": "hold", "stream": True, "chunks": 10, "delay": delay}
    status, _ = post_json(st.url + "/v1/completions", doc)
    out.append(status)


@pytest.mark.parametrize("mode", ["close", "open"])
def test_stream_cap_refuses_cleanly_and_envoy_failure_mode_applies(tmp_path: pathlib.Path, mode: str) -> None:
    """With --max-concurrent-streams 1, a second stream while one is held is refused
    (RESOURCE_EXHAUSTED): fail-close answers 5xx, fail-open serves it without the picker. The
    held request completes, and the picker serves again once the slot frees."""
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port(), free_port()])
    try:
        st.start_upstreams()
        st.start_picker("--max-concurrent-streams", "1")
        eps = ",".join(f"127.0.0.1:{p}" for p in st.upstreams)
        st.start_envoy("--upstream", "pool", "--endpoints", eps, "--failure-mode", mode)
        deadline = time.monotonic() + 20
        while post_json(st.url + "/v1/completions", {"model": "m", "prompt": "w"})[0] != 200:
            assert time.monotonic() < deadline, procs.log("envoy")
            time.sleep(0.2)
        held: list[int] = []
        t = threading.Thread(target=_stream, args=(st, held, 0.3))
        t.start()
        time.sleep(1.0)  # the held stream is open (3 s of events)
        status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "second"})
        if mode == "close":
            assert status >= 500, (status, body)
        else:
            assert status == 200 and body["served_by"] in st.upstreams, (status, body)
        t.join(timeout=30)
        assert held == [200]
        assert "Traceback" not in procs.log("picker")
        deadline = time.monotonic() + 10
        while post_json(st.url + "/v1/completions", {"model": "m", "prompt": "after"})[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        st.wait_in_flight_zero()
    finally:
        procs.stop()


def test_health_checks_do_not_take_stream_slots(tmp_path: pathlib.Path) -> None:
    """With --max-concurrent-streams 1: a long health Watch on the ext_proc port leaves the one
    slot to ext_proc; while an ext_proc stream holds it, a health Check still answers SERVING and
    a second ext_proc stream is refused with RESOURCE_EXHAUSTED."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    procs = Procs(tmp_path)
    st = Stack(procs, [free_port()])
    try:
        st.start_picker("--max-concurrent-streams", "1", "--secure-serving", "false", debug=False)
        headers = pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/models")]),
            end_of_stream=True,
        )
        with grpc.insecure_channel(f"127.0.0.1:{st.grpc_port}") as ch:
            health_stub = health_pb2_grpc.HealthStub(ch)
            svc = "envoy.service.ext_proc.v3.ExternalProcessor"
            watch = health_stub.Watch(health_pb2.HealthCheckRequest(service=svc), timeout=30)
            next(watch)  # the watch is open for the rest of the test
            stub = pb_grpc.ExternalProcessorStub(ch)
            held = threading.Event()

            def _held_messages() -> object:
                yield pb.ProcessingRequest(request_headers=headers)
                held.wait(20)

            first = stub.Process(_held_messages(), timeout=30)
            assert next(first).WhichOneof("response") == "request_headers", "the watch took the slot"
            check = health_stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Process(iter([pb.ProcessingRequest(request_headers=headers)]), timeout=5))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            held.set()
            list(first)
            deadline = time.monotonic() + 10  # the slot frees once the held stream ends
            while True:
                try:
                    list(stub.Process(iter([pb.ProcessingRequest(request_headers=headers)]), timeout=5))
                    break
                except grpc.RpcError as exc:
                    assert time.monotonic() < deadline, exc
                    time.sleep(0.1)
            watch.cancel()
        assert "Traceback" not in procs.log("picker")
    finally:
        procs.stop()

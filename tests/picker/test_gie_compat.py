"""The picker behind GIE's own test Envoy settings, its gRPC health services, and its metrics."""

from __future__ import annotations

import pathlib
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvlaunch import Procs, Stack, free_port, http, post_json

pytestmark = pytest.mark.envoy
DATA = pathlib.Path(__file__).parent / "data"
DOC = "GIE compatibility: a shared system prompt that spans several hash blocks. " * 10


def test_works_behind_gie_test_envoy_config(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port(), free_port()], mtls=False)  # GIE's config presents no client cert
    try:
        st.start_upstreams()
        st.start_picker()  # defaults: TLS with a self-signed certificate, as GIE's EPP
        st.envoy_port = free_port()
        cfg = (DATA / "gie_test_envoy.yaml").read_text()
        cfg = cfg.replace("@LISTEN@", str(st.envoy_port)).replace("@ADMIN@", str(free_port()))
        st.start_envoy(config=cfg.replace("@EPP@", str(st.grpc_port)))
        deadline = time.monotonic() + 30
        while (status := post_json(st.url + "/v1/completions", {"model": "m", "prompt": "w"})[0]) != 200:
            assert time.monotonic() < deadline, (status, procs.log("envoy")[-2000:])
            time.sleep(0.3)
        homes = set()
        for i in range(4):
            status, body = post_json(
                st.url + "/v1/chat/completions",
                {
                    "model": "m",
                    "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": f"q{i}"}],
                },
            )
            assert status == 200, body
            homes.add(body["served_by"])
        assert len(homes) == 1
        # GIE's config does not strip the header: the picker must overwrite a forged one.
        other = next(p for p in st.upstreams if p not in homes)
        status, body = post_json(
            st.url + "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "system", "content": DOC}]},
            headers={"x-gateway-destination-endpoint": f"127.0.0.1:{other}"},
        )
        assert status == 200 and body["served_by"] in homes
    finally:
        procs.stop()


def _check(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


def test_grpc_health_on_both_ports_and_metrics(envoy_stack: Stack) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(f"127.0.0.1:{envoy_stack.health_port}") as ch:
        for svc in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert _check(ch, svc) == serving, svc
    # The ext_proc port speaks TLS (mTLS here: the gateway's certificate) and answers health there
    # too (gateways probe it).
    creds = envoy_stack.grpc_credentials()
    opts = (("grpc.ssl_target_name_override", "kvpick-picker"),)
    with grpc.secure_channel(f"127.0.0.1:{envoy_stack.grpc_port}", creds, options=opts) as ch:
        assert _check(ch, "envoy.service.ext_proc.v3.ExternalProcessor") == serving
    status, body, _ = http("GET", f"http://127.0.0.1:{envoy_stack.metrics_port}/metrics")
    text = body.decode()
    assert status == 200
    for name in (
        "inference_extension_scheduler_e2e_duration_seconds_bucket",
        "inference_extension_prefix_indexer_size",
        'inference_pool_ready_pods{name="kvpick"} 2.0',
        "inference_pool_average_kv_cache_utilization",
        "inference_pool_average_queue_size",
        "inference_objective_request_total",
        "inference_extension_plugin_duration_seconds_bucket",
        "kvpick_requests_total",
        "kvpick_endpoint_in_flight_requests",
    ):
        assert name in text, name


def test_explain_reports_scores_and_estimates(envoy_stack: Stack) -> None:
    post_json(envoy_stack.url + "/v1/completions", {"model": "m", "prompt": DOC})
    # Response bodies bypass the picker: the request ends when Envoy closes its ext_proc stream,
    # just after the client has the answer. Explain must not see it still in flight.
    envoy_stack.wait_in_flight_zero()
    status, body = post_json(
        f"http://127.0.0.1:{envoy_stack.debug_port}/debug/explain?path=/v1/completions",
        {"model": "m", "prompt": DOC + " more"},
        envoy_stack.debug_headers,
    )
    assert status == 200, body
    eps = body["endpoints"]
    assert len(eps) == 2
    best = body["chosen"][0]
    assert eps[best]["matched_blocks"] > 0
    assert all(e["ttft_estimate_s"] > 0 for e in eps.values())
    assert eps[best]["ttft_estimate_s"] == min(e["ttft_estimate_s"] for e in eps.values())
    url = f"http://127.0.0.1:{envoy_stack.debug_port}/debug/explain"
    status, body = post_json(url, {"prompt": "x"}, envoy_stack.debug_headers)
    assert status == 400


def test_gie_chart_args_start_the_picker_behind_envoy(tmp_path: pathlib.Path) -> None:
    """The args GIE's EPP chart passes (and its EndpointPickerConfig) start the picker: the
    flags it does not act on are named in one log line, and GIE's probe service answers SERVING."""
    from tests.unit.test_cli import GIE_CHART_ARGS, IGNORED_IN_CHART_ARGS

    gie_cfg = tmp_path / "default-plugins.yaml"
    gie_cfg.write_text("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n")
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port(), free_port()])
    try:
        st.start_upstreams()
        st.start_picker(*GIE_CHART_ARGS, "--config-file", str(gie_cfg), "--log-level", "info")
        st.start_envoy()
        deadline = time.monotonic() + 20
        while post_json(st.url + "/v1/completions", {"model": "m", "prompt": "gie"})[0] != 200:
            assert time.monotonic() < deadline, procs.log("picker")
            time.sleep(0.2)
        with grpc.insecure_channel(f"127.0.0.1:{st.health_port}") as ch:
            assert _check(ch, "inference-extension") == health_pb2.HealthCheckResponse.SERVING
        log = procs.log("picker")
        lines = [line for line in log.splitlines() if "GIE flags accepted and not acted on" in line]
        assert len(lines) == 1, log
        assert all(flag in lines[0] for flag in IGNORED_IN_CHART_ARGS), lines[0]
        assert "EndpointPickerConfig" in log and "Traceback" not in log
    finally:
        procs.stop()

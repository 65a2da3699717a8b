"""The shipped Envoy configs: committed YAML equals render.py's output, every config carries the
hardening (header stripping, use_remote_address, timeouts, streamed responses), render.py refuses
configs that cannot work, and fail-open/SSE behave as documented through a real Envoy."""

from __future__ import annotations

import json
import pathlib
import signal
import socket
import subprocess
import time
from typing import Any

import pytest
import yaml

from kvlaunch import PY, ROOT, Procs, Stack, envoy_configs, free_port, http, post_json
from kvlaunch.envoy_configs import ALL, KIND, SHIPPED

pytestmark = pytest.mark.envoy
RENDER = str(ROOT / "deploy/envoy/render.py")


def _config(name: str) -> dict[str, Any]:
    if name == KIND:
        return envoy_configs.kind_config("kvpick-picker.kvpick.svc.cluster.local:9002", 8080, 9901)
    return dict(yaml.safe_load((ROOT / "deploy/envoy" / name).read_text()))


def _hcm(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"])


@pytest.mark.parametrize("name", list(SHIPPED))
def test_committed_config_is_its_rendering(name: str, tmp_path: pathlib.Path) -> None:
    out = tmp_path / name
    subprocess.run([PY, RENDER, *SHIPPED[name], "-o", str(out)], check=True)
    assert out.read_text() == (ROOT / "deploy/envoy" / name).read_text(), (
        f"deploy/envoy/{name} is stale: run `python deploy/envoy/render.py "
        f"{' '.join(SHIPPED[name])} -o deploy/envoy/{name}`"
    )


@pytest.mark.parametrize("name", ALL)
def test_every_shipped_config_is_hardened(name: str) -> None:
    cfg = _config(name)
    hcm = _hcm(cfg)
    assert hcm["use_remote_address"] is True
    count, buffer, ext_proc, *served, router = hcm["http_filters"]
    # Too many headers: a JSON 431 before ext_proc, under Envoy's own limit with room for the
    # picker's mutation (which ext_proc refuses, 500, past that limit).
    assert count["name"] == "kvpick.header_count" and "LIMIT = 100" in str(count)
    assert hcm["common_http_protocol_options"]["max_headers_count"] == 1000
    assert hcm["max_request_headers_kb"] == 96
    assert ext_proc["name"] == "envoy.filters.http.ext_proc" and router["name"].endswith("router")
    # Every config reports the served host on the response path (the protocol's MUST).
    assert [f["name"] for f in served] == ["envoy.filters.http.lua", "kvpick.served_stamp"]
    namespaces = ext_proc["typed_config"]["metadata_options"]["forwarding_namespaces"]["untyped"]
    assert namespaces == ["envoy.lb", "envoy.lb.subset_hint"]
    [strip] = hcm["early_header_mutation_extensions"]  # before route selection, not a filter
    removed = strip["typed_config"]["mutations"]
    prefixes = {m["remove_on_match"]["key_matcher"]["prefix"] for m in removed if "remove_on_match" in m}
    assert prefixes == {"x-gateway-destination-endpoint", "x-envoy-"}
    assert {m["remove"] for m in removed if "remove" in m} == {
        "x-gateway-model-name-rewrite",
        "x-llm-d-model-name-rewrite",
        "x-prefiller-host-port",
    }
    proc = ext_proc["typed_config"]
    mode = proc["processing_mode"]
    assert mode["response_body_mode"] != "BUFFERED", "SSE would be held to the end"
    if proc["failure_mode_allow"]:
        assert mode["request_body_mode"] == "BUFFERED"
    assert hcm["stream_idle_timeout"] == "300s" and hcm["request_headers_timeout"] == "10s"
    not_found, *routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert not_found["name"] == "not_found" and not_found["direct_response"]["status"] == 404
    [outside] = not_found["match"]["headers"]  # a :path outside the allowlist: ext_proc off
    assert outside["name"] == ":path" and outside["invert_match"] is True
    assert not_found["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True
    assert hcm["normalize_path"] is True and hcm["merge_slashes"] is True
    for route in routes:
        assert route["route"]["timeout"] == "0s" and route["route"]["idle_timeout"] == "300s"
        assert "retry_policy" in route["route"]
    # Slow clients (issue 23 item 4): the body whole within the request timeout (a JSON 408), held
    # by the buffer filter before ext_proc opens a picker stream (not on streamed routes, nor the
    # 404); connections and HTTP/2 streams bounded; the picker streams Envoy opens, at the picker's cap.
    assert hcm["request_timeout"] == "30s" and hcm["http2_protocol_options"]["max_concurrent_streams"] == 100
    assert buffer["name"] == "envoy.filters.http.buffer"
    for route in [not_found, *routes]:
        off = route.get("typed_per_filter_config", {}).get("envoy.filters.http.buffer", {}).get("disabled")
        streamed = route["name"].endswith(":streamed") or route is not_found
        assert off is (True if streamed else None), route["name"]
    [slow] = [m for m in hcm["local_reply_config"]["mappers"] if "408" in str(m["filter"])]
    assert slow["body_format_override"]["json_format"]["error"]["type"] == "request_timeout"
    [conns] = cfg["overload_manager"]["resource_monitors"]
    assert conns["typed_config"]["max_active_downstream_connections"] == 50000
    assert cfg["admin"]["ignore_global_conn_limit"] is True
    pickers = {
        c["name"]: c for c in cfg["static_resources"]["clusters"] if c["name"].startswith("kvpick_picker")
    }
    assert pickers["kvpick_picker"]["circuit_breakers"]["thresholds"][0]["max_requests"] == 4096
    streamed = [r for r in routes if r["name"].endswith(":streamed")]
    if streamed:  # streamed bodies' picker streams on their own cluster, capped lower
        assert pickers["kvpick_picker_streamed"]["circuit_breakers"]["thresholds"][0]["max_requests"] == 1024
        assert pickers["kvpick_picker_streamed"]["health_checks"] == pickers["kvpick_picker"]["health_checks"]
    assert set(pickers) == {"kvpick_picker", *(["kvpick_picker_streamed"] if streamed else [])}
    for route in streamed:
        service = route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]["grpc_service"]
        assert service["envoy_grpc"]["cluster_name"] == "kvpick_picker_streamed"
    clusters = [c for c in cfg["static_resources"]["clusters"] if c["name"] not in pickers]
    for c in clusters:
        assert c["upstream_connection_options"]["tcp_keepalive"]["keepalive_time"] == 10
        opts = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        idle = opts["common_http_protocol_options"]["idle_timeout"]
        assert idle.endswith("s") and float(idle[:-1]) < 5, "under vLLM's 5 s keep-alive (render.py)"


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--failure-mode", "open"], "needs --fallback"),
        (
            ["--failure-mode", "open", "--fallback", "10.0.0.1:8000", "--body-mode", "FULL_DUPLEX_STREAMED"],
            "BUFFERED",
        ),
        (["--upstream", "pool"], "needs --endpoints"),
    ],
)
def test_render_refuses_configs_that_cannot_work(args: list[str], why: str) -> None:
    proc = subprocess.run([PY, RENDER, *args], capture_output=True, text=True)
    assert proc.returncode == 2 and why in proc.stderr, proc.stderr


def test_fallback_by_dns_name_is_strict_dns() -> None:
    text = subprocess.run(
        [PY, RENDER, "--failure-mode", "open", "--fallback", "vllm.ns.svc.cluster.local:8000"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    [fallback] = [
        c for c in yaml.safe_load(text)["static_resources"]["clusters"] if c["name"] == "kvpick_fallback"
    ]
    assert fallback["type"] == "STRICT_DNS"


def _stack(tmp: pathlib.Path, name: str, *extra: str) -> Stack:
    st = Stack(Procs(tmp), [free_port(), free_port()])
    st.start_upstreams()
    st.start_picker()
    envoy_configs.start_envoy(st, name, *extra)
    deadline = time.monotonic() + 20
    while post_json(st.url + "/v1/completions", {"model": "m", "prompt": "w"})[0] != 200:
        assert time.monotonic() < deadline, st.procs.log("envoy")
        time.sleep(0.2)
    return st


def test_fail_open_original_dst_serves_with_the_picker_killed(tmp_path: pathlib.Path) -> None:
    """The issue's bug: fail-open with ORIGINAL_DST answered 503 to everything while the picker was
    down. Now requests without a destination header take the fallback route."""
    st = _stack(tmp_path, "envoy-failopen.yaml")
    try:
        st.procs.signal("picker", signal.SIGKILL).wait(10)
        served = set()
        # Sequential requests leave both hosts idle, so each is a coin toss: 6 landed on one host in
        # 1 run of 32 (a CI run saw it); 32 do so in one run of about two billion.
        for i in range(32):
            status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": f"down {i}"})
            assert status == 200, (status, body)
            served.add(body["served_by"])
            assert body["dest_header"] == "", "no picker, so no destination header"
        assert served == set(st.upstreams), f"least-request over both: {served}"
        status, body, _ = http("GET", st.url + "/v1/models")
        assert status == 200 and b"served_by" in body
        assert _first_event_delay(st) < 1.0
        st.start_picker()  # back on the same ports: routing through the picker resumes
        deadline = time.monotonic() + 20
        while True:
            status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "back"})
            assert status == 200, (status, body)
            if body["dest_header"]:
                break
            assert time.monotonic() < deadline, "Envoy never went back to the picker"
            time.sleep(0.2)
    finally:
        st.procs.stop()


def _first_event_delay(st: Stack, chunks: int = 10, delay: float = 0.3) -> float:
    """Seconds from sending a streamed request to reading its first SSE event, checking the stream
    then runs to [DONE]; a buffered response would arrive only after chunks × delay."""
    body = json.dumps(
        {"model": "m", "prompt": "sse", "stream": True, "chunks": chunks, "delay": delay}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", st.envoy_port), timeout=30) as s:
        s.sendall(head + body)
        got, first = b"", None
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
            if first is None and b"data:" in got:
                first = time.monotonic() - start
    assert b"data: [DONE]" in got, got[-300:]
    assert first is not None
    return first


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("response", ["FULL_DUPLEX_STREAMED", "NONE"])
def test_sse_stays_streamed(name: str, response: str, tmp_path: pathlib.Path) -> None:
    if name == KIND and response == "NONE":
        pytest.skip("the kind config renders the default response mode only")
    extra = () if name == KIND else ("--response-body-mode", response)
    st = _stack(tmp_path, name, *extra)
    try:
        assert _first_event_delay(st) < 1.0, "the first event waited for the whole stream (3 s)"
        st.wait_in_flight_zero()
    finally:
        st.procs.stop()


def _served_reports(metrics_port: int) -> dict[str, float]:
    status, body, _ = http("GET", f"http://127.0.0.1:{metrics_port}/metrics")
    assert status == 200
    out = {"primary": 0.0, "other": 0.0}
    for line in body.decode().splitlines():
        if line.startswith("kvpick_served_reports_total{"):
            label = line.split('served="', 1)[1].split('"', 1)[0]
            out[label] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("name", ALL)
def test_every_config_reports_the_served_endpoint(name: str, tmp_path: pathlib.Path) -> None:
    """Every shipped config, ORIGINAL_DST ones included, tells the picker on the response path
    which endpoint served (the protocol's ``x-gateway-destination-endpoint-served``): with one host
    named per request, it is the primary every time. The picker is asked for response headers
    (``--response-headers always``) so it reads the report."""
    st = Stack(Procs(tmp_path), [free_port(), free_port()])
    try:
        st.start_upstreams()
        st.start_picker("--response-headers", "always")
        envoy_configs.start_envoy(st, name)
        deadline = time.monotonic() + 20
        while post_json(st.url + "/v1/completions", {"model": "m", "prompt": "w"})[0] != 200:
            assert time.monotonic() < deadline, st.procs.log("envoy")
            time.sleep(0.2)
        before = _served_reports(st.metrics_port)
        for i in range(6):
            status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": f"served {i}"})
            assert status == 200, body
            assert "x-kvpick-served" not in body.get("headers", {}), "the stamp leaked upstream"
        st.wait_in_flight_zero()
        after = _served_reports(st.metrics_port)
        assert after["primary"] - before["primary"] == 6, (before, after, st.procs.log("envoy"))
        assert after["other"] == 0, after
    finally:
        st.procs.stop()


@pytest.mark.parametrize("mode", ["pass", "strip"])
def test_objective_header_pass_or_strip(mode: str, tmp_path: pathlib.Path) -> None:
    """``--objective-header strip`` drops the client's x-llm-d-inference-objective and its alias
    x-gateway-inference-objective before ext_proc (so before the picker reads it, and before the
    replica); ``pass`` (the default, GIE's design) lets both through."""
    st = Stack(Procs(tmp_path), [free_port(), free_port()])
    try:
        st.start_upstreams()
        st.start_picker()
        st.start_envoy("--objective-header", mode)
        deadline = time.monotonic() + 20
        while post_json(st.url + "/v1/completions", {"model": "m", "prompt": "w"})[0] != 200:
            assert time.monotonic() < deadline, st.procs.log("envoy")
            time.sleep(0.2)
        for name in ("x-llm-d-inference-objective", "x-gateway-inference-objective"):
            hdr = {name: "critical"}
            status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "p"}, headers=hdr)
            assert status == 200, body
            seen = body["gateway_headers"].get(name)
            assert seen == (None if mode == "strip" else "critical"), (name, body)
    finally:
        st.procs.stop()

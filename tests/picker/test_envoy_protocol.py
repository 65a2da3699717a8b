"""The endpoint-picker protocol's MUSTs through a real Envoy (GIE proposal 004):
one destination value in header and metadata, the served endpoint credited, the subset hint."""

from __future__ import annotations

import pathlib
import subprocess
import time
from typing import Any

import pytest
import yaml

from kvlaunch import PY, ROOT, Procs, Stack, free_port, post_json

pytestmark = pytest.mark.envoy


def _pool_config(st: Stack, endpoints: list[int], **render: str) -> dict[str, Any]:
    """deploy/envoy/render.py's pool (override_host) config, rendered for this stack."""
    st.envoy_port = st.envoy_port or free_port()
    args = [
        PY,
        str(ROOT / "deploy/envoy/render.py"),
        "--listen-port",
        str(st.envoy_port),
        "--admin-port",
        str(free_port()),
        "--picker",
        f"127.0.0.1:{st.grpc_port}",
        "--upstream",
        "pool",
        "--endpoints",
        ",".join(f"127.0.0.1:{p}" for p in endpoints),
        *st.client_cert_args,
    ]
    for k, v in render.items():
        args += [f"--{k.replace('_', '-')}", v]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    doc = yaml.safe_load(out)
    assert isinstance(doc, dict)
    return doc


def _walk(node: Any, name: str) -> list[dict[str, Any]]:
    """Every mapping under ``node`` whose ``name`` is ``name``."""
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        if node.get("name") == name:
            found.append(node)
        for v in node.values():
            found += _walk(v, name)
    elif isinstance(node, list):
        for v in node:
            found += _walk(v, name)
    return found


def _wait_served(st: Stack, ports: list[int]) -> None:
    deadline = time.monotonic() + 20
    while True:
        status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "warmup"})
        if status == 200 and body["served_by"] in ports:
            return
        assert time.monotonic() < deadline, (status, body, st.procs.log("envoy"))
        time.sleep(0.2)


def test_served_fallback_is_credited(tmp_path: pathlib.Path) -> None:
    """The primary's port is closed, so Envoy serves the fallback and says so in the response
    metadata: in-flight counts, the prefix index and the pick all land on the fallback."""
    procs = Procs(tmp_path)
    closed = free_port()
    st = Stack(procs, [free_port()])
    try:
        st.start_upstreams()
        live = st.upstreams[0]
        st.start_picker(
            "--scrape-interval", "3600", "--policy", "round-robin", "--fallbacks", "1",
            endpoints=[closed, live],
        )  # fmt: skip
        # The shipped pool config reports the served host (render.py's _report_served).
        st.start_envoy(config=yaml.safe_dump(_pool_config(st, [closed, live])))
        _wait_served(st, [live])
        for i in range(6):  # round-robin: the closed port is primary for half of these
            status, body = post_json(
                st.url + "/v1/completions", {"model": "m", "prompt": f"prompt {i} " * 40}
            )
            assert status == 200 and body["served_by"] == live, body
            assert body["dest_header"].split(",")[0] in (f"127.0.0.1:{closed}", f"127.0.0.1:{live}")
        eps = st.wait_in_flight_zero()
        assert eps[f"127.0.0.1:{closed}"]["index_blocks"] == 0, eps
        assert eps[f"127.0.0.1:{live}"]["index_blocks"] > 0, eps
    finally:
        procs.stop()


def test_header_and_metadata_carry_one_value(tmp_path: pathlib.Path) -> None:
    """With fallbacks the header carries the same list as the metadata, and an override_host
    upstream still routes to the primary."""
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port(), free_port()])
    try:
        st.start_upstreams()
        st.start_picker("--fallbacks", "1")
        st.start_envoy(config=yaml.safe_dump(_pool_config(st, st.upstreams)))
        _wait_served(st, st.upstreams)
        for i in range(4):
            status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": f"q{i}"})
            assert status == 200, body
            primary, fallback = body["dest_header"].split(",")
            assert primary == f"127.0.0.1:{body['served_by']}" and fallback != primary
    finally:
        procs.stop()


def _with_subset(doc: dict[str, Any], subset: list[str]) -> dict[str, Any]:
    """The gateway's subset hint (``envoy.lb.subset_hint`` metadata) set before ext_proc runs."""
    (hcm,) = _walk(doc, "envoy.filters.network.http_connection_manager")
    filters = hcm["typed_config"]["http_filters"]
    (ext,) = _walk(filters, "envoy.filters.http.ext_proc")
    ext["typed_config"]["metadata_options"] = {"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]}}
    hint = {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "value": {"x-gateway-destination-endpoint-subset": subset},
                }
            ],
        },
    }
    filters.insert(filters.index(ext), hint)
    return doc


@pytest.mark.parametrize("which", ["first", "empty", "foreign"])
def test_subset_hint_is_honoured(tmp_path: pathlib.Path, which: str) -> None:
    """Only endpoints in the gateway's subset are picked; an empty subset, or one naming no pool
    endpoint, is the protocol's 503. A client-sent subset header steers nothing."""
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port(), free_port()])
    try:
        st.start_upstreams()
        st.start_picker()
        subset = {"first": [f"127.0.0.1:{st.upstreams[0]}"], "empty": [], "foreign": ["127.0.0.1:1"]}[which]
        st.start_envoy(config=yaml.safe_dump(_with_subset(_pool_config(st, st.upstreams), subset)))
        time.sleep(0.3)
        forged = {"x-gateway-destination-endpoint-subset": f"127.0.0.1:{st.upstreams[1]}"}
        for i in range(8):
            deadline = time.monotonic() + 10
            while True:
                status, body = post_json(
                    st.url + "/v1/completions", {"model": "m", "prompt": f"subset {i} " * 30}, forged
                )
                if status not in (502, 503) or which != "first" or time.monotonic() > deadline:
                    break
                time.sleep(0.2)  # Envoy still connecting to the picker
            if which == "first":
                assert status == 200 and body["served_by"] == st.upstreams[0], body
            else:
                assert status == 503 and body["error"]["type"] == "no_endpoints", (status, body)
    finally:
        procs.stop()


def test_ipv6_endpoints_route_end_to_end(tmp_path: pathlib.Path) -> None:
    """An IPv6 replica ("[::1]:port"): scraped, picked, and reached through Envoy's ORIGINAL_DST."""
    import socket

    procs = Procs(tmp_path)
    st = Stack(procs, [free_port()])
    try:
        port = st.upstreams[0]
        proc = procs.start("up6", [PY, "-m", "kvlaunch.upstream", "--ports", str(port), "--host", "::1"])
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("::1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.05)
        st.start_picker("--endpoints", f"[::1]:{port}", "--scrape-interval", "0.1")  # the last wins
        st.start_envoy()
        key = f"[::1]:{port}"
        deadline = time.monotonic() + 10
        while st.endpoints().get(key, {}).get("health") != "ready":
            assert time.monotonic() < deadline, st.endpoints()
            time.sleep(0.1)
        _wait_served(st, [port])
        status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "over IPv6"})
        assert status == 200 and body["served_by"] == port and body["dest_header"] == key, body
        st.wait_in_flight_zero()
    finally:
        procs.stop()

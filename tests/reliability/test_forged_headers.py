"""Forged routing headers never steer routing, in every shipped Envoy config (the committed
deploy/envoy/*.yaml and the kind gateway's): a client's destination, subset, served, rewrite and
x-envoy-* headers neither move a request off the endpoint the picker chose, nor change its model (either
spelling of the rewrite header: llm-d's x-llm-d-model-name-rewrite and its x-gateway-* alias),
nor reach the replica. With fail-open and the picker killed, they still choose nothing."""

from __future__ import annotations

import pathlib
import signal
import time
from typing import Any

import pytest

from kvlaunch import Procs, Stack, envoy_configs, free_port, post_json
from kvlaunch.envoy_configs import ALL

pytestmark = [pytest.mark.reliability, pytest.mark.envoy]
DOC = "A shared system prompt that spans several blocks, for the forged-header test. " * 20


def forged(other: str) -> list[dict[str, str]]:
    """Header sets that would send a request to ``other`` (or rewrite it) if Envoy or the picker
    honoured them."""
    return [
        {"x-gateway-destination-endpoint": other},
        {"x-gateway-destination-endpoint-subset": other},
        {"x-gateway-destination-endpoint-served": other},
        {"x-gateway-model-name-rewrite": "evil"},
        {"x-llm-d-model-name-rewrite": "evil"},
        {"X-LLM-D-Model-Name-Rewrite": "evil", "x-gateway-model-name-rewrite": "evil2"},
        {"x-envoy-original-dst-host": other},
        {"x-prefiller-host-port": other},  # P/D: a host the decode pod's sidecar would call
        {"x-envoy-upstream-alt-stat-name": "evil", "x-envoy-max-retries": "50", "x-envoy-retry-on": "5xx"},
        {"X-Gateway-Destination-Endpoint": other, "X-Envoy-Original-Dst-Host": other},
        {
            "x-gateway-destination-endpoint": other,
            "x-gateway-destination-endpoint-subset": other,
            "x-gateway-model-name-rewrite": "evil",
            "x-llm-d-model-name-rewrite": "evil",
            "x-envoy-original-dst-host": other,
        },
    ]


def _complete(st: Stack, prompt: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    return post_json(st.url + "/v1/completions", {"model": "m", "prompt": prompt}, headers=headers)


def _start(tmp: pathlib.Path, name: str) -> Stack:
    st = Stack(Procs(tmp), [free_port(), free_port()])
    st.start_upstreams()
    # The pool config reads fallbacks from the picker's list; the others take one endpoint.
    st.start_picker(*(("--fallbacks", "1") if name == "envoy-fallback.yaml" else ()))
    envoy_configs.start_envoy(st, name)
    deadline = time.monotonic() + 20
    while _complete(st, "warmup")[0] != 200:
        assert time.monotonic() < deadline, st.procs.log("envoy")
        time.sleep(0.2)
    return st


def _assert_untouched(body: Any, home: int | None, upstreams: list[int], headers: dict[str, str]) -> None:
    """Served where the picker (or fail-open's fallback) chose, model unchanged, and none of the
    forged headers reached the replica (Envoy's own x-envoy-external-address may)."""
    assert body["served_by"] in upstreams
    if home is not None:
        assert body["served_by"] == home, f"a forged header moved the request: {body}"
    assert body["model"] == "m", f"a forged rewrite reached the replica: {body}"
    seen = body["gateway_headers"]
    leaked = {k.lower() for k in headers} & set(seen) - {"x-gateway-destination-endpoint"}
    assert not leaked, f"forged headers reached the replica: {seen}"
    if "x-gateway-destination-endpoint" in seen:
        primary = seen["x-gateway-destination-endpoint"].split(",")[0]  # primary[,fallbacks]
        assert primary == f"127.0.0.1:{body['served_by']}", seen


@pytest.mark.parametrize("name", ALL)
def test_forged_headers_never_steer(name: str, tmp_path: pathlib.Path) -> None:
    st = _start(tmp_path, name)
    try:
        status, body = _complete(st, DOC)
        assert status == 200
        home = body["served_by"]
        other = f"127.0.0.1:{next(p for p in st.upstreams if p != home)}"
        for headers in forged(other):
            status, body = _complete(st, DOC, headers)
            assert status == 200, (headers, body)
            _assert_untouched(body, home, st.upstreams, headers)
            assert body["dest_header"].split(",")[0] == f"127.0.0.1:{home}", body
        st.wait_in_flight_zero()
        if name != "envoy-failopen.yaml":
            return
        # Fail-open with the picker gone: the fallback route picks; a forged header still cannot.
        st.procs.signal("picker", signal.SIGKILL).wait(10)
        for target in st.upstreams:  # 32 requests aimed at target: least-request spreads them anyway
            served = []
            for headers in forged(f"127.0.0.1:{target}"):
                for _ in range(4):
                    status, body = _complete(st, DOC, headers)
                    assert status == 200, (headers, body)
                    _assert_untouched(body, None, st.upstreams, headers)
                    assert body["dest_header"] == ""
                    served.append(body["served_by"])
            assert set(served) == set(st.upstreams), f"forged headers pinned fail-open routing to {target}"
    finally:
        st.procs.stop()

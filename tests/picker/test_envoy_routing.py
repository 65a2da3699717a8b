"""Routing through a real Envoy: requests go where the picker says, with prefix affinity."""

from __future__ import annotations

import collections
import pathlib
import subprocess
import time

import pytest
import yaml

from kvlaunch import PY, ROOT, Procs, Stack, free_port, http, post_json, stack

pytestmark = pytest.mark.envoy

DOC = "You are a meticulous assistant. Answer using the attached handbook. " * 30


def complete(st: Stack, prompt: str, **extra: object) -> tuple[int, dict[str, object]]:
    status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": prompt, **extra})
    assert isinstance(body, dict), body
    return status, body


def test_requests_reach_the_endpoint_the_picker_names(envoy_stack: Stack) -> None:
    for i in range(6):
        status, body = complete(envoy_stack, f"question {i}")
        assert status == 200
        assert body["dest_header"] == f"127.0.0.1:{body['served_by']}"


def test_same_long_prefix_sticks_and_distinct_prefixes_spread(envoy_stack: Stack) -> None:
    served = {complete(envoy_stack, DOC + f" Question {i}?")[1]["served_by"] for i in range(8)}
    assert len(served) == 1, f"a shared 2 KB prefix should stay on one endpoint, went to {served}"
    spread = collections.Counter(
        complete(envoy_stack, f"{i} unrelated topic number {i} " * 20)[1]["served_by"] for i in range(24)
    )
    assert len(spread) == 2, f"distinct prefixes should use both endpoints: {spread}"


def test_overloaded_endpoint_stops_winning(envoy_stack: Stack) -> None:
    home = complete(envoy_stack, DOC + " first")[1]["served_by"]
    other = next(p for p in envoy_stack.upstreams if p != home)
    # The endpoint holding the prefix now reports a deep queue and a full KV cache.
    post_json(f"http://127.0.0.1:{home}/control", {"waiting": 200, "kv": 0.99, "running": 64})
    deadline = time.monotonic() + 10
    while envoy_stack.endpoints()[f"127.0.0.1:{home}"]["waiting"] < 200:
        assert time.monotonic() < deadline, "picker never scraped the overload"
        time.sleep(0.1)
    served = {complete(envoy_stack, DOC + f" again {i}")[1]["served_by"] for i in range(5)}
    assert served == {other}


def test_forged_destination_header_is_never_honoured(envoy_stack: Stack) -> None:
    home = complete(envoy_stack, DOC + " forged")[1]["served_by"]
    other = next(p for p in envoy_stack.upstreams if p != home)
    for _ in range(5):
        status, body = post_json(
            envoy_stack.url + "/v1/completions",
            {"model": "m", "prompt": DOC + " forged"},
            headers={"x-gateway-destination-endpoint": f"127.0.0.1:{other}"},
        )
        assert status == 200 and body["served_by"] == home


def test_forged_header_to_a_foreign_port_is_ignored(envoy_stack: Stack) -> None:
    status, body = post_json(
        envoy_stack.url + "/v1/completions",
        {"model": "m", "prompt": "hi"},
        headers={"x-gateway-destination-endpoint": "127.0.0.1:1"},
    )
    assert status == 200 and body["served_by"] in envoy_stack.upstreams


def test_bodiless_get_goes_to_a_ready_endpoint(envoy_stack: Stack) -> None:
    status, body, _ = http("GET", envoy_stack.url + "/v1/models")
    assert status == 200 and b"served_by" in body


def test_client_sent_model_rewrite_header_is_stripped(envoy_stack: Stack) -> None:
    """Only the gateway may rewrite the model: Envoy drops the client's header before ext_proc (the
    picker's rewrite itself is tested in test_exchange.py)."""
    status, body = post_json(
        envoy_stack.url + "/v1/completions",
        {"model": "m", "prompt": "hi"},
        headers={"x-gateway-model-name-rewrite": "evil"},
    )
    assert status == 200 and body["model"] == "m"


def test_model_rewrite_set_by_a_trusted_gateway_rewrites_the_body(tmp_path: pathlib.Path) -> None:
    """The gateway's own header (here a filter after the client-header strip, as an HTTPRoute's
    model rewrite would be) reaches the picker, which trusts it with --trust-gateway-headers."""
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port(), free_port()])
    try:
        st.start_upstreams()
        st.start_picker("--trust-gateway-headers", "true")
        st.envoy_port = free_port()
        args = ["--listen-port", str(st.envoy_port), "--admin-port", str(free_port())]
        args += ["--picker", f"127.0.0.1:{st.grpc_port}", *st.client_cert_args]
        doc = yaml.safe_load(
            subprocess.run(
                [PY, str(ROOT / "deploy/envoy/render.py"), *args], check=True, capture_output=True, text=True
            ).stdout
        )
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        gateway_rewrite = {
            "name": "gateway.model_rewrite",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                "mutations": {"request_mutations": [{"append": {
                    "header": {"key": "x-gateway-model-name-rewrite", "value": "m-lora"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}]},
            },
        }  # fmt: skip
        hcm["http_filters"].insert(0, gateway_rewrite)  # after the (early) strip, before ext_proc
        st.start_envoy(config=yaml.safe_dump(doc))
        deadline = time.monotonic() + 20
        while (got := post_json(st.url + "/v1/completions", {"model": "m", "prompt": "hi"}))[0] != 200:
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        assert got[1]["model"] == "m-lora"
    finally:
        procs.stop()


def test_in_flight_returns_to_zero(envoy_stack: Stack) -> None:
    for i in range(5):
        complete(envoy_stack, f"count {i}")
    eps = envoy_stack.wait_in_flight_zero()
    assert sum(e["index_blocks"] for e in eps.values()) > 0


def test_saturated_pool_sheds_only_sheddable_objectives(tmp_path: pathlib.Path) -> None:
    cfg = tmp_path / "objectives.yaml"
    cfg.write_text("objectives: {batch: -1, chat: {priority: 5}}\n")
    with stack(tmp_path, picker_args=("--config-file", str(cfg), "--scrape-interval", "0.1")) as st:
        for p in st.upstreams:
            post_json(f"http://127.0.0.1:{p}/control", {"waiting": 500, "running": 64})
        deadline = time.monotonic() + 10
        while min(e["waiting"] for e in st.endpoints().values()) < 500:
            assert time.monotonic() < deadline, "picker never scraped the overload"
            time.sleep(0.1)
        obj = "x-gateway-inference-objective"
        status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "q"}, {obj: "batch"})
        assert status == 429 and body["error"]["type"] == "overloaded", body
        for headers in ({obj: "chat"}, {}, {obj: "unknown"}):
            status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "q"}, headers)
            assert status == 200, (headers, body)
        assert http("GET", st.url + "/v1/models", headers={obj: "batch"})[0] == 200, "bodiless: never shed"

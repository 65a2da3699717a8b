"""The gateway routes only the inference API to the pool (render.py --allowed-paths), in every
shipped Envoy config: any other path (a replica's /reset_prefix_cache, /metrics, /tokenize, a
traversal to them) gets Envoy's own JSON 404, or a 400 for an escaped slash, and never reaches a
replica. Checked with the simulator: its prefix cache survives a forged /reset_prefix_cache."""

from __future__ import annotations

import json
import pathlib
import signal

import pytest

from kvlaunch import PY, Procs, Stack, envoy_configs, free_port, http, post_json, wait_port
from kvlaunch.envoy_configs import SHIPPED

pytestmark = [pytest.mark.reliability, pytest.mark.envoy]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = "You are a careful assistant. " * 20  # 9 full blocks of 16 tokens
FORBIDDEN = [
    ("POST", "/reset_prefix_cache"),
    ("POST", "/reset_prefix_cache?reset_running_requests=true"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("GET", "/health"),
    ("POST", "/admin/fault"),
    ("POST", "/v1/completionsX"),
    ("POST", "/v1/completions/../../reset_prefix_cache"),
    ("POST", "/v1/completions/%2e%2e/%2e%2e/reset_prefix_cache"),
    ("POST", "//reset_prefix_cache"),
    ("POST", "/"),
]
ESCAPED = ("POST", "/v1/completions%2F..%2F..%2Freset_prefix_cache")
"""An escaped slash: Envoy refuses the request (400) rather than guess what the replica decodes."""


def _cached(url: str) -> int:
    status, body = post_json(url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    assert status == 200, body
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("name", list(SHIPPED))
def test_only_inference_paths_reach_the_replicas(name: str, tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    port = free_port()
    st = Stack(procs, [port])
    try:
        sim = procs.start("sim", [PY, "-m", "replica.sim", "--port", str(port), "--profile", "cpu-test"])
        wait_port(port, proc=sim)
        st.start_picker(endpoints=[port])
        envoy_configs.start_envoy(st, name)
        st.wait_routable({"model": MODEL, "prompt": "warmup", "max_tokens": 1})
        assert _cached(st.url) == 0 and _cached(st.url) == 144, "the prompt's 9 blocks are cached"
        for method, path in [*FORBIDDEN, ESCAPED]:
            status, body, headers = http(method, st.url + path, b"{}" if method == "POST" else None)
            if (method, path) == ESCAPED:
                assert status == 400, (path, status, body)
                continue
            assert status == 404, (path, status, body)
            assert headers.get("content-type") == "application/json", (path, headers)
            assert json.loads(body)["error"]["type"] == "not_found", (path, body)
        assert _cached(f"http://127.0.0.1:{port}") == 144, "the replica's cache is untouched"
        # The inference paths still reach the replica.
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert post_json(st.url + "/v1/chat/completions", chat)[0] == 200
        status, body, _ = http("GET", st.url + "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL, body
        for path in ("/v1/responses", "/v1/messages", "/v1/embeddings"):  # routed; the sim has none
            status, body, _ = http("POST", st.url + path, json.dumps({"model": MODEL, "input": "x"}).encode())
            assert b"not_found" not in body and status != 503, (path, status, body)
        if name == "envoy-failopen.yaml":  # the picker down: still 404, never the fallback replica
            procs.signal("picker", signal.SIGKILL).wait(10)
            assert http("POST", st.url + "/reset_prefix_cache", b"{}")[0] == 404
            assert _cached(f"http://127.0.0.1:{port}") == 144
    finally:
        procs.stop()

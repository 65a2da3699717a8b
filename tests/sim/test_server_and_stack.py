"""The simulator's HTTP server over loopback, and `make run` end to end."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import PY, ROOT, Procs, free_port, http, post_json, wait_port

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = "You are a careful assistant. " * 20  # 580 chars = 145 tokens = 9 full blocks of 16


@pytest.fixture
def sim(tmp_path: pathlib.Path):  # type: ignore[no-untyped-def]
    procs = Procs(tmp_path)
    port = free_port()
    proc = procs.start("sim", [PY, "-m", "replica.sim", "--port", str(port), "--profile", "cpu-test"])
    wait_port(port, proc=proc)
    yield f"http://127.0.0.1:{port}"
    procs.close()


def metrics(url: str) -> dict[str, float]:
    _, body, _ = http("GET", url + "/metrics")
    return {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def test_completion_reports_cached_tokens_and_metrics(sim: str) -> None:
    status, first = post_json(sim + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert status == 200 and first["usage"]["prompt_tokens"] == 145
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, second = post_json(
        sim + "/v1/completions", {"model": MODEL, "prompt": PROMPT + " again", "max_tokens": 4}
    )
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 144, "9 full blocks of 16 hit"
    m = metrics(sim)
    assert m["vllm:prefix_cache_hits_total"] == 144
    assert m["vllm:prefix_cache_queries_total"] == 145 + 147
    assert m["vllm:request_success_total"] == 2
    assert "vllm:kv_cache_usage_perc" in m and "vllm:time_to_first_token_seconds_count" in m


def test_streaming_chat_and_errors(sim: str) -> None:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    ).encode()
    status, raw, _ = http("POST", sim + "/v1/chat/completions", body)
    events = [e[6:] for e in raw.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, None, "length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert post_json(sim + "/v1/completions", {"model": "nope", "prompt": "x"})[0] == 404
    assert http("POST", sim + "/v1/completions", b"{bad")[0] == 400
    assert post_json(sim + "/reset_prefix_cache", {})[0] == 200


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.envoy
def test_make_run_serves_through_envoy_and_stops_cleanly() -> None:
    ports = {k: free_port() for k in ("port", "picker-port", "metrics-port", "admin-port")}
    base = free_port()
    while not _closed(base + 1):
        base = free_port()
    args = " ".join(f"--{k} {v}" for k, v in ports.items()) + f" --base-port {base} --once"
    args += " --sim-args '--profile cpu-test'"
    proc = subprocess.Popen(
        ["make", "-s", "run", "REPLICAS=2", f"RUN_ARGS={args}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_port(ports["port"], timeout=90, proc=proc)
        deadline = time.monotonic() + 30
        while (
            res := post_json(
                f"http://127.0.0.1:{ports['port']}/v1/completions",
                {"model": MODEL, "prompt": "hello", "max_tokens": 2},
            )
        )[0] != 200:
            assert time.monotonic() < deadline, res
            time.sleep(0.3)
        assert res[1]["usage"]["completion_tokens"] == 2
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    text = out.decode()
    # Ctrl-C reaches make too, which then reports the interrupt itself; the stack must have stopped.
    assert proc.returncode in (0, -signal.SIGINT, 2, 130), text
    assert "curl -s http://127.0.0.1:" in text and "stopped" in text
    for port in [*ports.values(), base, base + 1]:
        assert _closed(port), f"port {port} still open after Ctrl-C"

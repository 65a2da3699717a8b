"""Flow control through a real Envoy: a request held while the pool is saturated outlives Envoy's
ext_proc message timeout (the picker extends it) and is routed when room frees; a client that
disconnects while queued leaves the queue at once; a sheddable request gets 429 with Retry-After
at its TTL; SIGTERM answers every queued request before the picker exits.

Saturation is set through the fake upstreams' gauges (``POST /control {"waiting": n}``): the load
model prices a replica with 500 waiting requests far past one typical request's prefill."""

from __future__ import annotations

import json
import pathlib
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvlaunch import Stack, http, post_json, stack

pytestmark = pytest.mark.envoy

TTL_S = 4.0
MESSAGE_TIMEOUT = "1s"
BODY = json.dumps({"model": "m", "prompt": "held until there is room"}).encode()


@pytest.fixture
def flow_stack(tmp_path: pathlib.Path) -> Iterator[Stack]:
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(
        json.dumps({"objectives": {"batch": -1}, "flowControl": {"enabled": True, "ttl_s": TTL_S}})
    )
    with stack(
        tmp_path,
        picker_args=("--config-file", str(cfg), "--scrape-interval", "0.05", "--drain-timeout", "30"),
        envoy_args=("--message-timeout", MESSAGE_TIMEOUT),
    ) as st:
        yield st


def saturate(st: Stack, on: bool) -> None:
    for p in st.upstreams:
        assert post_json(f"http://127.0.0.1:{p}/control", {"waiting": 500 if on else 0})[0] == 200
    want = 500.0 if on else 0.0
    deadline = time.monotonic() + 10
    while any(e["waiting"] != want for e in st.endpoints().values()):
        assert time.monotonic() < deadline, "the picker never scraped the new gauges"
        time.sleep(0.05)


def metric(st: Stack, name: str, **labels: str) -> float:
    """The sum of ``name``'s series whose labels include ``labels``, from the picker's /metrics."""
    _, text, _ = http("GET", f"http://127.0.0.1:{st.metrics_port}/metrics")
    total = 0.0
    for line in text.decode().splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_for(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def send(
    st: Stack, out: list[tuple[int, bytes, dict[str, str]]], headers: dict[str, str] | None = None
) -> threading.Thread:
    t = threading.Thread(
        target=lambda: out.append(http("POST", st.url + "/v1/completions", BODY, headers, timeout=60))
    )
    t.start()
    return t


def test_held_past_the_message_timeout_then_routed(flow_stack: Stack) -> None:
    st = flow_stack
    saturate(st, True)
    got: list[tuple[int, bytes, dict[str, str]]] = []
    t = send(st, got)
    wait_for(lambda: metric(st, "flow_control_queue_size") == 1)
    time.sleep(2.5)  # 2.5 × Envoy's message timeout
    assert not got and t.is_alive(), f"answered while saturated: {got}"
    assert sum(e["in_flight_requests"] for e in st.endpoints().values()) == 0, "queued is not in flight"
    saturate(st, False)
    t.join(timeout=15)
    [(status, body, _)] = got
    assert status == 200, body
    assert json.loads(body)["served_by"] in st.upstreams
    assert metric(st, "flow_control_queue_size") == 0
    assert metric(st, "flow_control_requests_total", outcome="dispatched", priority="0") >= 1
    st.wait_in_flight_zero()


def test_disconnect_while_queued_leaves_the_queue(flow_stack: Stack) -> None:
    st = flow_stack
    before = metric(st, "flow_control_requests_total", outcome="dispatched")
    saturate(st, True)
    req = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY
    with socket.create_connection(("127.0.0.1", st.envoy_port)) as s:
        s.sendall(req)
        wait_for(lambda: metric(st, "flow_control_queue_size") == 1)
    wait_for(lambda: metric(st, "flow_control_queue_size") == 0)
    assert metric(st, "flow_control_requests_total", outcome="cancelled") == 1
    assert sum(e["in_flight_requests"] for e in st.endpoints().values()) == 0
    saturate(st, False)
    status, _, _ = http("POST", st.url + "/v1/completions", BODY)  # the queue still serves
    assert status == 200
    assert metric(st, "flow_control_requests_total", outcome="dispatched") == before + 1


def test_sheddable_gets_429_with_retry_after_at_its_ttl(flow_stack: Stack) -> None:
    st = flow_stack
    saturate(st, True)
    got: list[tuple[int, bytes, dict[str, str]]] = []
    start = time.monotonic()
    send(st, got, {"x-llm-d-inference-objective": "batch"}).join(timeout=TTL_S + 15)
    waited = time.monotonic() - start
    [(status, body, headers)] = got
    assert status == 429, body
    assert json.loads(body)["error"]["code"] == 429
    assert int(headers["retry-after"]) >= 1
    assert waited >= TTL_S - 0.5
    assert metric(st, "flow_control_requests_total", outcome="evicted_ttl", priority="-1") == 1
    assert metric(st, "flow_control_queue_size") == 0


def test_sigterm_answers_every_queued_request(flow_stack: Stack) -> None:
    st = flow_stack
    saturate(st, True)
    got: list[tuple[int, bytes, dict[str, str]]] = []
    threads = [send(st, got) for _ in range(3)]
    wait_for(lambda: metric(st, "flow_control_queue_size") == 3)
    picker = next(p for n, p in st.procs.procs if n == "picker")
    picker.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=30)
    assert sorted(s for s, _, _ in got) == [200, 200, 200], got
    assert picker.wait(timeout=30) == 0, st.procs.log("picker")
    assert "3 queued requests dispatched or answered" in st.procs.log("picker")

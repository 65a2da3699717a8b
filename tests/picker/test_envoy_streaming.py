"""SSE passes through intact; in-flight accounting survives normal ends, aborts and resets."""

from __future__ import annotations

import http.client as http_client
import json
import socket
import time

import pytest

from kvlaunch import Stack, http

pytestmark = pytest.mark.envoy


def test_sse_passes_through_intact(envoy_stack: Stack) -> None:
    body = json.dumps({"model": "m", "prompt": "stream me", "stream": True, "chunks": 20}).encode()
    status, raw, headers = http("POST", envoy_stack.url + "/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert [json.loads(e[6:])["i"] for e in events[:-1]] == list(range(20))
    envoy_stack.wait_in_flight_zero()


def test_client_abort_does_not_leak_in_flight(envoy_stack: Stack) -> None:
    body = json.dumps({"model": "m", "prompt": "slow", "stream": True, "chunks": 50, "delay": 0.1}).encode()
    req = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", envoy_stack.envoy_port)) as s:
        s.sendall(req)
        s.settimeout(10)
        got = b""
        while b"data:" not in got:
            chunk = s.recv(4096)
            assert chunk, f"connection closed before the first event: {got!r}"
            got += chunk
        busy = sum(e["in_flight_requests"] for e in envoy_stack.endpoints().values())
        assert busy == 1
    envoy_stack.wait_in_flight_zero()


def _upstream_stats(st: Stack) -> dict[int, dict[str, float]]:
    return {p: json.loads(http("GET", f"http://127.0.0.1:{p}/stats")[1]) for p in st.upstreams}


def test_upstream_reset_does_not_leak_in_flight(envoy_stack: Stack) -> None:
    """The chosen upstream serves the request and aborts its connection after event 2; the client
    sees a truncated stream, and the picker's in-flight accounting still returns to zero."""
    before = _upstream_stats(envoy_stack)
    body = json.dumps(
        {"model": "m", "prompt": "reset", "stream": True, "chunks": 10, "reset_after": 2}
    ).encode()
    with pytest.raises((http_client.IncompleteRead, ConnectionError)) as err:
        http("POST", envoy_stack.url + "/v1/completions", body, timeout=10)
    after = _upstream_stats(envoy_stack)
    served = {p: after[p]["served"] - before[p]["served"] for p in after}
    resets = {p: after[p]["resets"] - before[p]["resets"] for p in after}
    [port] = [p for p, n in resets.items() if n]
    assert resets[port] == 1 and sum(resets.values()) == 1, f"one upstream reset: {resets}"
    assert served == {p: int(p == port) for p in served}, f"the request reached that upstream: {served}"
    if isinstance(err.value, http_client.IncompleteRead):  # headers and some events got through
        events = [e for e in err.value.partial.decode().split("\n\n") if e]
        assert "data: [DONE]" not in events
        assert all(json.loads(e[6:])["served_by"] == port for e in events)
    envoy_stack.wait_in_flight_zero()


def test_many_concurrent_streams_return_to_zero(envoy_stack: Stack) -> None:
    import concurrent.futures

    body = json.dumps(
        {"model": "m", "prompt": "concurrent", "stream": True, "chunks": 5, "delay": 0.01}
    ).encode()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(
            pool.map(lambda _: http("POST", envoy_stack.url + "/v1/completions", body)[0], range(48))
        )
    assert results == [200] * 48
    time.sleep(0.1)
    envoy_stack.wait_in_flight_zero()

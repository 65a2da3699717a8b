"""One-trip request bodies through a real Envoy (``render.py --one-trip-under``): Envoy sends a small
body STREAMED right behind the headers, without waiting for their answer; the picker answers the
headers with the destination once the body is whole, and each chunk. The route and host are chosen
only after that answer, a forged destination header never chooses them, bad bodies get the same
4xx, a body in several chunks (split inside a UTF-8 sequence) arrives whole, the request stays in
flight while its response streams, and a picker that dies holding the request fails open or
closed as configured."""

from __future__ import annotations

import collections.abc
import hashlib
import json
import os
import pathlib
import signal
import socket
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvlaunch import Procs, Stack, free_port, http, post_json, stack

pytestmark = pytest.mark.envoy
ONE_TRIP = ("--one-trip-under", "65536")
MAX_BODY = 16 * 1024
"""The picker's --max-body-bytes here: an oversize body that still goes in one trip."""


@pytest.fixture(scope="module")
def one_trip(tmp_path_factory: pytest.TempPathFactory) -> collections.abc.Iterator[Stack]:
    picker = ("--max-body-bytes", str(MAX_BODY))
    with stack(tmp_path_factory.mktemp("one-trip"), picker_args=picker, envoy_args=ONE_TRIP) as st:
        yield st


def _messages(st: Stack) -> dict[str, float]:
    """The picker's ``kvpick_extproc_messages_total`` by kind."""
    text = http("GET", f"http://127.0.0.1:{st.metrics_port}/metrics")[1].decode()
    fams = [f for f in text_string_to_metric_families(text) if f.name == "kvpick_extproc_messages"]
    return {s.labels["kind"]: s.value for f in fams for s in f.samples if s.name.endswith("_total")}


def _send(st: Stack, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, object]]:
    status, raw, _ = http("POST", st.url + "/v1/completions", body, headers)
    return status, json.loads(raw)


def test_small_bodies_go_in_one_trip_where_the_picker_says(one_trip: Stack) -> None:
    """The picker answers the headers only once the body is in: that these are served at all
    shows Envoy sent each body without waiting for that answer, and routed after it."""
    before = _messages(one_trip)
    for i in range(4):
        status, body = post_json(one_trip.url + "/v1/completions", {"model": "m", "prompt": f"trip {i}"})
        assert status == 200 and body["dest_header"] == f"127.0.0.1:{body['served_by']}", body
    after = _messages(one_trip)
    got = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert got["request_headers"] == 4 and got["request_body"] == 8, got  # HTTP/1.1: data, empty end
    assert got.get("response_headers", 0.0) == 0, f"the config skips them: {got}"
    one_trip.wait_in_flight_zero()


def test_a_forged_destination_never_chooses_the_upstream(one_trip: Stack) -> None:
    prompt = "You are a meticulous assistant. " * 40
    home = post_json(one_trip.url + "/v1/completions", {"model": "m", "prompt": prompt})[1]["served_by"]
    other = next(p for p in one_trip.upstreams if p != home)
    for forged in (f"127.0.0.1:{other}", "127.0.0.1:1"):
        status, body = post_json(
            one_trip.url + "/v1/completions",
            {"model": "m", "prompt": prompt},
            headers={"x-gateway-destination-endpoint": forged},
        )
        assert status == 200 and body["served_by"] == home, (forged, body)


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b'{"model": "m", "prompt": ', 400, "not valid JSON"),
        (b'{"prompt": "no model here"}', 400, "model"),
        (b'{"model": "m", "prompt": "\xff\xfe bad utf-8"}', 400, "not valid JSON"),
        (b'{"model": "m", "prompt": "' + b"a" * MAX_BODY + b'"}', 413, "exceeds"),
    ],
    ids=["malformed", "missing-model", "invalid-utf8", "oversize"],
)
def test_bad_bodies_get_the_same_4xx(one_trip: Stack, body: bytes, status: int, needle: str) -> None:
    got, doc = _send(one_trip, body)
    assert got == status and needle in str(doc["error"]), doc
    assert _send(one_trip, b'{"model": "m", "prompt": "still serving"}')[0] == 200


def test_a_body_in_several_chunks_arrives_whole(one_trip: Stack) -> None:
    """Written in three pieces with pauses (Envoy sends each as it reads it), the first cut inside
    a two-byte UTF-8 sequence, the second inside the JSON: every chunk is answered, the body
    arrives byte-identical where the picker chose."""
    body = json.dumps({"model": "m", "prompt": "ünïcødé " * 400}, ensure_ascii=False).encode()
    cut = body.index("ü".encode()) + 1
    pieces = [body[:cut], body[cut : len(body) // 2], body[len(body) // 2 :]]
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    before = _messages(one_trip)
    got = b""
    with socket.create_connection(("127.0.0.1", one_trip.envoy_port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(head)
        for piece in pieces:
            time.sleep(0.15)
            s.sendall(piece)
        while chunk := s.recv(65536):
            got += chunk
    status_line, _, rest = got.partition(b"\r\n")
    assert b" 200 " in status_line, got[:300]
    doc = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert doc["sha256"] == hashlib.sha256(body).hexdigest() and doc["bytes"] == len(body), doc
    assert doc["dest_header"] == f"127.0.0.1:{doc['served_by']}", doc
    bodies = _messages(one_trip)["request_body"] - before["request_body"]
    assert bodies >= 3, f"{bodies} body messages for a body written in three pieces"
    one_trip.wait_in_flight_zero()


def test_the_request_stays_in_flight_while_its_response_streams(one_trip: Stack) -> None:
    """Envoy 1.40 closes the ext_proc stream once nothing of the request or response is left to
    send it; the config keeps response trailers SEND so that the stream, and the picker's
    accounting, last as long as the HTTP stream."""
    doc = {"model": "m", "prompt": "stream me", "stream": True, "chunks": 8, "delay": 0.25}
    out: list[tuple[int, bytes, dict[str, str]]] = []
    t = threading.Thread(
        target=lambda: out.append(http("POST", one_trip.url + "/v1/completions", json.dumps(doc).encode()))
    )
    t.start()
    time.sleep(1.0)
    mid = sum(e["in_flight_requests"] for e in one_trip.endpoints().values())
    t.join(10)
    assert mid == 1, f"in flight mid-stream: {mid}"
    status, raw, _ = out[0]
    assert status == 200 and raw.count(b"data: ") == 9 and raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
    one_trip.wait_in_flight_zero()


@pytest.mark.parametrize("mode", ["open", "close"])
def test_a_picker_that_dies_holding_the_request(tmp_path: pathlib.Path, mode: str) -> None:
    """The picker is stopped, so that it holds the headers and body unanswered, then killed: the
    stream resets with the request in Envoy's hands. Fail-open sends it to the fallback; fail-close
    answers 5xx."""
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port(), free_port()])
    try:
        st.start_upstreams()
        picker = st.start_picker()
        args = ["--failure-mode", mode, *ONE_TRIP]
        if mode == "open":
            args += ["--fallback", ",".join(st.addresses)]
        st.start_envoy(*args)
        st.wait_routable()
        os.kill(picker.pid, signal.SIGSTOP)
        result: list[tuple[int, object]] = []
        held = {"model": "m", "prompt": "held"}
        t = threading.Thread(target=lambda: result.append(post_json(st.url + "/v1/completions", held)))
        t.start()
        time.sleep(0.5)  # Envoy has sent the headers and the body; nothing is answered
        assert not result, result
        os.kill(picker.pid, signal.SIGKILL)
        t.join(15)
        status, body = result[0]
        if mode == "open":
            assert status == 200 and isinstance(body, dict) and body["served_by"] in st.upstreams, body
        else:
            assert status >= 500, (status, body)
    finally:
        procs.stop()

"""The data path through a real Envoy: what the picker receives per request in the shipped default
config (BUFFERED request body: one message for the headers, one for the body; nothing of the
response, whose headers the picker skips per request), where the response headers still come, and
a streamed response through GIE's own test config (which sends response bodies
FULL_DUPLEX_STREAMED: each chunk is echoed unchanged)."""

from __future__ import annotations

import json
import pathlib
import socket
import threading
import time

import pytest
import yaml

from bench.reliability.slowbody import dechunk
from kvlaunch import Procs, Stack, free_port, post_json, stack
from tests.support.metrics import extproc_messages

pytestmark = pytest.mark.envoy
DATA = pathlib.Path(__file__).parent / "data"


def _stream(st: Stack, chunks: int, delay: float = 0.0) -> bytes:
    """A streamed completion's raw HTTP response (``Connection: close``: read to EOF)."""
    doc = {"model": "m", "prompt": "stream me", "stream": True, "chunks": chunks, "delay": delay}
    body = json.dumps(doc).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    got = b""
    with socket.create_connection(("127.0.0.1", st.envoy_port), timeout=30) as s:
        s.sendall(head + body)
        while chunk := s.recv(65536):
            got += chunk
    return got


def _events(raw: bytes) -> list[bytes]:
    """The SSE ``data:`` payloads of a chunked HTTP/1.1 response, in order."""
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n", 1)[0], head
    body = dechunk(chunked)
    return [line[len(b"data: ") :] for line in body.split(b"\n\n") if line.startswith(b"data: ")]


def _check_stream(events: list[bytes], chunks: int) -> None:
    assert events[-1] == b"[DONE]", events[-3:]
    docs = [json.loads(e) for e in events[:-1]]
    assert [d["i"] for d in docs] == list(range(chunks)), "events lost, duplicated or reordered"


def _four_requests(st: Stack) -> dict[str, float]:
    """Messages by kind for 3 plain requests and 1 streamed one, all answered in full."""
    before = extproc_messages(st)
    for i in range(3):
        status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": f"plain {i}"})
        assert status == 200, body
    _check_stream(_events(_stream(st, 40)), 40)
    st.wait_in_flight_zero()  # the end of each request still reached accounting
    after = extproc_messages(st)
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def test_shipped_default_config_sends_the_picker_two_messages_per_request(tmp_path: pathlib.Path) -> None:
    with stack(tmp_path) as st:
        got = _four_requests(st)
    assert got["request_headers"] == 4 and got["request_body"] == 4, got
    assert got["response_headers"] == 0, f"response headers not skipped: {got}"
    assert got.get("response_body", 0.0) == 0, f"the picker received response bodies: {got}"


@pytest.mark.parametrize(
    ("envoy_args", "picker_args"),
    [
        ((), ("--response-headers", "always")),
        (("--body-mode", "FULL_DUPLEX_STREAMED"), ()),
    ],
    ids=["buffered-always", "full-duplex"],
)
def test_response_headers_where_they_cannot_or_must_not_be_skipped(
    envoy_args: tuple[str, ...], picker_args: tuple[str, ...], tmp_path: pathlib.Path
) -> None:
    """With BUFFERED bodies, ``--response-headers always`` takes them; in FULL_DUPLEX_STREAMED
    Envoy ignores the picker's per-request override (the headers are answered after the body).
    The requests still work."""
    with stack(tmp_path, picker_args=picker_args, envoy_args=envoy_args) as st:
        got = _four_requests(st)
    assert got["request_headers"] == 4 and got["response_headers"] == 4, got


def test_without_response_bodies_a_stream_stays_in_flight_until_it_ends(tmp_path: pathlib.Path) -> None:
    """The ext_proc stream ends with the HTTP stream, not after the response headers: a streamed
    response is counted in flight for its whole length."""
    with stack(tmp_path) as st:
        out: list[bytes] = []
        t = threading.Thread(target=lambda: out.append(_stream(st, 10, delay=0.3)))
        t.start()
        time.sleep(1.2)  # headers and a few events are through; about 2 s of stream left
        mid = sum(e["in_flight_requests"] for e in st.endpoints().values())
        t.join(10)
        assert mid == 1, f"in flight mid-stream: {mid}"
        _check_stream(_events(out[0]), 10)
        st.wait_in_flight_zero()


def test_streamed_response_through_gie_test_config(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port(), free_port()], mtls=False)  # GIE's config presents no client cert
    try:
        st.start_upstreams()
        st.start_picker()
        st.envoy_port = free_port()
        cfg = (DATA / "gie_test_envoy.yaml").read_text()
        cfg = cfg.replace("@LISTEN@", str(st.envoy_port)).replace("@ADMIN@", str(free_port()))
        st.start_envoy(config=cfg.replace("@EPP@", str(st.grpc_port)))
        deadline = time.monotonic() + 30
        while post_json(st.url + "/v1/completions", {"model": "m", "prompt": "w"})[0] != 200:
            assert time.monotonic() < deadline, procs.log("envoy")[-2000:]
            time.sleep(0.3)
        before = extproc_messages(st).get("response_body", 0.0)
        _check_stream(_events(_stream(st, 200)), 200)
        st.wait_in_flight_zero()
        assert extproc_messages(st)["response_body"] > before, (
            "GIE's config streams response bodies via ext_proc"
        )
    finally:
        procs.stop()


def _skip_request_headers(node: object, keep_route_header: bool) -> None:
    """The rendered config, edited in place: ext_proc SKIPs the request headers (the body comes
    alone, one message each way); without ``keep_route_header`` the ORIGINAL_DST route no longer
    requires the destination header either (the path allowlist's ``:path`` match is kept)."""
    if isinstance(node, dict):
        mode = node.get("processing_mode")
        if isinstance(mode, dict) and "request_header_mode" in mode:
            mode["request_header_mode"] = "SKIP"
        match = node.get("match")
        if not keep_route_header and isinstance(match, dict):  # the path allowlist's route stays
            kept = [h for h in match.pop("headers", []) if h["name"] == ":path"]
            if kept:
                match["headers"] = kept
        for v in node.values():
            _skip_request_headers(v, keep_route_header)
    elif isinstance(node, list):
        for v in node:
            _skip_request_headers(v, keep_route_header)


@pytest.mark.parametrize(("keep_route_header", "status"), [(True, 404), (False, 503)])
def test_the_destination_cannot_ride_on_the_body_alone(
    keep_route_header: bool, status: int, tmp_path: pathlib.Path
) -> None:
    """Why the picker must take the request headers (a message each way for them, not just the
    body's): with
    ``request_header_mode: SKIP`` Envoy 1.40's ext_proc lets the headers through at once
    (``decodeHeaders`` returns Continue), so the router matches the route and ORIGINAL_DST picks
    its host before the body is even sent; the body answer's header mutation finds no headers
    to change (``handleBodyResponse``: "headers aren't available"). The route that requires the
    destination header gives 404; without that requirement ORIGINAL_DST has no host: 503. Both
    are Envoy's local replies at the headers, before the picker could answer anything. A
    future Envoy that routes after the body would fail this test: then one message each way is
    possible."""
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port(), free_port()])
    try:
        st.start_upstreams()
        st.start_picker()
        cfg = yaml.safe_load(st.render_envoy())
        _skip_request_headers(cfg, keep_route_header)
        st.start_envoy(config=yaml.safe_dump(cfg))
        before = extproc_messages(st)
        deadline = time.monotonic() + 20
        got = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "one message"})
        while isinstance(got[1], dict) and time.monotonic() < deadline:  # the picker's JSON 503
            time.sleep(0.3)  # until its first scrape; then the answer is Envoy's own
            got = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "one message"})
        assert got == (status, "" if status == 404 else "no healthy upstream"), got
        after = extproc_messages(st)
        assert after.get("request_headers", 0.0) == before.get("request_headers", 0.0), after
    finally:
        procs.stop()

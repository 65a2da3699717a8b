"""Large request bodies through a real Envoy and the shipped configs. Under fail-close (the default)
bodies of at least 1 MiB, or of unknown size, are FULL_DUPLEX_STREAMED to the picker and smaller
ones stay BUFFERED (render.py's ``--stream-bodies-over``); fail-open buffers every body, so that a
large body still fails open. The 8 MiB body must arrive whole where the picker chose in both; a
small body must still cost the picker two messages."""

from __future__ import annotations

import hashlib
import pathlib
import signal
import socket
import subprocess
import time

import orjson
import pytest

from kvlaunch import PY, Procs, Stack, envoy_configs, free_port, post_json
from kvlaunch.procs import ROOT
from tests.support.metrics import extproc_messages

pytestmark = pytest.mark.envoy
LIMIT = 8 * 1024 * 1024
"""The picker's default --max-body-bytes."""


def _big_body(salt: str) -> bytes:
    """A completions body just under the picker's limit."""
    words = "lorem ipsum dolor sit amet consectetur "
    prompt = salt + words * ((LIMIT - 256) // len(words))
    body = orjson.dumps({"model": "m", "prompt": prompt})
    assert LIMIT - 1024 < len(body) <= LIMIT, len(body)
    return body


def _post(st: Stack, body: bytes, chunked: bool = False) -> tuple[int, dict[str, object]]:
    """POST ``body`` over HTTP/1.1, with a content-length or chunked (no declared size)."""
    size = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{size}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    if chunked:
        step = 300_000
        body = (
            b"".join(
                b"%x\r\n%s\r\n" % (len(body[i : i + step]), body[i : i + step])
                for i in range(0, len(body), step)
            )
            + b"0\r\n\r\n"
        )
    got = b""
    with socket.create_connection(("127.0.0.1", st.envoy_port), timeout=60) as s:
        s.sendall(head + body)
        while chunk := s.recv(65536):
            got += chunk
    status_line, _, rest = got.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), orjson.loads(payload) if payload.startswith(b"{") else {}


def _stack(tmp: pathlib.Path, name: str) -> Stack:
    st = Stack(Procs(tmp), [free_port(), free_port()])
    st.start_upstreams()
    st.start_picker()
    envoy_configs.start_envoy(st, name)
    st.wait_routable()
    return st


@pytest.mark.parametrize(("name", "streamed"), [("envoy.yaml", True), ("envoy-failopen.yaml", False)])
def test_an_8_mib_body_is_routed_whole_and_streamed_where_it_can_be_small_ones_stay_buffered(
    tmp_path: pathlib.Path, name: str, streamed: bool
) -> None:
    st = _stack(tmp_path, name)
    try:
        before = extproc_messages(st)
        status, small = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "small"})
        assert status == 200 and small["dest_header"], small
        mid = extproc_messages(st)
        assert mid["request_body"] - before["request_body"] == 1, "a small body left BUFFERED mode"
        for chunked in (False, True):
            body = _big_body(f"chunked={chunked} ")
            status, got = _post(st, body, chunked)
            assert status == 200, (status, got)
            assert got["bytes"] == len(body) and got["sha256"] == hashlib.sha256(body).hexdigest()
            assert got["dest_header"] == f"127.0.0.1:{got['served_by']}", got  # the picker chose
        after = extproc_messages(st)
        bodies = after["request_body"] - mid["request_body"]
        assert bodies > 4 if streamed else bodies == 2, f"{bodies} body messages for two 8 MiB bodies"
        assert after["request_headers"] - mid["request_headers"] == 2
        st.wait_in_flight_zero()
    finally:
        st.procs.stop()


def test_a_body_over_the_limit_streamed_gets_the_pickers_413(tmp_path: pathlib.Path) -> None:
    st = _stack(tmp_path, "envoy.yaml")
    try:
        status, got = _post(st, _big_body("x") + b" " * 2048)
        assert status == 413 and got["error"]["code"] == 413, (status, got)  # type: ignore[index]
        st.wait_in_flight_zero()
    finally:
        st.procs.stop()


def test_fail_open_with_the_picker_killed_serves_a_large_body(tmp_path: pathlib.Path) -> None:
    """The reason fail-open buffers every body: a streamed one would be answered 500."""
    st = _stack(tmp_path, "envoy-failopen.yaml")
    try:
        st.procs.signal("picker", signal.SIGKILL).wait(10)
        time.sleep(1.0)
        body = _big_body("down ")
        status, got = _post(st, body)
        assert status == 200 and got["bytes"] == len(body) and got["dest_header"] == "", (status, got)
    finally:
        st.procs.stop()


def test_render_refuses_to_stream_bodies_with_fail_open() -> None:
    render = [PY, str(ROOT / "deploy/envoy/render.py"), "--failure-mode", "open", "--fallback", "127.0.0.1:1"]
    done = subprocess.run([*render, "--stream-bodies-over", "1048576"], capture_output=True, text=True)
    assert done.returncode == 2 and "fail-open cannot stream" in done.stderr, done.stderr

"""How Envoy frames a large BUFFERED body on its way to the picker, seen on the wire: a TCP tap
between Envoy and a plaintext picker parses the HTTP/2 frames Envoy sends. With render.py's
default codec towards the picker (nghttp2, Envoy's) a 220 KB body is fourteen 16 KiB DATA frames;
with ``--picker-h2-codec oghttp2`` it is one, as large as the picker's SETTINGS allow (what each
costs: ``bench/results/datapath.md``)."""

from __future__ import annotations

import pathlib
import socket
import threading

import orjson
import pytest

from kvlaunch import Procs, Stack, free_port, post_json

pytestmark = pytest.mark.envoy
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA = 0
BODY = 220_000


class Tap:
    """Forwards one port to another and records the length of every DATA frame the connecting
    side (Envoy) sends. ``sizes`` has one writer: the thread reading Envoy's side."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.sizes: list[int] = []
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, parse: bool) -> None:
        buf = b""
        preface = parse
        try:
            while chunk := src.recv(1 << 20):
                dst.sendall(chunk)
                if not parse:
                    continue
                buf += chunk
                if preface:
                    if len(buf) < len(PREFACE):
                        continue
                    assert buf.startswith(PREFACE), f"not cleartext HTTP/2: {buf[:24]!r}"
                    buf, preface = buf[len(PREFACE) :], False
                while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                    size = int.from_bytes(buf[:3], "big")
                    if buf[3] == DATA:
                        self.sizes.append(size)
                    buf = buf[9 + size :]
        except OSError:
            pass
        finally:
            dst.close()


@pytest.mark.parametrize("codec", ["oghttp2", "nghttp2"])
def test_large_body_frames(codec: str, tmp_path: pathlib.Path) -> None:
    st = Stack(Procs(tmp_path), [free_port()])
    tap: Tap | None = None
    try:
        st.start_upstreams()
        st.start_picker("--secure-serving=false")
        tap = Tap(st.grpc_port)
        picker_port, st.grpc_port = st.grpc_port, tap.port  # Envoy dials the tap
        st.start_envoy("--plaintext", "--picker-h2-codec", codec)
        st.grpc_port = picker_port
        st.wait_routable()
        before = len(tap.sizes)
        doc = {"model": "m", "prompt": "x" * BODY, "max_tokens": 1}
        assert len(orjson.dumps(doc)) > BODY
        status, _ = post_json(st.url + "/v1/completions", doc)
        assert status == 200
        big = [s for s in tap.sizes[before:] if s > 1000]  # the body's, not the headers' answers
        if codec == "oghttp2":
            assert len(big) == 1 and big[0] > BODY, f"not one DATA frame for the body: {big}"
        else:
            assert len(big) >= 13 and max(big) <= 16384, f"not 16 KiB DATA frames: {big}"
    finally:
        if tap is not None:
            tap.close()
        st.procs.stop()

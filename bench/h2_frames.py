"""``python -m bench.h2_frames``: how Envoy sizes the HTTP/2 DATA frames it sends to an ext_proc
server, per codec and per advertised ``SETTINGS_MAX_FRAME_SIZE`` (issue 24):

    flock /tmp/kvpick-heavy.lock python -m bench.h2_frames      # grpclib: the bench extra

Envoy runs with ``deploy/envoy/render.py``'s config (plaintext to ext_proc, so the frames can be
read), its picker clusters on its default HTTP/2 codec (nghttp2) or on oghttp2
(:func:`bench.extproc_floor.oghttp2_pickers`), in front of one ``kvlaunch.upstream --fixed``. The ext_proc server is
:func:`bench.extproc_floor.serve_grpclib` (grpclib over the pure-Python h2, 4 MiB windows, so
flow control does not cut frames), with h2 patched to advertise the given maximum frame size and to
log every DATA frame's length. Each configuration sends a few chat bodies of ``--size`` bytes
through Envoy and prints, for the streams that carried a body, the DATA frames per stream and
their largest length.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import pathlib
import sys
import tempfile
import time
from typing import Any

import aiohttp

from kvlaunch.procs import PY, Procs, free_port, wait_port
from kvlaunch.stack import Stack

from .extproc_floor import CHAT, oghttp2_pickers, send, serve_grpclib

FRAME_SIZES = (1 << 14, (1 << 24) - 1)
"""The HTTP/2 default and maximum ``SETTINGS_MAX_FRAME_SIZE``."""
CODECS = {"nghttp2": False, "oghttp2": True}


def serve_probe(port: int, destination: str, max_frame: int, log: str) -> None:
    """:func:`serve_grpclib` in plaintext, advertising ``max_frame`` and appending each received
    DATA frame's ``stream_id length`` to ``log``."""
    import h2.connection
    import h2.events
    from h2.settings import SettingCodes

    init, receive = h2.connection.H2Connection.initiate_connection, h2.connection.H2Connection.receive_data
    out = open(log, "a", buffering=1)  # noqa: SIM115 (open until the process is killed)

    def initiate_connection(self: Any) -> None:
        init(self)
        self.update_settings({SettingCodes.MAX_FRAME_SIZE: max_frame})

    def receive_data(self: Any, data: Any) -> list[Any]:
        events: list[Any] = receive(self, data)
        for e in events:
            if isinstance(e, h2.events.DataReceived):
                out.write(f"{e.stream_id} {e.flow_controlled_length}\n")
        return events

    h2.connection.H2Connection.initiate_connection = initiate_connection  # type: ignore[method-assign]
    h2.connection.H2Connection.receive_data = receive_data  # type: ignore[method-assign]
    serve_grpclib(port, destination, "", tls=False, linger=False)


def summary(log: pathlib.Path, min_stream_bytes: int) -> str:
    """DATA frames per body-carrying stream and the largest frame, from ``log``."""
    per_stream: dict[int, list[int]] = collections.defaultdict(list)
    for line in log.read_text().split("\n"):
        if line:
            sid, n = map(int, line.split())
            per_stream[sid].append(n)
    bodies = [f for f in per_stream.values() if sum(f) >= min_stream_bytes]
    if not bodies:
        return "no body-carrying stream seen"
    counts = sorted({len(f) for f in bodies})
    return (
        f"{len(bodies)} streams; DATA frames per stream {counts}; "
        f"largest frame {max(max(f) for f in bodies)} B; bytes per stream {sorted({sum(f) for f in bodies})}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.h2_frames", description=__doc__)
    p.add_argument("--size", type=int, default=400 * 1024, help="chat body bytes")
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--destination", default="", help=argparse.SUPPRESS)
    p.add_argument("--log", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve_probe(args.port, args.destination, args.serve, args.log)
        return 0
    from bench.datapath import make_body

    body = make_body(args.size, stream=False)
    with tempfile.TemporaryDirectory(prefix="kvpick-bench-h2frames-") as tmp:
        root = pathlib.Path(tmp)
        upstream = [free_port()]
        for codec, oghttp2 in CODECS.items():
            for max_frame in FRAME_SIZES:
                run_dir = root / f"{codec}-{max_frame}"
                run_dir.mkdir()
                st = Stack(Procs(run_dir), upstream, grpc_port=free_port())
                log = run_dir / "frames.log"
                try:
                    st.start_upstreams("--fixed")
                    config = st.render_envoy("--plaintext")
                    st.start_envoy(config=oghttp2_pickers(config) if oghttp2 else config)
                    cmd = [PY, "-m", "bench.h2_frames", "--serve", str(max_frame), "--log", str(log)]
                    cmd += ["--port", str(st.grpc_port), "--destination", st.addresses[0]]
                    proc = st.procs.start("server", cmd)
                    wait_port(st.grpc_port, procs=st.procs, proc=proc)

                    async def go(st: Stack = st) -> list[int]:
                        async with aiohttp.ClientSession() as http:
                            deadline = time.monotonic() + 30
                            while (await send(http, st.url + CHAT, body, 1, 1.0)) != [200]:
                                if time.monotonic() > deadline:
                                    raise RuntimeError(st.procs.log("envoy")[-2000:])
                                await asyncio.sleep(0.2)
                            return await send(http, st.url + CHAT, body, args.requests, 5.0)

                    statuses = asyncio.run(go())
                    time.sleep(0.3)
                finally:
                    st.procs.stop()
                print(
                    f"{codec}, SETTINGS_MAX_FRAME_SIZE {max_frame}: {statuses.count(200)}/{len(statuses)} "
                    f"answered 200; {summary(log, args.size)}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

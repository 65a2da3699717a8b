"""Small requests beside one long prompt, sent chunked or with a content-length (issue 23): the
small requests' latencies (p50, p90, max) and how many took over 1 s, through
a real Envoy (the default rendered config), the picker and simulated replicas.

    python -m bench.body_load                     # this tree
    PYTHONPATH=/path/to/other/tree python /path/to/this/bench/body_load.py   # another tree's picker

Prints one line per body shape.
"""

from __future__ import annotations

import argparse
import pathlib
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from kvlaunch import PY, Procs, Stack, free_port, post_json, wait_port

WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit "


def long_body(size: int) -> bytes:
    """A completions body of about ``size`` bytes (about size / 4 prompt tokens), one output token."""
    body = orjson.dumps({"model": "m", "prompt": "long " + WORDS * (size // len(WORDS)), "max_tokens": 1})
    assert abs(len(body) - size) < 1024, len(body)
    return body


def post_raw(port: int, body: bytes, chunked: bool, out: dict[str, Any]) -> None:
    """POST ``body`` over HTTP/1.1, chunked (no declared size) or with a content-length; records
    the status and the seconds it took in ``out``."""
    size = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{size}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    wire = body
    if chunked:
        step = 64 * 1024
        parts = (body[i : i + step] for i in range(0, len(body), step))
        wire = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    start = time.monotonic()
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head + wire)
        while chunk := s.recv(65536):
            got += chunk
    out["status"] = int(got.split(b" ", 2)[1])
    out["seconds"] = time.monotonic() - start


def start_stack(procs: Procs, replicas: int, time_scale: float) -> Stack:
    """Simulated replicas (``time_scale`` slows their prefill), the picker and Envoy as the
    default config renders it, routable; ``procs`` owns every process (the caller stops it)."""
    ports = [free_port() for _ in range(replicas)]
    for i, port in enumerate(ports):
        args = ["--port", str(port), "--model", "m", "--time-scale", str(time_scale)]
        procs.start(f"replica-{i}", [PY, "-m", "replica.sim", *args])
    st = Stack(procs, ports)
    st.start_picker()
    for port in ports:
        wait_port(port, 60, procs=procs)
    st.start_envoy()
    st.wait_routable({"model": "m", "prompt": "warm", "max_tokens": 1})
    return st


def run(chunked: bool, size: int, replicas: int, smalls: int, time_scale: float) -> dict[str, Any]:
    """One stack: the long prompt, then ``smalls`` small requests 4 at a time once it is routed."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = Procs(pathlib.Path(tmp))
        try:
            st = start_stack(procs, replicas, time_scale)
            long: dict[str, Any] = {}
            sender = threading.Thread(target=post_raw, args=(st.envoy_port, long_body(size), chunked, long))
            sender.start()
            time.sleep(1.0)  # the body is through and routed
            docs = [{"model": "m", "prompt": f"small {i} " + WORDS, "max_tokens": 4} for i in range(smalls)]

            def small(doc: dict[str, Any]) -> float:
                start = time.monotonic()
                status, _ = post_json(st.url + "/v1/completions", doc)
                assert status == 200, status
                return time.monotonic() - start

            with ThreadPoolExecutor(4) as pool:
                took = sorted(pool.map(small, docs))
            sender.join(120)
            return {
                "p50": statistics.median(took),
                "p90": took[int(0.9 * (len(took) - 1))],
                "max": took[-1],
                "long_s": long.get("seconds", float("nan")),
                "waited_over_1s": sum(t > 1.0 for t in took),
            }
        finally:
            procs.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=600_000, help="long body bytes (600 kB: about 150k tokens)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--smalls", type=int, default=16)
    p.add_argument("--time-scale", type=float, default=0.4, help="the simulator's --time-scale")
    a = p.parse_args(argv)
    for chunked in (False, True):
        r = run(chunked, a.size, a.replicas, a.smalls, a.time_scale)
        shape = "chunked       " if chunked else "content-length"
        print(
            f"{shape} long {r['long_s']:5.1f} s | small p50 {r['p50']:.2f} s p90 {r['p90']:.2f} s "
            f"max {r['max']:.2f} s, {r['waited_over_1s']}/{a.smalls} over 1 s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

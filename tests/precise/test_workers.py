"""``python -m picker --workers 2``: two processes share the pod's ports (SO_REUSEPORT) behind a
real Envoy, agree through the peer channel (ipc), and the second ends with the first."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import time

import pytest

from kvlaunch import Procs, Stack, free_port, http

pytestmark = [pytest.mark.precise, pytest.mark.envoy, pytest.mark.timeout(120)]


def listeners(port: int) -> int:
    """LISTEN sockets on ``port`` (one per worker with SO_REUSEPORT)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as fh:
            for line in fh.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                n += state == "0A" and int(local.rsplit(":", 1)[1], 16) == port
    return n


def worker_children(pid: int) -> list[int]:
    """Child processes that are picker workers (not, e.g., the body-parsing process)."""
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
        kids = [int(c) for c in fh.read().split()]
    out = []
    for k in kids:
        with open(f"/proc/{k}/cmdline", "rb") as fh:
            if b"--worker-index" in fh.read():
                out.append(k)
    return out


def test_two_workers_share_the_ports(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port(), free_port()])
    try:
        st.start_upstreams()
        st.start_picker("--workers", "2")
        st.start_envoy()
        st.wait_routable()
        st.wait_in_flight_zero()
        picker = next(p for n, p in procs.procs if n == "picker")
        deadline = time.monotonic() + 20
        while listeners(st.grpc_port) < 2 or listeners(st.metrics_port) < 2:
            assert time.monotonic() < deadline, procs.log("picker")
            time.sleep(0.2)
        (child,) = worker_children(picker.pid)
        for i in range(40):
            body = json.dumps({"model": "m", "prompt": "shared prefix " * 40 + str(i)}).encode()
            status, out, _ = http(
                "POST", st.url + "/v1/completions", body, {"content-type": "application/json"}
            )
            assert status == 200, out
        os.kill(picker.pid, signal.SIGKILL)  # worker 0 dies without stopping the other
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child}") and _state(child) != "Z":
            assert time.monotonic() < deadline, "the second worker outlived the first"
            time.sleep(0.2)
    finally:
        procs.stop()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"

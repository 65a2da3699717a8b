"""Data-parallel ranks (vLLM publishes rank r's KV events on the event port + r): two simulator
ranks on one host, serving on their own ports (the chart's one targetPort per rank), each caching
its own prefix. With ``--data-parallel-ports`` the picker's index holds each rank's blocks under
that rank's endpoint: it picks the rank holding a prefix, and its predicted cached tokens equal
what each rank reports. Without the option both endpoints subscribe to rank 0's stream and this
test fails (seen)."""

from __future__ import annotations

import contextlib
import json
import pathlib
import socket

import pytest

from kvlaunch import PY, Procs, Stack, free_port, http, wait_port
from tests.precise.test_picker_precise import MODEL, debug, wait_for

pytestmark = [pytest.mark.precise, pytest.mark.timeout(240)]


def start_rank(procs: Procs, port: int, ev: int, rank: int) -> None:
    args = ["--port", str(port), "--profile", "cpu-test", "--time-scale", "0.2"]
    args += ["--data-parallel-rank", str(rank), "--kv-events-port", str(ev)]
    proc = procs.start(f"rank{rank}", [PY, "-m", "replica.sim", *args])
    wait_for(
        lambda: proc.poll() is None and _healthy(port), f"rank {rank} up: {procs.log(f'rank{rank}')}", 30
    )


def event_ports(n: int) -> int:
    """A base port with the ``n - 1`` ports above it free too (rank r publishes on base + r)."""
    while True:
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for p in range(base, base + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            except OSError:
                continue
            return base


def send(key: str, prompt: list[int]) -> int:
    """Complete ``prompt`` on the rank at ``key`` directly; its cached tokens."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    status, out, _ = http("POST", f"http://{key}/v1/completions", body, {"content-type": "application/json"})
    assert status == 200, out
    return int(json.loads(out)["usage"]["prompt_tokens_details"]["cached_tokens"])


def _healthy(port: int) -> bool:
    with contextlib.suppress(OSError):
        return http("GET", f"http://127.0.0.1:{port}/health", timeout=1)[0] == 200
    return False


def test_each_rank_feeds_its_own_endpoint(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    ports, ev = [free_port(), free_port()], event_ports(2)
    st = Stack(procs, ports)
    try:
        for rank, port in enumerate(ports):
            start_rank(procs, port, ev, rank)
        eps = ",".join(f"127.0.0.1:{p}" for p in ports)
        dp = ",".join(map(str, ports))
        st.start_picker(
            "--endpoints",
            eps,
            "--prefix-mode",
            "precise",
            "--kv-events-port",
            str(ev),
            "--data-parallel-ports",
            dp,
        )
        wait_port(st.debug_port)  # the debug API opens after the ports start_picker waits for
        wait_for(lambda: all(e["health"] == "ready" for e in st.endpoints().values()), "ranks ready", 30)
        keys = [f"127.0.0.1:{p}" for p in ports]
        docs = [[7 + i, *range(1000 * (i + 2), 1000 * (i + 2) + 16 * 8)] for i in range(2)]
        for key, doc in zip(keys, docs, strict=True):  # rank r caches prefix r
            assert send(key, [*doc, 1]) == 0
        wait_for(lambda: [st.endpoints()[k]["precise_blocks"] for k in keys] == [8, 8], "each rank's events")
        for holder, doc in zip(keys, docs, strict=True):
            ex = debug(st, "explain", {"model": MODEL, "prompt": [*doc, 2]})
            assert ex["chosen"] == [holder], ex
            for key in keys:  # each rank asked directly: its cached tokens are what its index says
                est = ex["endpoints"][key]["cached_tokens_est"]
                assert est == (8 * 16 if key == holder else 0), ex
                assert send(key, [*doc, 3]) == est, (key, ex)
    finally:
        procs.stop()

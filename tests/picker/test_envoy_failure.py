"""Failure handling through a real Envoy: fallbacks, fail-open/close, dead replicas, body modes."""

from __future__ import annotations

import pathlib
import time

import pytest

from kvlaunch import Procs, Stack, free_port, post_json, stack

pytestmark = pytest.mark.envoy

DOC = "Shared system prompt for the fallback test, long enough to span blocks. " * 20


def test_fallback_serves_when_primary_port_is_closed(tmp_path: pathlib.Path) -> None:
    """Pool upstream: the picker names a closed port first; Envoy retries the next in its list."""
    procs = Procs(tmp_path)
    closed = free_port()  # nothing listens here
    st = Stack(procs, [free_port()])
    try:
        st.start_upstreams()
        # The picker knows both; scrape interval is long so the dead port stays "unknown" (routable).
        st.start_picker(
            "--scrape-interval",
            "3600",
            "--policy",
            "round-robin",
            "--fallbacks",
            "2",
            endpoints=[closed, st.upstreams[0]],
        )
        eps = f"127.0.0.1:{closed},127.0.0.1:{st.upstreams[0]}"
        st.start_envoy("--upstream", "pool", "--endpoints", eps)
        time.sleep(0.5)
        served = []
        for i in range(6):  # round-robin makes the closed port primary for half of these
            status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": f"p{i}"})
            assert status == 200, body
            served.append(body["served_by"])
        assert set(served) == {st.upstreams[0]}
    finally:
        procs.stop()


@pytest.mark.parametrize("mode", ["open", "close"])
def test_failure_mode_when_picker_is_down(tmp_path: pathlib.Path, mode: str) -> None:
    with _pool_stack(tmp_path, mode) as st:
        assert post_json(st.url + "/v1/completions", {"model": "m", "prompt": "up"})[0] == 200
        st.procs.stop("picker")
        status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "down"})
        if mode == "open":
            assert status == 200 and body["served_by"] in st.upstreams, body
        else:
            assert status == 503, (status, body)  # ext_proc's status_on_error, not Envoy's default 500


class _pool_stack:
    def __init__(self, tmp: pathlib.Path, mode: str) -> None:
        self.procs = Procs(tmp)
        self.st = Stack(self.procs, [free_port(), free_port()])
        self.mode = mode

    def __enter__(self) -> Stack:
        st = self.st
        st.start_upstreams()
        st.start_picker()
        eps = ",".join(f"127.0.0.1:{p}" for p in st.upstreams)
        st.start_envoy("--upstream", "pool", "--failure-mode", self.mode, "--endpoints", eps)
        deadline = time.monotonic() + 20
        while post_json(st.url + "/v1/completions", {"model": "m", "prompt": "w"})[0] != 200:
            assert time.monotonic() < deadline, self.procs.log("envoy")
            time.sleep(0.2)
        return st

    def __exit__(self, *exc: object) -> None:
        self.procs.stop()


def test_dead_replica_stops_receiving_traffic(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port(), free_port()])
    try:
        # Each upstream in its own process so one can die.
        from kvlaunch import PY, wait_port

        for i, port in enumerate(st.upstreams):
            proc = procs.start(f"up{i}", [PY, "-m", "kvlaunch.upstream", "--ports", str(port)])
            wait_port(port, proc=proc)
        st.start_picker()
        st.start_envoy()
        home = post_json(st.url + "/v1/completions", {"model": "m", "prompt": DOC})[1]["served_by"]
        victim = st.upstreams.index(home)
        procs.stop(f"up{victim}")
        deadline = time.monotonic() + 10
        while st.endpoints()[f"127.0.0.1:{home}"]["health"] != "unreachable":
            assert time.monotonic() < deadline, st.endpoints()
            time.sleep(0.1)
        for i in range(5):
            status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": DOC + str(i)})
            assert status == 200 and body["served_by"] != home
    finally:
        procs.stop()


def test_buffered_body_mode(tmp_path: pathlib.Path) -> None:
    with stack(tmp_path, n=2, envoy_args=("--body-mode", "BUFFERED")) as st:
        homes = {
            post_json(st.url + "/v1/completions", {"model": "m", "prompt": DOC + str(i)})[1]["served_by"]
            for i in range(4)
        }
        assert len(homes) == 1
        status, body = post_json(st.url + "/v1/completions", {"prompt": "x"})
        assert status == 400 and "model" in str(body)


def test_no_ready_endpoint_gives_503(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port()])
    try:
        st.start_picker("--scrape-interval", "0.1", endpoints=[st.upstreams[0]])  # nothing listens there
        st.start_envoy()
        deadline = time.monotonic() + 10
        while st.endpoints()[f"127.0.0.1:{st.upstreams[0]}"]["health"] != "unreachable":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        status, body = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "x"})
        assert status == 503 and body["error"]["type"] == "no_endpoints"
    finally:
        procs.stop()

"""Dead and hung engines leave the routable set (real simulator replicas, real Envoy).

The simulator's test-only fault API (``--enable-fault-api``) fails ``/health`` (a dead engine
behind a live API server) or freezes the engine (a hung GPU) while ``/metrics`` still answers.
Bounds (scrape interval 0.2 s, timeout 1 s, stall_after_s 1 s here): UNHEALTHY within
interval + timeout; STALLED within stall_after_s + interval of the first request it holds."""

from __future__ import annotations

import json
import pathlib
import threading
import time
from collections.abc import Iterator

import pytest

from kvlaunch import PY, Procs, Stack, free_port, http, post_json, wait_port

pytestmark = pytest.mark.envoy


@pytest.fixture
def sims(tmp_path: pathlib.Path) -> Iterator[Stack]:
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port(), free_port()])
    cfg = tmp_path / "picker.yaml"
    cfg.write_text("scrape: {interval_s: 0.2, timeout_s: 1.0, stall_after_s: 1.0}\n")
    try:
        for i, port in enumerate(st.upstreams):
            args = ["--port", str(port), "--model", "m", "--profile", "cpu-test", "--enable-fault-api"]
            proc = procs.start(f"sim{i}", [PY, "-m", "replica.sim", *args])
            wait_port(port, proc=proc)
        st.start_picker("--config-file", str(cfg), "--policy", "round-robin")
        st.start_envoy()
        deadline = time.monotonic() + 20
        while not all(e["health"] == "ready" for e in st.endpoints().values()):
            assert time.monotonic() < deadline, st.endpoints()
            time.sleep(0.1)
        yield st
    finally:
        procs.stop()


def _fault(port: int, **doc: bool) -> None:
    status, body = post_json(f"http://127.0.0.1:{port}/admin/fault", doc)
    assert status == 200, body


def _wait_health(st: Stack, key: str, want: str, timeout: float) -> float:
    t0 = time.monotonic()
    while st.endpoints()[key]["health"] != want:
        assert time.monotonic() - t0 < timeout, st.endpoints()
        time.sleep(0.02)
    return time.monotonic() - t0


def _complete(st: Stack, prompt: str, timeout: float = 30.0) -> tuple[int, object]:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()
    status, raw, _ = http(
        "POST", st.url + "/v1/completions", body, {"content-type": "application/json"}, timeout
    )
    return status, raw


def test_failing_health_leaves_within_one_scrape(sims: Stack) -> None:
    dead = sims.upstreams[0]
    _fault(dead, health=False)
    took = _wait_health(sims, f"127.0.0.1:{dead}", "unhealthy", timeout=5)
    assert took <= 0.2 + 1.0 + 0.5, f"left the routable set after {took:.2f} s"
    for i in range(6):
        status, _ = _complete(sims, f"after death {i}")
        assert status == 200
    assert sims.endpoints()[f"127.0.0.1:{dead}"]["in_flight_requests"] == 0, "nothing sent to it"
    _fault(dead, health=True)
    _wait_health(sims, f"127.0.0.1:{dead}", "ready", timeout=5)


def test_hung_engine_leaves_after_the_stall_bound_and_returns_when_it_moves(sims: Stack) -> None:
    hung = sims.upstreams[0]
    key = f"127.0.0.1:{hung}"
    _fault(hung, freeze=True)
    held: list[int] = []
    threads = [
        threading.Thread(target=lambda i=i: held.append(_complete(sims, f"held {i}")[0])) for i in range(2)
    ]
    t0 = time.monotonic()
    for t in threads:  # round-robin: one of the two goes to the frozen engine and waits there
        t.start()
    _wait_health(sims, key, "stalled", timeout=10)
    took = time.monotonic() - t0
    assert took <= 1.0 + 0.2 + 1.0, f"stalled after {took:.2f} s"
    before = sims.endpoints()[key]["in_flight_requests"]
    for i in range(4):
        status, _ = _complete(sims, f"while hung {i}")
        assert status == 200
    assert sims.endpoints()[key]["in_flight_requests"] == before, "nothing new sent to the hung engine"
    _fault(hung, freeze=False)
    for t in threads:
        t.join(timeout=30)
    assert held == [200, 200], "the held request completes once the engine moves again"
    _wait_health(sims, key, "ready", timeout=5)
    sims.wait_in_flight_zero()

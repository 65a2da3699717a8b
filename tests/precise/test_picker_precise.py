"""The picker process in precise mode behind a real Envoy, with two simulator replicas publishing
KV events on the same port of their own addresses (127.0.0.1 and 127.0.0.2), as pods do.

Checked through the wire only: both event streams synced (debug API), a prefix's requests stick
to the replica that holds it, the explain API's predicted cached tokens equal what the replica
then reports, and a replica restart is seen as one (its entries dropped, its stream synced again).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import time
from typing import Any

import pytest

from kvlaunch import PY, Procs, Stack, free_port, http, post_json

pytestmark = [pytest.mark.precise, pytest.mark.envoy, pytest.mark.timeout(240)]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
HOSTS = ["127.0.0.1", "127.0.0.2"]


def start_sim(procs: Procs, host: str, port: int, ev: int) -> None:
    args = ["--host", host, "--port", str(port), "--profile", "cpu-test", "--kv-events-port", str(ev)]
    proc = procs.start(f"sim-{host}", [PY, "-m", "replica.sim", *args, "--time-scale", "0.2"])
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, procs.log(f"sim-{host}")
        with contextlib.suppress(OSError):
            if http("GET", f"http://{host}:{port}/health", timeout=1)[0] == 200:
                return
        assert time.monotonic() < deadline, "simulator did not start"
        time.sleep(0.1)


def debug(st: Stack, what: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    url = f"http://127.0.0.1:{st.debug_port}/debug/{what}"
    if body is None:
        return dict(json.loads(http("GET", url, headers=st.debug_headers)[1]))
    status, doc = post_json(url + "?path=/v1/completions", body, st.debug_headers)
    assert status == 200, doc
    return dict(doc)


def wait_for(pred: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def complete(st: Stack, prompt: list[int]) -> tuple[str, int]:
    status, body, headers = http(
        "POST",
        st.url + "/v1/completions",
        json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode(),
        {"content-type": "application/json"},
    )
    assert status == 200, body
    doc = json.loads(body)
    return headers.get("x-served-by", ""), int(doc["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_precise_picker_behind_envoy(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    ports, ev = [free_port(), free_port()], free_port()
    st = Stack(procs, ports)
    try:
        for host, port in zip(HOSTS, ports, strict=True):
            start_sim(procs, host, port, ev)
        eps = ",".join(f"{h}:{p}" for h, p in zip(HOSTS, ports, strict=True))
        st.start_picker("--endpoints", eps, "--prefix-mode", "precise", "--kv-events-port", str(ev))
        st.start_envoy()
        wait_for(lambda: all(e["health"] == "ready" for e in st.endpoints().values()), "endpoints ready")
        doc = [7, *range(1000, 1000 + 16 * 12)]  # 12 blocks of 16 tokens, then questions
        first = [*doc, 1, 2, 3]
        complete(st, first)
        wait_for(lambda: sum(e.get("precise_blocks", 0) for e in st.endpoints().values()) >= 12, "events in")
        eps_state = st.endpoints()
        assert {e["kv_events"] for e in eps_state.values()} <= {"synced", "waiting"}
        holder = next(k for k, e in eps_state.items() if e.get("precise_blocks", 0) >= 12)
        for q in range(5):
            prompt = [*doc, 50 + q, 60 + q]
            ex = debug(st, "explain", {"model": MODEL, "prompt": prompt})
            assert ex["chosen"] == [holder], json.dumps([holder, ex, st.endpoints()])
            row = ex["endpoints"][holder]
            assert row["prefix_source"] == "precise" and row["matched_blocks"] == 12, row
            _, cached = complete(st, prompt)
            assert cached == row["cached_tokens_est"] == 12 * 16, json.dumps([cached, ex, st.endpoints()])
        # Restart the holder: the scraper sees it unreachable, the picker drops its entries (its
        # cache is gone), and its new stream (seq 0 again) is taken in.
        host, port = holder.rsplit(":", 1)
        procs.stop(f"sim-{host}")
        wait_for(lambda: st.endpoints()[holder]["health"] == "unreachable", "restart seen", 10)
        wait_for(lambda: st.endpoints()[holder]["precise_blocks"] == 0, "entries dropped", 5)
        start_sim(procs, host, int(port), ev)
        wait_for(lambda: st.endpoints()[holder]["health"] == "ready", "restarted replica ready", 30)
        time.sleep(1.0)  # ZMQ reconnects the picker's SUB socket
        ex = debug(st, "explain", {"model": MODEL, "prompt": [*doc, 99]})
        assert ex["endpoints"][holder]["matched_blocks"] == 0, ex
        other = next(k for k in ex["endpoints"] if k != holder)
        assert ex["chosen"] == [other] or ex["endpoints"][other]["matched_blocks"] == 0, ex
        _, cached = complete(st, [*doc, 99])
        assert cached == ex["endpoints"][ex["chosen"][0]]["cached_tokens_est"], (cached, ex)
    finally:
        procs.stop()

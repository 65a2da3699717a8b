"""Three picker replicas behind one real Envoy (an ext_proc cluster of three, gRPC-health-checked),
in precise mode and sharing picks and in-flight load (``--peer-bind`` / ``--peers``), in front of
two simulator replicas publishing KV events. One picker is killed with SIGKILL under load:

- requests that were on it follow the failure mode (fail-close: they fail), and so do those Envoy
  sends it before its next health check fails (connection refused: Envoy's ext_proc stream does
  not retry another host; measured about 20-35 of 300-400 requests in the window at 6 clients);
- Envoy moves to the other two within its health-check interval: every request sent from then on
  succeeds.

Envoy does not count ext_proc streams as traffic for its active health checks: without
``no_traffic_interval`` it checks every 60 s, and a dead picker keeps failing requests that long.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import signal
import subprocess
import threading
import time
from typing import Any

import pytest
import yaml

from kvlaunch import ENVOY, PY, ROOT, Procs, free_port, http, wait_port
from tests.precise.test_picker_precise import HOSTS, MODEL, start_sim

pytestmark = [pytest.mark.precise, pytest.mark.envoy, pytest.mark.timeout(240)]
HEALTH_INTERVAL_S = 0.5


def envoy_config(listen: int, pickers: list[int]) -> dict[str, Any]:
    """The shipped config (render.py) with an ext_proc cluster of the three pickers, unchanged."""
    out = subprocess.run(
        [
            PY,
            str(ROOT / "deploy/envoy/render.py"),
            "--listen-port",
            str(listen),
            "--admin-port",
            str(free_port()),
            "--picker",
            ",".join(f"127.0.0.1:{p}" for p in pickers),
            "--plaintext",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    doc = yaml.safe_load(out)
    assert isinstance(doc, dict)
    return doc


def start_picker(procs: Procs, i: int, grpc: int, eps: str, ev: int, peers: list[str]) -> int:
    metrics = free_port()
    args = ["--endpoints", eps, "--host", "127.0.0.1", "--grpc-port", str(grpc)]
    args += [
        "--grpc-health-port",
        str(free_port()),
        "--metrics-port",
        str(metrics),
        "--secure-serving",
        "false",
    ]
    args += ["--prefix-mode", "precise", "--kv-events-port", str(ev), "--drain-timeout", "1"]
    args += ["--peer-bind", peers[i], "--peers", ",".join(p for j, p in enumerate(peers) if j != i)]
    proc = procs.start(f"picker{i}", [PY, "-m", "picker", *args])
    wait_port(grpc, proc=proc)
    return proc.pid


def send(url: str, prompt: list[int]) -> tuple[int, str]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()
    status, out, _ = http(
        "POST", url + "/v1/completions", body, {"content-type": "application/json"}, timeout=20
    )
    return status, out.decode(errors="replace")[:200]


def test_sigkill_one_of_three_pickers_under_load(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    ports, ev = [free_port(), free_port()], free_port()
    grpcs = [free_port() for _ in range(3)]
    peers = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
    listen = free_port()
    try:
        for host, port in zip(HOSTS, ports, strict=True):
            start_sim(procs, host, port, ev)
        eps = ",".join(f"{h}:{p}" for h, p in zip(HOSTS, ports, strict=True))
        pids = [start_picker(procs, i, g, eps, ev, peers) for i, g in enumerate(grpcs)]
        cfg = tmp_path / "envoy.yaml"
        cfg.write_text(json.dumps(envoy_config(listen, grpcs)))
        proc = procs.start(
            "envoy", [ENVOY, "-c", str(cfg), "--base-id", str(os.getpid() % 1000 + 7000), "-l", "warning"]
        )
        wait_port(listen, proc=proc)
        url = f"http://127.0.0.1:{listen}"
        deadline = time.monotonic() + 20
        while send(url, [1, 2, 3])[0] != 200:
            assert time.monotonic() < deadline, procs.log("envoy")
            time.sleep(0.2)

        doc = [7, *range(1000, 1000 + 16 * 12)]
        results: list[tuple[float, float, int]] = []  # (sent, done, status)
        lock = threading.Lock()
        stop = threading.Event()
        killed_at: list[float] = []

        def worker(w: int) -> None:
            i = 0
            while not stop.is_set():
                t0 = time.monotonic()
                status, _ = send(url, [*doc, w, i])
                with lock:
                    results.append((t0, time.monotonic(), status))
                i += 1

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(worker, w) for w in range(6)]
            time.sleep(2.0)
            os.kill(pids[1], signal.SIGKILL)
            killed_at.append(time.monotonic())
            time.sleep(3.0)
            stop.set()
            for f in futs:
                f.result()
        kill = killed_at[0]
        before = [s for t0, t1, s in results if t1 < kill]
        in_flight = [s for t0, t1, s in results if t0 <= kill <= t1]
        later = [s for t0, _, s in results if t0 > kill]
        summary = (
            f"{len(before)} done before the kill (failed: {sum(s != 200 for s in before)}), "
            f"{len(in_flight)} in flight at it (failed: {sum(s != 200 for s in in_flight)}, at most the "
            f"killed picker's), {len(later)} sent after it (failed: {sum(s != 200 for s in later)}"
            f"{[(round(t0 - kill, 3), s) for t0, _, s in results if t0 > kill and s != 200]})"
        )
        print(summary)
        assert before and all(s == 200 for s in before), summary
        assert later and all(s == 200 for s in later), f"failed beyond those in flight: {summary}"
    finally:
        procs.stop()

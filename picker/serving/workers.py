"""``python -m picker --workers N``: N picker processes on one pod, sharing its ports.

The process started by the user is worker 0; it starts workers 1..N-1 as child processes with the
same arguments. Every worker binds the gRPC, health, metrics (and debug) ports with SO_REUSEPORT,
so the kernel spreads Envoy's connections over them, and each runs the whole picker: discovery,
scraping, KV-event subscribers. They agree through the peer channel (:mod:`picker.feeds.peers`): worker
``i`` publishes its picks and in-flight load on ``ipc://<dir>/peer-<i>`` and subscribes to every
other worker's (plus any ``--peers`` given). A worker whose parent dies exits (it polls its
parent id), and worker 0 stops the others when it stops.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

WORKER_FLAG = "--worker-index"


def peer_addresses(run_dir: str, n: int) -> list[str]:
    return [f"ipc://{run_dir}/peer-{i}" for i in range(n)]


def child_argv(argv: Sequence[str], index: int, run_dir: str) -> list[str]:
    """Worker ``index``'s command line: the user's arguments, as worker ``index`` of this pod."""
    return [sys.executable, "-m", "picker", *argv, WORKER_FLAG, str(index), "--worker-dir", run_dir]


def spawn(argv: Sequence[str], n: int) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """Start workers 1..n-1; returns the shared run directory and the children."""
    run_dir = tempfile.mkdtemp(prefix="kvpick-workers-")
    children = [subprocess.Popen(child_argv(argv, i, run_dir)) for i in range(1, n)]
    return run_dir, children


def stop(children: Sequence[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    for c in children:
        if c.poll() is None:
            c.terminate()
    for c in children:
        try:
            c.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            c.kill()


async def exit_with_parent(parent: int, stop_fn: object, interval_s: float = 0.5) -> None:
    """Call ``stop_fn`` once this worker's parent (worker 0) is gone."""
    while os.getppid() == parent:
        await asyncio.sleep(interval_s)
    if callable(stop_fn):
        stop_fn()

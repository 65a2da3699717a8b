"""Subprocess helpers for tests: free ports, readiness waits, and a stack of real processes
(upstreams, picker, Envoy) that is always torn down."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = sys.executable
ENVOY = str(pathlib.Path(PY).parent / "envoy")
_base_ids = itertools.count(1000 + os.getpid() % 1000 * 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open in {timeout}s")


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def post_json(url: str, doc: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, body, _ = http(
        "POST", url, json.dumps(doc).encode(), {"content-type": "application/json", **(headers or {})}
    )
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode("utf-8", "replace")


@dataclass
class Procs:
    """Started processes, killed (whole process group) in reverse order on close."""

    tmp: pathlib.Path
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
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
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, name: str) -> None:
        for n, proc in self.procs:
            if n == name and proc.poll() is None:
                _kill(proc)

    def signal(self, name: str, sig: signal.Signals) -> subprocess.Popen[bytes]:
        """Send ``sig`` to the named process's group (SIGKILL, SIGSTOP, SIGCONT, SIGTERM)."""
        proc = next(p for n, p in reversed(self.procs) if n == name)
        os.killpg(proc.pid, sig)
        return proc

    def close(self) -> None:
        for _, proc in reversed(self.procs):
            _kill(proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)  # a SIGSTOPped process cannot act on SIGTERM
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@dataclass
class Stack:
    """Upstreams + picker + Envoy on loopback."""

    procs: Procs
    upstreams: list[int]
    envoy_port: int = 0
    grpc_port: int = 0
    health_port: int = 0
    metrics_port: int = 0
    debug_port: int = 0
    """The picker's debug API (started with ``--enable-debug-api`` on loopback)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    def endpoints(self) -> dict[str, Any]:
        _, body, _ = http("GET", f"http://127.0.0.1:{self.debug_port}/debug/endpoints")
        return dict(json.loads(body))

    def wait_in_flight_zero(self, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        eps = self.endpoints()
        while time.monotonic() < deadline:
            eps = self.endpoints()
            if all(e["in_flight_requests"] == 0 and e["in_flight_tokens"] == 0 for e in eps.values()):
                return eps
            time.sleep(0.1)
        raise AssertionError(f"in-flight did not return to zero: {eps}")

    def start_upstreams(self) -> None:
        proc = self.procs.start(
            "upstreams", [PY, "-m", "tests.support.upstream", "--ports", ",".join(map(str, self.upstreams))]
        )
        for p in self.upstreams:
            wait_port(p, proc=proc)

    def start_picker(
        self,
        *extra: str,
        endpoints: list[int] | None = None,
        debug: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        """The picker on this stack's ports; ``endpoints=[]``: no static list (discovery from
        ``extra``, e.g. ``--pool-name``)."""
        # A restarted picker keeps its ports, so a running Envoy finds it again.
        self.grpc_port = self.grpc_port or free_port()
        self.health_port = self.health_port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        self.debug_port = self.debug_port or free_port()
        eps = ",".join(f"127.0.0.1:{p}" for p in (endpoints if endpoints is not None else self.upstreams))
        args = [
            PY,
            "-m",
            "picker",
            "--endpoints",
            eps,
            "--host",
            "127.0.0.1",
            "--grpc-port",
            str(self.grpc_port),
            "--grpc-health-port",
            str(self.health_port),
            "--metrics-port",
            str(self.metrics_port),
            *(["--enable-debug-api", "--debug-port", str(self.debug_port)] if debug else []),
            *extra,
        ]
        proc = self.procs.start("picker", args, env)
        wait_port(self.metrics_port, proc=proc)
        wait_port(self.grpc_port, proc=proc)

    def start_envoy(self, *render_args: str, config: str | None = None) -> None:
        self.envoy_port = self.envoy_port or free_port()
        path = self.procs.tmp / "envoy.yaml"
        if config is None:
            subprocess.run(
                [
                    PY,
                    str(ROOT / "deploy/envoy/render.py"),
                    "--listen-port",
                    str(self.envoy_port),
                    "--admin-port",
                    str(free_port()),
                    "--picker",
                    f"127.0.0.1:{self.grpc_port}",
                    "-o",
                    str(path),
                    *render_args,
                ],
                check=True,
            )
        else:
            path.write_text(config)
        proc = self.procs.start(
            "envoy",
            [
                ENVOY,
                "-c",
                str(path),
                "--base-id",
                str(next(_base_ids)),
                "-l",
                "warning",
                "--concurrency",
                "2",
            ],
        )
        wait_port(self.envoy_port, proc=proc)


@contextlib.contextmanager
def stack(
    tmp: pathlib.Path, n: int = 2, picker_args: tuple[str, ...] = (), envoy_args: tuple[str, ...] = ()
) -> Iterator[Stack]:
    procs = Procs(tmp)
    st = Stack(procs, [free_port() for _ in range(n)])
    try:
        st.start_upstreams()
        st.start_picker(*picker_args)
        st.start_envoy(*envoy_args)
        _wait_routable(st)
        yield st
    finally:
        procs.close()


def _wait_routable(st: Stack, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        status, last = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "warmup"})
        if status == 200:
            st.wait_in_flight_zero()
            return
        time.sleep(0.2)
    raise RuntimeError(
        f"stack never became routable: {last}\n{st.procs.log('picker')}\n{st.procs.log('envoy')}"
    )

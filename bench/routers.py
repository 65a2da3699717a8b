"""Routers under test, each started in front of the same fleet and stopped afterwards.

- ``cost``, ``round-robin``, ``least-loaded``: our picker (``python -m picker``,
  TLS ext_proc) behind a real Envoy rendered by ``deploy/envoy/render.py`` (pool upstream), run
  as the chart ships it: ``prefix.mode: auto`` on the replicas' KV events (``bench.fleet``), the
  prompts tokenized by the replicas' own ``/tokenize`` (precise matching, as with the chart's
  tokenizer).
- ``cost-approximate`` (any picker policy + ``-approximate``): the same picker with
  ``--prefix-mode approximate`` (its own record of its picks, no events): a deployment without
  KV events, reported as its own row.
- ``vllm-router``: ``vllm-router --policy cache_aware`` (the vLLM project's router).
- ``sglang-router``: ``sglang-router launch --policy cache_aware`` in its default HTTP mode, which
  proxies ``/v1/completions`` to any OpenAI-compatible worker (its ``--backend openai`` mode
  answers 501 to ``/v1/completions`` and only serves chat).
- ``direct``: no router; the load generator round-robins over the replicas itself.
"""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import orjson

from kvlaunch import PY, Procs, Stack, free_port, http, wait_port

if TYPE_CHECKING:  # not at run time: bench.device's peers-only kit has no picker dependencies
    from .fleet import Fleet

PICKER_POLICIES = ("cost", "cost-approximate", "round-robin", "least-loaded")
PEERS = ("vllm-router", "sglang-router")
APPROXIMATE = "-approximate"
"""A router name ending so runs the picker policy before it in approximate prefix mode."""
ROUTERS = (*PICKER_POLICIES, *PEERS)
_VENV_BIN = pathlib.Path(PY).parent


def _picker_envoy(
    policy: str,
    fleet: Fleet,
    procs: Procs,
    config: str | None,
    picker_args: Sequence[str],
    envoy_args: Sequence[str] = (),
    source: str = "",
) -> Stack:
    """Our picker behind Envoy (the shared launcher), Envoy in pool mode over the fleet and
    ``envoy_args`` (more ``render.py`` flags). ``source``: another source tree's picker and Envoy
    config (``PYTHONSAFEPATH`` keeps this checkout, the working directory, off the path, so
    ``PYTHONPATH`` decides which ``picker`` is imported; its own ``render.py``, whose listener may
    predate ``--listen-address``: it binds the default, 0.0.0.0)."""
    if source:
        st = Stack(procs, fleet.ports, root=pathlib.Path(source), listen_host="0.0.0.0")
    else:
        st = Stack(procs, fleet.ports)
    st.start_picker(
        "--policy",
        policy.removesuffix(APPROXIMATE),
        *prefix_args(policy, fleet),
        "--log-level",
        "warning",
        *(["--config-file", config] if config else []),
        *picker_args,
        debug=False,
        env={"PYTHONSAFEPATH": "1", "PYTHONPATH": source} if source else None,
    )
    st.start_envoy("--upstream", "pool", "--endpoints", ",".join(st.addresses), *envoy_args)
    return st


def prefix_args(name: str, fleet: Fleet) -> list[str]:
    """The picker's prefix-mode flags for router ``name``: approximate for ``POLICY-approximate``,
    else the shipped mode (``auto`` on the fleet's KV events, module docstring)."""
    if name.endswith(APPROXIMATE) or not fleet.events_port:
        return ["--prefix-mode", "approximate"]
    ports = ",".join(map(str, fleet.ports))
    return [
        "--prefix-mode",
        "auto",
        "--kv-events-port",
        str(fleet.events_port),
        "--data-parallel-ports",
        ports,
    ]


def start_peer(name: str, worker_urls: list[str], procs: Procs) -> tuple[str, subprocess.Popen[bytes]]:
    """A peer router (``cache_aware``) over ``worker_urls``; (its URL, its process)."""
    port, prom = free_port(), free_port()
    exe = str(_VENV_BIN / name)
    args = [exe, "launch"] if name == "sglang-router" else [exe]
    args += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls]
    args += ["--policy", "cache_aware", "--prometheus-port", str(prom), "--prometheus-host", "127.0.0.1"]
    proc = procs.start(name, args)
    wait_port(port, 120, procs=procs, proc=proc)
    return f"http://127.0.0.1:{port}", proc


def wait_routable(url: str, model: str, children: Procs, timeout: float = 60.0) -> None:
    """Until one tiny completion goes through (the picker has scraped its endpoints, the peer
    has health-checked its workers)."""
    body = orjson.dumps({"model": model, "prompt": "ping", "max_tokens": 1})
    deadline = time.monotonic() + timeout
    status, last = 0, b""
    while time.monotonic() < deadline:
        children.check()
        with contextlib.suppress(OSError):
            status, last, _ = http(
                "POST", url + "/v1/completions", body, {"content-type": "application/json"}
            )
            if status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"router at {url} never answered 200 (last {status}: {last[:200]!r})")


@contextlib.contextmanager
def router(
    name: str,
    fleet: Fleet,
    run_dir: pathlib.Path,
    picker_config: str | None = None,
    picker_args: Sequence[str] = (),
    policy: str | None = None,
    started: Callable[[Procs], None] | None = None,
    envoy_args: Sequence[str] = (),
    stack_seen: Callable[[Stack], None] | None = None,
    source: str = "",
) -> Iterator[list[str]]:
    """Start ``name`` in front of ``fleet``; yields the URLs to send to (one, or the replicas).
    Any name that is not ``direct`` or a peer is a picker policy (built in, or defined in
    ``picker_config``, the picker's ``--config-file``), or names a picker variant run with the
    policy ``policy`` and the further flags ``picker_args``; Envoy gets ``envoy_args`` (more
    ``render.py`` flags) and the picker's :class:`Stack` goes to ``stack_seen``; ``source``: the
    source tree of the picker and its Envoy config (default this checkout)."""
    if name == "direct":
        yield fleet.urls
        return
    d = run_dir / name
    d.mkdir(parents=True, exist_ok=True)
    children = Procs(d)
    try:
        if name in PEERS:
            url, _ = start_peer(name, fleet.urls, children)
        else:
            st = _picker_envoy(
                policy or name, fleet, children, picker_config, picker_args, envoy_args, source
            )
            url = st.url
            if stack_seen is not None:
                stack_seen(st)
        wait_routable(url, fleet.cfg.model, children)
        if started is not None:
            started(children)
        yield [url]
    finally:
        children.stop()

"""The simulated replicas a benchmark runs against: started once, caches reset between routers.

Each replica publishes its KV events as vLLM does with ``--kv-events-config`` (ZMQ PUB), as the
chart's replicas do: replica ``r`` on ``events_port + r`` (``--data-parallel-rank r``, since they
share one host), so our picker can run its shipped ``prefix.mode: auto`` (``bench.routers``).
A cache reset publishes ``AllBlocksCleared``.

Process handling is :mod:`kvlaunch`'s (``Procs``, ``wait_port``): each child runs in its
own process group, logs to ``run_dir/NAME.log``, and is stopped with its group.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

from kvlaunch import PY, Procs, free_port, http, wait_port
from picker.core.endpoints.types import EndpointMetrics
from picker.feeds.scrape import parse_metrics


@dataclass
class FleetConfig:
    replicas: int = 4
    profile: str = "h100-llama-3.1-8b"
    time_scale: float = 1.0
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    extra_args: tuple[str, ...] = ()


@dataclass
class Counters:
    queries: float = 0.0
    hits: float = 0.0
    requests: list[float] = field(default_factory=list)
    """``vllm:request_success_total`` per replica, in fleet order."""


@dataclass
class Fleet:
    """N ``python -m replica.sim`` processes on free loopback ports."""

    cfg: FleetConfig
    children: Procs
    ports: list[int] = field(default_factory=list)
    events_port: int = 0
    """Replica ``r`` publishes its KV events on ``events_port + r`` (0: before :meth:`start`)."""

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def start(self) -> None:
        c = self.cfg
        self.ports = [free_port() for _ in range(c.replicas)]
        self.events_port = free_port_block(c.replicas)
        for i, port in enumerate(self.ports):
            args = ["--port", str(port), "--model", c.model, "--profile", c.profile]
            args += ["--kv-events-port", str(self.events_port), "--data-parallel-rank", str(i)]
            args += ["--time-scale", str(c.time_scale), *c.extra_args]
            self.children.start(f"replica-{i}", [PY, "-m", "replica.sim", *args])
        for port in self.ports:
            wait_port(port, procs=self.children)

    def reset(self, timeout: float = 60.0) -> None:
        """Empty every replica's prefix cache; retried while requests still hold blocks (409)."""
        self.children.check()
        deadline = time.monotonic() + timeout
        for url in self.urls:
            while True:
                status, body, _ = http("POST", url + "/reset_prefix_cache")
                if status == 200:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} refused to reset its prefix cache: {status} {body[:200]!r}")
                time.sleep(0.2)

    def scrape(self) -> list[EndpointMetrics]:
        """Per replica: its vLLM metrics, read by the picker's own parser."""
        self.children.check()  # a dead replica is reported with its log tail, not as a refused connection
        out = []
        for url in self.urls:
            _, text, _ = http("GET", url + "/metrics")
            out.append(parse_metrics(text.decode()))
        return out

    def counters(self) -> Counters:
        c = Counters()
        for m in self.scrape():
            c.queries += m.prefix_queries_total
            c.hits += m.prefix_hits_total
            c.requests.append(m.request_success_total)
        return c

    def cache_shape(self) -> tuple[int, int]:
        """(block size in tokens, total KV blocks over all replicas)."""
        shapes = self.scrape()
        sizes = {m.block_size for m in shapes}
        assert len(sizes) == 1 and None not in sizes, f"replicas disagree on block size: {sizes}"
        return int(shapes[0].block_size or 0), sum(m.num_gpu_blocks or 0 for m in shapes)


def free_port_block(n: int, tries: int = 200) -> int:
    """A port ``p`` with ``p .. p + n - 1`` all free now (:func:`kvlaunch.free_port` promises two)."""
    for _ in range(tries):
        base = free_port()
        if all(_bindable(base + i) for i in range(2, n)):
            return base
    raise RuntimeError(f"no block of {n} free ports in {tries} tries")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True

"""Picker replicas sharing the scrapes of the replicas' ``/metrics`` (``picker.feeds.peers``), as real
processes: three pickers (``--peer-bind`` / ``--peers``) in front of three simulator replicas. Each
picker's view is read from its own ``/metrics``: ``inference_pool_ready_pods`` (its routable
endpoints) and ``kvpick_scrape_owner`` (which endpoints it scrapes for the others).

- every endpoint is scraped by one picker, and the three together scrape far less than three times
  the endpoints;
- a replica that dies leaves every picker's routable set within the single picker's bound
  (``unreachable_after`` failed scrapes) plus the sharing's latency;
- a picker killed with SIGKILL: the endpoints it scraped get a new owner within the share TTL
  (1 s) and stay routable on the others;
- a replica that dies together with the picker that scraped it leaves the last picker's routable
  set within the share TTL plus the single picker's bound.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvlaunch import PY, Procs, free_port, http, wait_port
from tests.precise.test_picker_precise import start_sim

pytestmark = [pytest.mark.precise, pytest.mark.timeout(180)]
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
INTERVAL_S = 0.2
UNREACHABLE_AFTER = 3
SHARE_TTL_S = 1.0
SLACK_S = 1.5
"""Allowance for a shared 2-core machine: process scheduling, our own polling every 50 ms."""
SINGLE_BOUND_S = UNREACHABLE_AFTER * INTERVAL_S + SLACK_S
"""A dead replica (connection refused) leaves one picker's routable set within this."""


@dataclass
class View:
    ready: int
    owner: dict[str, bool]
    own: float
    peer: float


def view(metrics_port: int) -> View:
    status, body, _ = http("GET", f"http://127.0.0.1:{metrics_port}/metrics", timeout=2)
    assert status == 200
    v = View(-1, {}, 0.0, 0.0)
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if s.name == "inference_pool_ready_pods":
                v.ready = int(s.value)
            elif s.name == "kvpick_scrape_owner":
                v.owner[s.labels["endpoint"]] = s.value == 1
            elif s.name == "kvpick_scrape_outcomes_total":
                setattr(v, s.labels["source"], s.value)
    return v


def wait_for(cond: Callable[[], bool], what: str, timeout: float) -> float:
    """Seconds until ``cond`` held (polled every 50 ms); fails after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def start_picker(procs: Procs, i: int, eps: str, ev: int, peers: list[str]) -> tuple[int, int]:
    """(pid, metrics port) of picker ``i``, sharing with the others."""
    grpc, metrics = free_port(), free_port()
    args = ["--endpoints", eps, "--host", "127.0.0.1", "--grpc-port", str(grpc), "--secure-serving", "false"]
    args += ["--grpc-health-port", str(free_port()), "--metrics-port", str(metrics)]
    args += ["--prefix-mode", "precise", "--kv-events-port", str(ev), "--drain-timeout", "1"]
    args += ["--scrape-interval", str(INTERVAL_S), "--log-level", "info"]
    args += ["--peer-bind", peers[i], "--peers", ",".join(p for j, p in enumerate(peers) if j != i)]
    proc = procs.start(f"picker{i}", [PY, "-m", "picker", *args])
    wait_port(metrics, proc=proc)
    return proc.pid, metrics


def test_scrapes_are_split_and_follow_deaths_of_replicas_and_owners(tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    port, ev = free_port(), free_port()
    keys = [f"{h}:{port}" for h in HOSTS]
    try:
        for host in HOSTS:
            start_sim(procs, host, port, ev)
        sims = {k: procs.procs[i][1].pid for i, k in enumerate(keys)}
        peers = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
        pickers = dict(start_picker(procs, i, ",".join(keys), ev, peers) for i in range(3))

        def views() -> dict[int, View]:
            return {pid: view(m) for pid, m in pickers.items()}

        def split(live: list[str]) -> Callable[[], bool]:
            def check() -> bool:
                vs = views().values()
                return all(v.ready == len(live) for v in vs) and all(
                    sum(v.owner.get(k, False) for v in vs) == 1 for k in live
                )

            return check

        wait_for(split(keys), "every endpoint scraped by exactly one picker, all routable", 20)
        before, t0 = views(), time.monotonic()
        time.sleep(2.0)
        after, dt = views(), time.monotonic() - t0
        own = sum(after[p].own - before[p].own for p in pickers)
        alone = 3 * len(keys) * dt / INTERVAL_S  # every picker scraping every endpoint
        assert own < 0.6 * alone, (
            f"{own:.0f} scrapes in {dt:.1f} s by 3 pickers, against {alone:.0f} unshared"
        )
        # rendezvous over random idents gives one picker all 3 endpoints 1 time in 9: it has no
        # peer scrapes to apply
        takers = [p for p in pickers if not all(after[p].owner.values())]
        assert takers and all(after[p].peer > before[p].peer for p in takers), (
            "each picker that does not scrape everything applies its peers' scrapes",
            {p: (after[p].owner, after[p].peer - before[p].peer) for p in pickers},
        )

        def owner_of(key: str) -> int:
            return next(pid for pid, v in views().items() if v.owner.get(key))

        def routable(n: int) -> Callable[[], bool]:
            return lambda: all(v.ready == n for v in views().values())

        # a replica dies, its owner alive: every picker drops it
        os.kill(sims[keys[0]], signal.SIGKILL)
        took = wait_for(routable(2), "a dead replica left every picker's routable set", SINGLE_BOUND_S)
        print(f"replica death seen by all 3 pickers in {took:.2f} s (bound {SINGLE_BOUND_S:.1f} s)")

        # the owner of a live replica dies: another picker scrapes it, it stays routable
        victim = owner_of(keys[1])
        os.kill(victim, signal.SIGKILL)
        del pickers[victim]
        took = wait_for(
            lambda: sum(v.owner.get(keys[1], False) for v in views().values()) == 1,
            "a new owner scrapes the dead picker's replica",
            SHARE_TTL_S + SLACK_S,
        )
        assert routable(2)(), "the dead picker's replicas stayed routable on the others"
        print(f"scrape ownership moved in {took:.2f} s (share TTL {SHARE_TTL_S} s)")
        wait_for(split(keys[1:]), "the two pickers split the live endpoints", SHARE_TTL_S + SLACK_S)

        # a replica dies together with the picker that scraped it: the last picker drops it
        victim = owner_of(keys[2])
        os.kill(victim, signal.SIGKILL)
        os.kill(sims[keys[2]], signal.SIGKILL)
        del pickers[victim]
        bound = SHARE_TTL_S + SINGLE_BOUND_S
        took = wait_for(routable(1), "a replica dead with its owner left the last picker's set", bound)
        print(f"replica death with its owner seen in {took:.2f} s (bound {bound:.1f} s)")
        [last] = views().values()
        assert last.owner.get(keys[1]), "alone, the last picker scrapes every live endpoint"
    finally:
        procs.stop()

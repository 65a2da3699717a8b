"""The end-to-end assertions shared by ``make docker-e2e`` and ``make kind-test`` (two drivers).

Each check sends requests through the gateway (Envoy, in front of the picker) and reads the
outcome from the replicas' own Prometheus counters, never from anything the router says:

- which replica served a request: the replica whose ``vllm:request_success_total`` went up;
- whether it hit its prefix cache: its ``vllm:prefix_cache_hits_total`` (tokens) went up.

Requests are sent one at a time, so exactly one replica's success counter moves per request.

A driver supplies a :class:`Cluster` (how to read a replica's ``/metrics`` and how to kill one);
:func:`run_all` runs every check in order. Standard library only, except :func:`probe_grpc_health`,
which needs ``grpcio`` and ``grpcio-health-checking`` (the project's venv has both).
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

DEST_HEADER = "x-gateway-destination-endpoint"
SERVED = "vllm:request_success_total"
HITS = "vllm:prefix_cache_hits_total"


class CheckFailed(AssertionError):
    """An end-to-end assertion did not hold; the message says what was seen."""


class Cluster(Protocol):
    """The replicas under test, as a driver sees them."""

    def replicas(self) -> list[str]:
        """Names of the live replicas (a docker container name, a pod name)."""
        ...

    def address(self, name: str) -> str:
        """``ip:port`` the picker routes to for this replica (what a destination header names)."""
        ...

    def metrics(self, name: str) -> str:
        """The replica's ``/metrics`` text."""
        ...

    def kill(self, name: str) -> None:
        """Kill the replica abruptly (``docker kill``, pod deletion)."""
        ...


@dataclass(frozen=True)
class Gateway:
    """Where the client sends requests, and the model it names."""

    url: str
    model: str
    max_tokens: int = 4
    timeout_s: float = 60.0


def counter_sum(text: str, name: str) -> float:
    """Sum of every sample of counter ``name`` (all label sets) in Prometheus text ``text``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def post(gw: Gateway, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """POST /v1/completions through the gateway; (status, body), status 0 on a connection error."""
    hdrs = {"content-type": "application/json", **(headers or {})}
    req = urllib.request.Request(f"{gw.url}/v1/completions", body, hdrs, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=gw.timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def completion(gw: Gateway, prompt: str) -> bytes:
    return json.dumps({"model": gw.model, "prompt": prompt, "max_tokens": gw.max_tokens}).encode()


def prefix(group: int, words: int) -> str:
    """A long shared prompt prefix, distinct per group."""
    rng = random.Random(group)
    vocab = ["alpha", "beta", "gamma", "delta", "kv", "cache", "block", "token", "route", "pool"]
    return f"[system {group}] " + " ".join(rng.choice(vocab) for _ in range(words))


@dataclass(frozen=True)
class Served:
    """The outcome of one request, read from the replicas' counters."""

    status: int
    replica: str  # "" when no live replica's success counter moved
    hit_tokens: float


class Observer:
    """Sends one request at a time and reads which replica served it from their counters."""

    def __init__(self, cluster: Cluster, gw: Gateway, settle_s: float = 10.0) -> None:
        self.cluster, self.gw, self.settle_s = cluster, gw, settle_s

    def _snapshot(self, names: Iterable[str]) -> dict[str, tuple[float, float]]:
        out = {}
        for n in names:
            text = self.cluster.metrics(n)
            out[n] = (counter_sum(text, SERVED), counter_sum(text, HITS))
        return out

    def send(self, prompt: str, headers: dict[str, str] | None = None) -> Served:
        names = self.cluster.replicas()
        before = self._snapshot(names)
        status, _ = post(self.gw, completion(self.gw, prompt), headers)
        if status != 200:
            return Served(status, "", 0.0)
        # A replica may count the request a moment after the response: wait for one counter to move.
        deadline = time.monotonic() + self.settle_s
        while True:
            after = self._snapshot(names)
            moved = [n for n in names if after[n][0] > before[n][0]]
            if moved or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if len(moved) != 1:
            raise CheckFailed(f"one request moved {SERVED} on {moved or 'no replica'} (want exactly one)")
        n = moved[0]
        return Served(status, n, after[n][1] - before[n][1])


def check_affinity(obs: Observer, groups: int, per_group: int, words: int) -> dict[int, str]:
    """Each group's requests (one shared prefix) land on one replica, and hit its prefix cache
    from the second request on; distinct prefixes spread over more than one replica."""
    owner: dict[int, str] = {}
    for g in range(groups):
        served = [obs.send(f"{prefix(g, words)}\nQuestion {i}: why?") for i in range(per_group)]
        bad = [s.status for s in served if s.status != 200]
        if bad:
            raise CheckFailed(f"group {g}: HTTP {bad}")
        where = Counter(s.replica for s in served)
        top, count = where.most_common(1)[0]
        if count < per_group - 1:
            raise CheckFailed(f"group {g} was split over replicas: {dict(where)}")
        hits = sum(s.hit_tokens for s in served[1:] if s.replica == top)
        if hits <= 0:
            raise CheckFailed(f"group {g}: {top} served {count} requests with no prefix-cache hit")
        owner[g] = top
        print(f"affinity: group {g} -> {top} ({count}/{per_group}, {hits:.0f} cached tokens)")
    spread = Counter(owner.values())
    if len(spread) < 2:
        raise CheckFailed(f"all {groups} distinct prefixes went to one replica {dict(spread)}: no spreading")
    print(f"spreading: {groups} distinct prefixes over {len(spread)} replicas {dict(spread)}")
    return owner


def check_bad_json(gw: Gateway) -> None:
    """Malformed JSON and a body without ``model`` get 400 from the picker (via Envoy)."""
    for label, body in (("bad JSON", b'{"model": "m", "prompt": '), ("no model", b'{"prompt": "hi"}')):
        status, text = post(gw, body)
        if status != 400:
            raise CheckFailed(f"{label}: HTTP {status} (want 400): {text[:200]!r}")
        print(f"bad input: {label} -> 400")


def check_forged_header(obs: Observer, owner: dict[int, str], words: int) -> None:
    """A client's ``x-gateway-destination-endpoint`` never chooses the upstream: a request forged
    to name another replica, or an address that is no replica, still goes where the picker sends
    it (the prefix owner)."""
    group, home = next(iter(owner.items()))
    others = [n for n in obs.cluster.replicas() if n != home]
    targets = [obs.cluster.address(n) for n in others] + ["10.255.255.1:8000"]
    for target in targets:
        s = obs.send(f"{prefix(group, words)}\nForged: why?", {DEST_HEADER: target})
        if s.status != 200 or s.replica != home:
            raise CheckFailed(
                f"forged {DEST_HEADER}: {target}: HTTP {s.status} on {s.replica or 'none'} (want 200 on {home})"
            )
        print(f"forged header {target} ignored: served by {home}")


def check_kill(obs: Observer, victim: str, group: int, words: int, deadline_s: float) -> None:
    """After the replica that owns ``group`` is killed, that group's requests succeed again on a
    live replica within the deadline, and the next 10 in a row all do."""
    print(f"kill: {victim} ({obs.cluster.address(victim)})")
    obs.cluster.kill(victim)
    start, streak, failures = time.monotonic(), 0, 0
    while streak < 10:
        if time.monotonic() - start > deadline_s:
            raise CheckFailed(f"no 10 successes in a row within {deadline_s}s after killing {victim}")
        s = obs.send(f"{prefix(group, words)}\nAfter the kill {streak}: why?")
        if s.status == 200:  # and Observer.send saw exactly one live replica count it
            streak += 1
        else:
            streak, failures = 0, failures + 1
            time.sleep(0.2)
    print(f"kill: traffic moved off {victim} in {time.monotonic() - start:.1f}s ({failures} failed requests)")


def probe_grpc_health(address: str, services: Iterable[str] = ("liveness", "readiness")) -> None:
    """Probe the picker as a kubelet's gRPC probe does: ``grpc.health.v1.Health/Check`` with the
    probe's service name on the plaintext health port; anything but SERVING fails."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in services:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                raise CheckFailed(f"gRPC health {address} service {service!r}: {status}")
            print(f"probe: gRPC health {address} {service!r} -> {status}")


def wait_for(what: str, ok: Callable[[], bool], timeout_s: float, every_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


def run_all(
    cluster: Cluster,
    gw: Gateway,
    *,
    health: str | None,
    groups: int = 6,
    per_group: int = 4,
    words: int = 250,
    kill_deadline_s: float = 60.0,
) -> None:
    """Every check, in order: probes, bad input, affinity and spreading, forged header, kill."""
    if health:
        probe_grpc_health(health)
    check_bad_json(gw)
    obs = Observer(cluster, gw)
    owner = check_affinity(obs, groups, per_group, words)
    check_forged_header(obs, owner, words)
    check_kill(obs, owner[0], 0, words, kill_deadline_s)
    print("PASS: probes, bad input, affinity, spreading, forged header, kill")

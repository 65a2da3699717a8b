"""Faults under load, each turned into figures: a replica SIGKILLed or SIGSTOPped, the picker
SIGKILLed (fail-open and fail-close) and restarted, the picker SIGTERMed mid-stream, and the
Kubernetes API answering 410 Gone or dropping its watches.

Every scenario starts its own processes (kvlaunch/procs.py: upstream replicas, the picker,
a real Envoy), runs :class:`~bench.reliability.load.Load` through Envoy, injects the fault at
``t0`` and reads the figures from the request records. Times are seconds from the fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import signal
import socket
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvlaunch import PY, Procs, Stack, envoy_configs, free_port, post_json, wait_port

from . import checks
from .load import Load, Record, summary

Figures = dict[str, Any]


def _wait_routable(st: Stack, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while post_json(st.url + "/v1/completions", {"model": "m", "prompt": "warmup"})[0] != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"stack never routable:\n{st.procs.log('picker')[-2000:]}")
        time.sleep(0.2)


def _wait_addr(host: str, port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _one_upstream_each(st: Stack, host: str = "127.0.0.1") -> None:
    """Each replica in its own process (``up<i>``), so one can be killed or frozen."""
    for i, port in enumerate(st.upstreams):
        proc = st.procs.start(f"up{i}", [PY, "-m", "kvlaunch.upstream", "--ports", str(port), "--host", host])
        wait_port(port, proc=proc)


@contextlib.asynccontextmanager
async def _loaded(st: Stack, warmup: float, **load: Any) -> AsyncIterator[tuple[Load, float]]:
    """Load running for ``warmup`` s; yields (load, now); stops it and waits for in-flight ones."""
    gen = Load(st.url, **load)
    task = asyncio.create_task(gen.run())
    await asyncio.sleep(warmup)
    try:
        yield gen, time.monotonic()
    finally:
        gen.stop()
        await task


def _after(records: list[Record], t0: float) -> list[Record]:
    return [r for r in records if r.start >= t0]


def _in_flight_at(records: list[Record], t0: float) -> list[Record]:
    return [r for r in records if r.start < t0 < r.end]


async def replica_fault(tmp: pathlib.Path, sig: signal.Signals, hold: float = 4.0) -> Figures:
    """SIGKILL or SIGSTOP one of two replicas under load (ORIGINAL_DST, fail-close: the default
    config). ``last_new_request_s``: when the last request that started after the fault was still
    sent to the victim (failed, for SIGKILL; served by it late, for SIGSTOP, once SIGCONT wakes it).
    ``in_flight_failed``: requests in flight on it at the fault that did not complete."""
    st = Stack(Procs(tmp), [free_port(), free_port()])
    try:
        _one_upstream_each(st)
        await asyncio.to_thread(st.start_picker)
        await asyncio.to_thread(st.start_envoy)
        await asyncio.to_thread(_wait_routable, st)
        victim = st.upstreams[0]
        async with _loaded(st, 1.0, timeout=hold + 30) as (load, t0):
            st.procs.signal("up0", sig)
            await asyncio.sleep(hold)
            if sig == signal.SIGSTOP:
                st.procs.signal("up0", signal.SIGCONT)
        recs = load.records
        new = _after(recs, t0)
        hit = [r for r in new if (not r.ok) or r.served_by == victim]
        at_fault = [r for r in _in_flight_at(recs, t0) if r.served_by in (victim, 0)]
        slow = [r for r in new if r.served_by == victim and r.ok]
        stall = max((r.end - t0 for r in at_fault), default=0.0)
        return {
            **summary(recs),
            "last_new_request_s": round(max((r.start - t0 for r in hit), default=0.0), 3),
            "new_requests_hit": len(hit),
            "new_requests_failed": sum(not r.ok for r in new),
            "in_flight_at_fault": len(at_fault),
            "in_flight_failed": sum(not r.ok for r in at_fault),
            "stalled_then_served": len(slow),
            "in_flight_stall_s": round(stall, 3),
            "in_flight_after": checks.wait_in_flight_zero(st.metrics_port),
        }
    finally:
        st.procs.stop()


async def picker_kill(
    tmp: pathlib.Path, mode: str, down: float = 2.0, after: float = 5.0, render: tuple[str, ...] = ()
) -> Figures:
    """SIGKILL the picker under load, restart it ``down`` s later on the same ports. Fail-close
    uses deploy/envoy/envoy.yaml's rendering, fail-open envoy-failopen.yaml's. ``recovery_s``: from
    the restart to the first request after it that the picker routed and that succeeded."""
    st = Stack(Procs(tmp), [free_port(), free_port()])
    try:
        st.start_upstreams()
        await asyncio.to_thread(st.start_picker)
        name = "envoy-failopen.yaml" if mode == "open" else "envoy.yaml"
        await asyncio.to_thread(envoy_configs.start_envoy, st, name, *render)
        await asyncio.to_thread(_wait_routable, st)
        async with _loaded(st, 1.0) as (load, t0):
            await asyncio.to_thread(lambda: st.procs.signal("picker", signal.SIGKILL).wait(10))
            await asyncio.sleep(down)
            restart = time.monotonic()
            await asyncio.to_thread(st.start_picker)
            await asyncio.sleep(after)
        recs = load.records
        back = [r for r in _after(recs, restart) if r.ok and r.picked]
        outage = [r for r in recs if t0 <= r.start < restart]
        return {
            **summary(recs),
            "in_flight_at_kill": len(_in_flight_at(recs, t0)),
            "in_flight_failed": sum(not r.ok for r in _in_flight_at(recs, t0)),
            "outage_s": round(min((r.start for r in recs if r.start > t0 and r.ok), default=t0) - t0, 3),
            "during_outage": len(outage),
            "during_outage_failed": sum(not r.ok for r in outage),
            "during_outage_served_unpicked": sum(r.ok and not r.picked for r in outage),
            "after_restart_failed": sum(not r.ok for r in _after(recs, restart)),
            "recovery_s": round(min((r.end for r in back), default=float("nan")) - restart, 3),
            "in_flight_after": checks.wait_in_flight_zero(st.metrics_port),
        }
    finally:
        st.procs.stop()


async def picker_drain(tmp: pathlib.Path, streams: int = 16, length: float = 4.0) -> Figures:
    """SIGTERM the picker while ``streams`` generations of ``length`` s stream through Envoy: every
    stream must finish; the picker exits once they have (its drain, up to --drain-timeout)."""
    st = Stack(Procs(tmp), [free_port(), free_port()])
    try:
        st.start_upstreams()
        await asyncio.to_thread(st.start_picker)
        await asyncio.to_thread(st.start_envoy)
        await asyncio.to_thread(_wait_routable, st)
        gen = Load(st.url, delay=0.1)
        chunks = int(length / 0.1)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            tasks = [asyncio.create_task(gen.one(session, chunks)) for _ in range(streams)]
            await asyncio.sleep(length / 4)
            t0 = time.monotonic()
            proc = st.procs.signal("picker", signal.SIGTERM)
            during = await gen.one(session, 1)  # a new request while draining
            recs = await asyncio.gather(*tasks)
            code = await asyncio.to_thread(proc.wait, 60)
            exited = time.monotonic() - t0
        return {
            "streams": streams,
            "stream_s": length,
            "cut": sum(not r.ok for r in recs),
            "last_stream_end_s": round(max(r.end for r in recs) - t0, 3),
            "picker_exit_s": round(exited, 3),
            "picker_exit_code": code,
            "new_request_while_draining": during.status,
        }
    finally:
        st.procs.stop()


def _ready_pods(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "inference_pool_ready_pods":
            return sum(s.value for s in fam.samples)
    return -1.0


async def kube_watch_faults(tmp: pathlib.Path, hold: float = 3.0) -> Figures:
    """Two replicas found through a fake Kubernetes API (InferencePool + pods, list/watch); under
    load the API compacts its history (410 Gone on the open watches), then drops every watch mid-
    event. ``min_ready_pods`` is sampled every 50 ms: no endpoint may be lost."""
    from kvlaunch.fakekube import PODS, POOLS, FakeKube, pod, pool

    fake = FakeKube()
    server = await fake.start()
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: f\n"
        f"clusters: [{{name: f, cluster: {{server: '{server}'}}}}]\n"
        "contexts: [{name: f, context: {cluster: f, user: u}}]\nusers: [{name: u, user: {}}]\n"
    )
    port = free_port()
    st = Stack(Procs(tmp), [port, port])
    labels = {"app": "vllm"}
    fake.put(POOLS, "ns", pool("llm", labels, [port]))
    for i, ip in enumerate(("127.0.0.2", "127.0.0.3")):
        fake.put(PODS, "ns", pod(f"r{i}", ip=ip, labels=labels))
    try:
        for i, ip in enumerate(("127.0.0.2", "127.0.0.3")):
            st.procs.start(f"up{i}", [PY, "-m", "kvlaunch.upstream", "--ports", str(port), "--host", ip])
            await asyncio.to_thread(_wait_addr, ip, port)
        kube = ("--pool-name", "llm", "--pool-namespace", "ns")
        env = {"KUBECONFIG": str(kubeconfig)}
        await asyncio.to_thread(lambda: st.start_picker(*kube, endpoints=[], env=env))
        await asyncio.to_thread(st.start_envoy)
        await asyncio.to_thread(_wait_routable, st)
        ready: list[float] = []

        async def sample() -> None:
            while True:
                ready.append(await asyncio.to_thread(_ready_pods, st.metrics_port))
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        async with _loaded(st, 1.0) as (load, _t0):
            fake.expire()  # 410 Gone: the picker must re-list
            await asyncio.sleep(hold)
            dropped = fake.drop_watches(torn=True)
            await asyncio.sleep(hold)
        sampler.cancel()
        served = {r.dest for r in load.records if r.ok}
        return {
            **summary(load.records),
            "watches_dropped": dropped,
            "relists": len(fake.list_requests(PODS)),
            "min_ready_pods": min(ready),
            "replicas_serving": len(served),
        }
    finally:
        st.procs.stop()
        await fake.stop()

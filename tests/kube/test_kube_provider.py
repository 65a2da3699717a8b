"""KubeProvider against a local fake API server (kvlaunch/fakekube.py), through the real
``kubernetes`` client: list, watch, bookmarks, 410 Gone, dropped and silent streams, pools."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterable

import pytest
from kubernetes import client as k8s

from kvlaunch.fakekube import OBJECTIVES, PODS, POOLS, FakeKube, objective, pod, pool
from picker.core.endpoints.types import Endpoint
from picker.core.objectives import Objectives
from picker.feeds.discovery.kube import KubeProvider, PodView, PoolSpec, WatchConfig, parse_ports

pytestmark = pytest.mark.kube
NS = "serving"
FAST = WatchConfig(
    server_timeout_s=300,
    silence_timeout_s=30.0,
    connect_timeout_s=10.0,
    backoff_initial_s=0.05,
    backoff_max_s=0.4,
)


class Recorder:
    """An EndpointSink that keeps every set pushed."""

    def __init__(self) -> None:
        self.sets: list[list[Endpoint]] = []

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        self.sets.append(list(endpoints))

    @property
    def keys(self) -> set[str] | None:
        return {ep.key for ep in self.sets[-1]} if self.sets else None


async def eventually(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.fixture
async def fake() -> AsyncIterator[FakeKube]:
    api = FakeKube()
    await api.start()
    yield api
    await api.stop()


def provider(fake: FakeKube, cfg: WatchConfig = FAST, **kw: object) -> KubeProvider:
    api = k8s.ApiClient(k8s.Configuration(host=f"http://127.0.0.1:{fake.port}"))
    return KubeProvider(api, NS, watch=cfg, **kw)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running(prov: KubeProvider) -> AsyncIterator[Recorder]:
    sink = Recorder()
    task = asyncio.create_task(prov.run(sink))
    try:
        yield sink
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)


def seed(fake: FakeKube, ports: list[int] | None = None) -> None:
    fake.put(POOLS, NS, pool("llm", {"app": "vllm"}, ports or [8000]))
    fake.put(PODS, NS, pod("a", "10.0.0.1"))
    fake.put(PODS, NS, pod("b", "10.0.0.2", ready=False))
    fake.put(PODS, NS, pod("c", ""))  # ready, but no IP yet
    fake.put(PODS, NS, pod("d", "10.0.0.4", labels={"app": "other"}))
    fake.put(PODS, NS, pod("e", "10.0.0.5", terminating=True))
    fake.put(PODS, "elsewhere", pod("f", "10.0.0.6"))


async def test_initial_list_keeps_only_ready_matching_pods_with_ip(fake: FakeKube) -> None:
    seed(fake)
    prov = provider(fake, dataclasses.replace(FAST, list_page_size=2), pool_name="llm")
    async with running(prov) as sink:
        await eventually(lambda: sink.keys is not None, "the first push")
        assert sink.keys == {"10.0.0.1:8000"}
        assert [ep.name for ep in sink.sets[-1]] == ["a-rank-0"]
        pages = fake.list_requests(PODS)
        assert len(pages) >= 3 and any("continue" in r.query for r in pages), "the pod list was not paged"
        assert fake.list_requests(POOLS)[0].query["fieldSelector"] == "metadata.name=llm"
        await eventually(lambda: len(fake.watch_requests(PODS)) >= 1, "the pod watch")
        q = fake.watch_requests(PODS)[0].query
        assert q["allowWatchBookmarks"] == "true" and q["resourceVersion"] == pages[0].query.get(
            "resourceVersion", q["resourceVersion"]
        )
        assert int(q["resourceVersion"]) == fake.rv, "the watch did not start from the list's resourceVersion"


async def test_pod_ready_unready_and_deleted(fake: FakeKube) -> None:
    seed(fake)
    async with running(provider(fake, pool_name="llm")) as sink:
        await eventually(lambda: sink.keys == {"10.0.0.1:8000"}, "the initial set")
        fake.put(PODS, NS, pod("b", "10.0.0.2", ready=True))
        await eventually(lambda: sink.keys == {"10.0.0.1:8000", "10.0.0.2:8000"}, "b to become ready")
        fake.put(PODS, NS, pod("c", "10.0.0.3"))
        await eventually(lambda: sink.keys == {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}, "c's IP")
        fake.put(PODS, NS, pod("a", "10.0.0.1", ready=False))
        await eventually(lambda: sink.keys == {"10.0.0.2:8000", "10.0.0.3:8000"}, "a to become unready")
        fake.put(PODS, NS, pod("b", "10.0.0.2", terminating=True))
        await eventually(lambda: sink.keys == {"10.0.0.3:8000"}, "terminating b to leave")
        fake.delete(PODS, NS, "c")
        await eventually(lambda: sink.keys == set(), "c's deletion")
        assert fake.list_requests(PODS) and len(fake.list_requests(PODS)) == 1, (
            "a plain event caused a re-list"
        )


async def test_bookmark_advances_resource_version(fake: FakeKube) -> None:
    seed(fake)
    prov = provider(fake, pool_name="llm")
    async with running(prov) as sink:
        await eventually(lambda: sink.keys is not None and len(fake.watch_requests(PODS)) == 1, "the watch")
        mark = fake.bookmark(PODS)
        await eventually(lambda: prov.watch_state["pods"].rv == str(mark), "the bookmark's RV")
        fake.drop_watches()
        await eventually(lambda: len(fake.watch_requests(PODS)) >= 2, "the reconnect")
        assert fake.watch_requests(PODS)[1].query["resourceVersion"] == str(mark)
        assert len(fake.list_requests(PODS)) == 1, "a dropped stream caused a re-list"


async def test_410_gone_event_relists(fake: FakeKube) -> None:
    seed(fake)
    prov = provider(fake, pool_name="llm")
    async with running(prov) as sink:
        await eventually(lambda: sink.keys == {"10.0.0.1:8000"} and fake.watchers, "the initial set")
        fake.put(PODS, NS, pod("b", "10.0.0.2"), quiet=True)  # its event is lost to compaction
        fake.expire()
        await eventually(lambda: sink.keys == {"10.0.0.1:8000", "10.0.0.2:8000"}, "the re-list to find b")
        assert len(fake.list_requests(PODS)) == 2
        await eventually(
            lambda: int(fake.watch_requests(PODS)[-1].query["resourceVersion"]) >= fake.compacted_below,
            "a watch from the re-list's resourceVersion",
        )


async def test_410_at_connect_relists(fake: FakeKube) -> None:
    seed(fake)
    async with running(provider(fake, pool_name="llm")) as sink:
        await eventually(lambda: sink.keys == {"10.0.0.1:8000"} and fake.watchers, "the initial set")
        fake.put(PODS, NS, pod("b", "10.0.0.2"), quiet=True)
        fake.expire(notify_open=False)
        fake.drop_watches()
        await eventually(lambda: sink.keys == {"10.0.0.1:8000", "10.0.0.2:8000"}, "the re-list to find b")
        assert len(fake.list_requests(PODS)) == 2


async def test_dropped_connection_backs_off_and_resumes(
    fake: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="picker.feeds.discovery.kube")
    seed(fake)
    prov = provider(fake, selector="app=vllm", target_ports=[8000])
    async with running(prov) as sink:
        await eventually(lambda: sink.keys == {"10.0.0.1:8000"} and fake.watchers, "the initial set")
        rv = prov.watch_state["pods"].rv
        fake.fail_next(500, 503, 500)
        fake.drop_watches(torn=True)
        fake.put(PODS, NS, pod("b", "10.0.0.2"))  # arrives while the client is backing off
        await eventually(lambda: sink.keys == {"10.0.0.1:8000", "10.0.0.2:8000"}, "the resumed watch")
        delays = [float(m) for m in re.findall(r"retrying in ([0-9.]+)s", caplog.text)]
        assert delays[:4] == [0.05, 0.1, 0.2, 0.4], f"backoff did not grow: {delays}"
        resumed = [r for r in fake.watch_requests(PODS) if r.query.get("resourceVersion") == rv]
        assert len(resumed) >= 4, "the client did not resume from its last resourceVersion"
        assert len(fake.list_requests(PODS)) == 1, "a dropped stream caused a re-list"
        assert prov.watch_state["pods"].errors == 4


async def test_silent_stream_reconnects(fake: FakeKube) -> None:
    seed(fake)
    cfg = dataclasses.replace(FAST, silence_timeout_s=1.0)
    async with running(provider(fake, cfg, pool_name="llm")) as sink:
        await eventually(lambda: sink.keys == {"10.0.0.1:8000"} and fake.watchers, "the initial set")
        before = len(fake.watch_requests(PODS))
        fake.silence(PODS)
        fake.drop_watches()
        await eventually(lambda: len(fake.watch_requests(PODS)) == before + 1, "the silent watch")
        fake.put(PODS, NS, pod("b", "10.0.0.2"))  # the silent stream never says so
        await eventually(
            lambda: sink.keys == {"10.0.0.1:8000", "10.0.0.2:8000"}, "the reconnect after silence"
        )
        assert len(fake.watch_requests(PODS)) >= before + 2


async def test_server_timeout_rewatches_without_relist(fake: FakeKube) -> None:
    seed(fake)
    cfg = dataclasses.replace(FAST, server_timeout_s=1)
    async with running(provider(fake, cfg, pool_name="llm")) as sink:
        await eventually(lambda: len(fake.watch_requests(PODS)) >= 3, "watches ended by timeoutSeconds")
        fake.put(PODS, NS, pod("b", "10.0.0.2"))
        await eventually(lambda: sink.keys == {"10.0.0.1:8000", "10.0.0.2:8000"}, "b")
        assert len(fake.list_requests(PODS)) == 1
        assert fake.watch_requests(PODS)[0].query["timeoutSeconds"] == "1"


async def test_pool_target_ports_selector_and_lifecycle(fake: FakeKube) -> None:
    seed(fake)
    async with running(provider(fake, pool_name="llm")) as sink:
        await eventually(lambda: sink.keys == {"10.0.0.1:8000"}, "the initial set")
        fake.put(POOLS, NS, pool("llm", {"app": "vllm"}, [8000, 8001]))
        await eventually(lambda: sink.keys == {"10.0.0.1:8000", "10.0.0.1:8001"}, "one endpoint per rank")
        assert [ep.name for ep in sink.sets[-1]] == ["a-rank-0", "a-rank-1"]
        fake.put(POOLS, NS, pool("llm", {"app": "other"}, [9000]))
        await eventually(lambda: sink.keys == {"10.0.0.4:9000"}, "the new selector")
        fake.delete(POOLS, NS, "llm")
        await eventually(lambda: sink.keys == set(), "no pool, no endpoints")
        fake.put(POOLS, NS, pool("llm", {"app": "vllm"}, [8000]))
        await eventually(lambda: sink.keys == {"10.0.0.1:8000"}, "the recreated pool")
        fake.put(POOLS, NS, pool("other-pool", {"app": "other"}, [1]))
        fake.put(PODS, NS, pod("g", "10.0.0.7"))
        await eventually(lambda: sink.keys == {"10.0.0.1:8000", "10.0.0.7:8000"}, "g")


async def test_pool_created_after_start(fake: FakeKube) -> None:
    fake.put(PODS, NS, pod("a", "10.0.0.1"))
    async with running(provider(fake, pool_name="llm")) as sink:
        await eventually(lambda: sink.keys == set(), "an empty set while the pool is missing")
        fake.put(POOLS, NS, pool("llm", {"app": "vllm"}, [8000]))
        await eventually(lambda: sink.keys == {"10.0.0.1:8000"}, "the pool's endpoints")


async def test_selector_mode(fake: FakeKube) -> None:
    seed(fake)
    prov = provider(fake, selector="app=vllm", target_ports=[8000, 8001])
    async with running(prov) as sink:
        await eventually(lambda: sink.keys == {"10.0.0.1:8000", "10.0.0.1:8001"}, "the initial set")
        assert all(r.query["labelSelector"] == "app=vllm" for r in fake.requests if r.resource == PODS)
        assert not fake.list_requests(POOLS), "selector mode must not read InferencePools"
        fake.put(PODS, NS, pod("a", "10.0.0.1", labels={"app": "moved"}))  # leaves the selector
        await eventually(lambda: sink.keys == set(), "a to leave the selector")
        fake.put(PODS, NS, pod("d", "10.0.0.4", labels={"app": "vllm"}))  # enters it
        await eventually(lambda: sink.keys == {"10.0.0.4:8000", "10.0.0.4:8001"}, "d to enter the selector")


async def test_cancel_does_not_wait_for_the_silence_timeout(fake: FakeKube) -> None:
    seed(fake)
    cfg = dataclasses.replace(FAST, silence_timeout_s=600.0)
    prov = provider(fake, cfg, pool_name="llm")
    sink = Recorder()
    task = asyncio.create_task(prov.run(sink))
    await eventually(lambda: sink.keys is not None and len(fake.watchers) == 2, "both watches open")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 20)
    # the reader threads were unblocked: the default executor shuts down without waiting 600 s
    await asyncio.wait_for(asyncio.get_running_loop().shutdown_default_executor(), 20)


def test_from_flags_validation() -> None:
    api = k8s.ApiClient(k8s.Configuration(host="http://127.0.0.1:9"))
    prov = KubeProvider.from_flags("llm", "ns", None, None, api=api)
    assert prov.pool_name == "llm" and prov.namespace == "ns" and prov.pool is None
    sel = KubeProvider.from_flags(None, None, "app=vllm", "8000,8001", api=api)
    assert sel.namespace == "default" and sel.pool == PoolSpec({}, (8000, 8001))
    for args, msg in [
        (("llm", "ns", "app=x", "8000"), "exactly one"),
        ((None, "ns", None, None), "exactly one"),
        ((None, "ns", "app=x", None), "needs --endpoint-target-ports"),
        (("llm", "ns", None, "8000"), "is for --endpoint-selector"),
        ((None, "ns", "app=x", "0"), "1..65535"),
    ]:
        with pytest.raises(ValueError, match=msg):
            KubeProvider.from_flags(*args, api=api)
    with pytest.raises(ValueError):
        parse_ports("80,x")


def test_parsers() -> None:
    spec = PoolSpec.parse(pool("llm", {"app": "vllm"}, [8000, 8001], picker="epp"))
    assert spec == PoolSpec({"app": "vllm"}, (8000, 8001), "epp:9002", "FailClose")
    with pytest.raises(ValueError, match="matchLabels"):
        PoolSpec.parse({"spec": {"targetPorts": [{"number": 1}]}})
    view = PodView.parse(pod("p", "10.1.1.1"))
    assert view.endpoints([1, 2]) == [
        Endpoint("10.1.1.1", 1, "p-rank-0"),
        Endpoint("10.1.1.1", 2, "p-rank-1"),
    ]
    assert PodView.parse(pod("p", "10.1.1.1", ready=False)).endpoints([1]) == []
    assert PodView.parse({"metadata": {"name": "bare"}}).endpoints([1]) == []


async def test_inference_objectives_feed_priorities_and_win_over_config(fake: FakeKube) -> None:
    """The pool's InferenceObjective objects set priorities (unset = 0); an object wins over a
    config entry of the same name; another pool's objects are ignored; a deleted object falls
    back to config; a new object arrives by the watch, not a re-list."""
    seed(fake)
    fake.put(OBJECTIVES, NS, objective("batch", "llm", -1))
    fake.put(OBJECTIVES, NS, objective("plain", "llm"))
    fake.put(OBJECTIVES, NS, objective("theirs", "other-pool", 7))
    store = Objectives({"batch": 5, "pinned": 3}, default=1)
    prov = provider(fake, pool_name="llm")
    prov.attach_objectives(store)
    async with running(prov) as sink:
        await eventually(lambda: sink.keys is not None and prov.objective_crd is True, "the objective list")
        assert dict(store.from_crd) == {"batch": -1, "plain": 0}
        assert store.priority("batch") == -1, "the object must win over the config entry"
        assert (store.priority("pinned"), store.priority("theirs"), store.priority("")) == (3, 1, 1)
        await eventually(lambda: len(fake.watch_requests(OBJECTIVES)) >= 1, "the objective watch")
        fake.put(OBJECTIVES, NS, objective("critical", "llm", 10))
        await eventually(lambda: store.priority("critical") == 10, "a new object by the watch")
        fake.put(OBJECTIVES, NS, objective("plain", "other-pool", 4))
        await eventually(lambda: "plain" not in store.from_crd, "an object moved to another pool")
        fake.delete(OBJECTIVES, NS, "batch")
        await eventually(lambda: store.priority("batch") == 5, "the deleted object's config fallback")
        assert len(fake.list_requests(OBJECTIVES)) == 1, "a plain event caused a re-list"


async def test_no_objective_crd_falls_back_to_config(caplog: pytest.LogCaptureFixture) -> None:
    """Without the CRD (its list is a 404) discovery still works, priorities come from config, and
    one log line says so."""
    fake = FakeKube(objective_crd=False)
    await fake.start()
    try:
        seed(fake)
        store = Objectives({"batch": -1})
        prov = provider(fake, pool_name="llm")
        prov.attach_objectives(store)
        with caplog.at_level(logging.INFO, logger="picker.feeds.discovery.kube"):
            async with running(prov) as sink:
                await eventually(
                    lambda: sink.keys == {"10.0.0.1:8000"} and prov.objective_crd is False, "sync"
                )
                await asyncio.sleep(0.3)  # no retries follow
        assert store.priority("batch") == -1 and not store.from_crd
        lines = [r.getMessage() for r in caplog.records if "InferenceObjective" in r.getMessage()]
        assert lines == ["InferenceObjective CRD not installed: objective priorities come from config only"]
    finally:
        await fake.stop()


async def test_objective_list_error_does_not_stop_discovery(fake: FakeKube) -> None:
    """A transient error on the first objective list (not a 404) is retried; pods and pool are
    unaffected."""
    seed(fake)
    fake.put(OBJECTIVES, NS, objective("batch", "llm", -1))
    fake.fail_next(500, 500, 500)  # whichever first requests they hit
    store = Objectives({})
    prov = provider(fake, pool_name="llm")
    prov.attach_objectives(store)
    async with running(prov) as sink:
        await eventually(lambda: sink.keys == {"10.0.0.1:8000"}, "discovery despite the errors")
        await eventually(lambda: store.priority("batch") == -1, "the objectives after a retry")
        assert prov.objective_crd is True

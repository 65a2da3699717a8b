"""Kubernetes discovery: endpoints from an InferencePool (``inference.networking.k8s.io/v1``) or
from a plain pod label selector, watched the kopf way.

Each collection (pods; the one pool) runs its own loop:

1. **List** (paged), remembering the list's ``resourceVersion`` (RV).
2. **Watch** from that RV with ``allowWatchBookmarks``; every event and every bookmark advances
   the RV, so a reconnect resumes exactly where the stream stopped.
3. **410 Gone** (an ``ERROR`` event, or an HTTP 410) means the RV was compacted away: re-list,
   never retry the stale RV.
4. **Other errors** (HTTP errors, dropped connections, torn JSON) back off exponentially, then
   resume the watch from the last RV. The backoff resets once a request succeeds.
5. **Silence**: the client read timeout closes a stream that has sent nothing (not even a
   bookmark) for ``silence_timeout_s``; the loop reconnects from the same RV at once.

The official client is synchronous: every blocking call (list, opening a watch, reading the
next line) runs in a worker thread, so the event loop never blocks. Cancelling ``run`` shuts the
open watch socket down, which unblocks its reader thread.

Invariants:
- Only pods that are Ready, have a pod IP and are not terminating become endpoints.
- Every target port of such a pod is its own :class:`Endpoint` (one per data-parallel rank),
  named ``<pod>-rank-<i>`` as GIE names them.
- The sink receives the complete set, and only when it differs from the last one pushed.

In pool mode, with an :class:`~picker.core.objectives.Objectives` store attached, the namespace's
InferenceObjective objects are watched the same way and those whose ``spec.poolRef.name`` is the
pool feed it (name → ``spec.priority``). A 404 on their first list means the CRD is not installed
(403: the picker may not read them): one log line, and priorities come from config only. The
objective watch never holds readiness back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from picker.core.endpoints.types import ROLE_LABEL, Endpoint, EndpointSink, parse_role
from picker.core.objectives import Objectives

log = logging.getLogger(__name__)
GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
OBJ_GROUP, OBJ_VERSION, OBJ_PLURAL = "inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives"
"""GIE's InferenceObjective CRD: ``spec.priority`` (int, unset = 0) and ``spec.poolRef.name``."""
Obj = dict[str, Any]


@dataclass(frozen=True)
class WatchConfig:
    server_timeout_s: int = 300
    """``timeoutSeconds`` asked of the API server: it ends each watch cleanly after this long."""
    silence_timeout_s: float = 90.0
    """Client read timeout. API servers send a bookmark about once a minute, so a stream silent
    for longer is presumed dead and reopened from the same RV."""
    connect_timeout_s: float = 10.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    backoff_factor: float = 2.0
    list_page_size: int = 500


@dataclass(frozen=True)
class PoolSpec:
    """What the picker needs from an InferencePool's spec."""

    match_labels: Mapping[str, str]
    target_ports: tuple[int, ...]
    picker_ref: str = ""
    """``spec.endpointPickerRef`` as ``name:port`` (informational: the gateway dials it)."""
    failure_mode: str = "FailClose"

    @classmethod
    def parse(cls, pool: Obj) -> PoolSpec:
        spec = pool.get("spec") or {}
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or [])
        ref = spec.get("endpointPickerRef") or {}
        port = (ref.get("port") or {}).get("number", "")
        if not labels or not ports:
            raise ValueError("InferencePool needs spec.selector.matchLabels and spec.targetPorts")
        return cls(
            match_labels={str(k): str(v) for k, v in labels.items()},
            target_ports=ports,
            picker_ref=f"{ref.get('name', '')}:{port}" if ref else "",
            failure_mode=str(ref.get("failureMode", "FailClose")),
        )


@dataclass(frozen=True)
class PodView:
    """The fields of a Pod that discovery reads, parsed once per event."""

    name: str
    labels: Mapping[str, str]
    ip: str
    ready: bool

    @classmethod
    def parse(cls, pod: Obj) -> PodView:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        conditions = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        terminating = meta.get("deletionTimestamp") is not None
        return cls(
            name=str(meta.get("name", "")),
            labels=dict(meta.get("labels") or {}),
            ip=str(status.get("podIP") or ""),
            ready=ready and not terminating,
        )

    def endpoints(self, ports: Sequence[int]) -> list[Endpoint]:
        """The pod's serving ports, each with the pod's ``llm-d.ai/role`` (unset: ``both``). A pod
        with another role value (llm-d's ``encode``, a typo) serves none of our requests: none."""
        if not (self.ready and self.ip):
            return []
        try:
            role = parse_role(self.labels.get(ROLE_LABEL))
        except ValueError as exc:
            log.warning("pod %s: label %s: %s; not routed", self.name, ROLE_LABEL, exc)
            return []
        return [Endpoint(self.ip, port, f"{self.name}-rank-{i}", role) for i, port in enumerate(ports)]


def objective_priority(obj: Obj, pool_name: str) -> int | None:
    """An InferenceObjective's priority when its ``spec.poolRef`` names pool ``pool_name`` (kind
    InferencePool), else None. An unset priority is 0, as GIE reads it; a non-integer one makes the
    object count as absent."""
    spec = obj.get("spec") or {}
    ref = spec.get("poolRef") or {}
    if ref.get("name") != pool_name or ref.get("kind", "InferencePool") != "InferencePool":
        return None
    prio = spec.get("priority", 0)
    if isinstance(prio, bool) or not isinstance(prio, int):
        log.warning("InferenceObjective %s: priority %r is not an integer: ignored", _name(obj), prio)
        return None
    return prio


def _name(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def parse_ports(spec: str | None) -> tuple[int, ...]:
    ports = tuple(int(p) for p in (spec or "").split(",") if p.strip())
    if not all(0 < p < 65536 for p in ports):
        raise ValueError(f"target ports must be in 1..65535, got {spec!r}")
    return ports


class Gone(Exception):
    """The watch's resourceVersion was compacted away (HTTP 410): the collection must be re-listed."""


class WatchError(Exception):
    """An ``ERROR`` watch event other than 410."""


@dataclass(frozen=True)
class Collection:
    """How to list and watch one namespaced collection; ``lister`` is a generated client method
    (``list_namespaced_pod``, or ``list_namespaced_custom_object`` with its group bound)."""

    what: str
    lister: Callable[..., Any]
    args: tuple[str, ...]
    selectors: Mapping[str, str] = field(default_factory=dict)

    def list(self, cfg: WatchConfig) -> tuple[list[Obj], str]:
        items: list[Obj] = []
        token: str | None = None
        while True:
            page = self._get(cfg, limit=cfg.list_page_size, _continue=token)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            token = meta.get("continue") or None
            if token is None:
                return items, str(meta.get("resourceVersion", ""))

    def _get(self, cfg: WatchConfig, **params: Any) -> Obj:
        resp = self.lister(*self.args, **self.selectors, **params, **self._opts(cfg))
        try:
            doc: Obj = orjson.loads(resp.data)
            return doc
        finally:
            resp.release_conn()

    def watch(self, cfg: WatchConfig, rv: str) -> urllib3.BaseHTTPResponse:
        resp: urllib3.BaseHTTPResponse = self.lister(
            *self.args,
            **self.selectors,
            watch=True,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=cfg.server_timeout_s,
            **self._opts(cfg),
        )
        return resp

    @staticmethod
    def _opts(cfg: WatchConfig) -> dict[str, Any]:
        return {"_preload_content": False, "_request_timeout": (cfg.connect_timeout_s, cfg.silence_timeout_s)}


def _lines(resp: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
    """Split a chunked watch body into JSON lines as the chunks arrive."""
    buf = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buf += chunk
        *whole, buf = buf.split(b"\n")
        yield from (line for line in whole if line.strip())
    if buf.strip():
        raise ValueError(f"watch stream ended inside an event ({len(buf)} bytes)")


def _abort(resp: urllib3.BaseHTTPResponse) -> None:
    """Unblock a thread reading ``resp`` (SHUT_RD), then close it."""
    with contextlib.suppress(AttributeError, ValueError, RuntimeError, OSError):
        resp.shutdown()
    with contextlib.suppress(OSError, ValueError):
        resp.close()


async def _events(coll: Collection, cfg: WatchConfig, rv: str) -> AsyncGenerator[Obj, None]:
    resp = await asyncio.to_thread(coll.watch, cfg, rv)
    try:
        lines = _lines(resp)
        while (line := await asyncio.to_thread(next, lines, None)) is not None:
            yield orjson.loads(line)
    finally:
        _abort(resp)


OnList = Callable[[list[Obj]], None]
OnEvent = Callable[[str, Obj], None]
RETRIABLE = (k8s.ApiException, urllib3.exceptions.HTTPError, OSError, ValueError, WatchError)


@dataclass
class WatchState:
    """Progress of one :func:`watch_forever` loop (for logs, debugging and tests)."""

    rv: str | None = None
    """The last resourceVersion seen (list, event or bookmark); None means "must re-list"."""
    lists: int = 0
    events: int = 0
    errors: int = 0


async def watch_forever(
    coll: Collection, cfg: WatchConfig, on_list: OnList, on_event: OnEvent, state: WatchState | None = None
) -> None:
    """List, then watch from the RV, forever (module docstring, steps 1-5). Returns only when
    cancelled; callbacks run on the event loop."""
    st = state or WatchState()
    delay, gone_in_a_row = cfg.backoff_initial_s, 0
    while True:
        try:
            if st.rv is None:
                items, rv = await asyncio.to_thread(coll.list, cfg)
                on_list(items)
                st.rv, st.lists = rv, st.lists + 1
                delay = delay if gone_in_a_row else cfg.backoff_initial_s
                log.debug("%s: listed %d at rv %s", coll.what, len(items), rv)
            async with contextlib.aclosing(_events(coll, cfg, st.rv)) as events:
                async for event in events:
                    st.rv = _apply(coll.what, event, on_event) or st.rv
                    st.events, delay, gone_in_a_row = st.events + 1, cfg.backoff_initial_s, 0
            log.debug("%s: the server ended the watch at rv %s; resuming", coll.what, st.rv)
            continue
        except urllib3.exceptions.ReadTimeoutError:
            log.info("%s: silent for %gs; reconnecting from rv %s", coll.what, cfg.silence_timeout_s, st.rv)
            continue
        except (Gone, *RETRIABLE) as exc:
            if isinstance(exc, Gone) or (isinstance(exc, k8s.ApiException) and exc.status == 410):
                log.info("%s: rv %s expired (%s); re-listing", coll.what, st.rv, _brief(exc))
                st.rv, gone_in_a_row = None, gone_in_a_row + 1
                if gone_in_a_row < 2:  # expiring again with no event between would loop: back off
                    continue
            st.errors += 1
            log.warning("%s: %s; retrying in %gs", coll.what, _brief(exc), delay)
        await asyncio.sleep(delay)
        delay = min(delay * cfg.backoff_factor, cfg.backoff_max_s)


def _apply(what: str, event: Obj, on_event: OnEvent) -> str | None:
    """Apply one watch event; returns its RV (bookmarks carry only that)."""
    kind, obj = event.get("type"), event.get("object") or {}
    if kind == "ERROR":
        if obj.get("code") == 410:
            raise Gone(obj.get("message", "410 Gone"))
        raise WatchError(f"watch error {obj.get('code')}: {obj.get('message')}")
    if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
        raise WatchError(f"{what}: unknown watch event type {kind!r}")
    if kind != "BOOKMARK":
        on_event(kind, obj)
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv else None


def _brief(exc: Exception) -> str:
    if isinstance(exc, k8s.ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


def default_api_client() -> k8s.ApiClient:
    """In-cluster service account config, else the local kubeconfig."""
    cfg = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except k8s_config.ConfigException:
        try:
            k8s_config.load_kube_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except (k8s_config.ConfigException, OSError) as exc:
            raise ValueError(f"no Kubernetes API config (not in a cluster, no kubeconfig): {exc}") from exc
    return k8s.ApiClient(cfg)


class KubeProvider:
    """Endpoints from one InferencePool (``pool_name``) or one label selector (``selector`` with
    ``target_ports``), in one namespace.

    In pool mode the pods of the whole namespace are watched and matched against the pool's
    ``matchLabels`` here, so a selector change needs no new watch. In selector mode the API
    server filters (any label selector syntax works)."""

    def __init__(
        self,
        api: k8s.ApiClient,
        namespace: str,
        *,
        pool_name: str | None = None,
        selector: str | None = None,
        target_ports: Sequence[int] = (),
        watch: WatchConfig | None = None,
    ) -> None:
        if (pool_name is None) == (selector is None):
            raise ValueError("give exactly one of --pool-name or --endpoint-selector")
        if selector is not None and not target_ports:
            raise ValueError("--endpoint-selector needs --endpoint-target-ports")
        if pool_name is not None and target_ports:
            raise ValueError("--endpoint-target-ports is for --endpoint-selector; a pool has targetPorts")
        self.namespace, self.pool_name, self.cfg = namespace, pool_name, watch or WatchConfig()
        self.pool: PoolSpec | None = PoolSpec({}, tuple(target_ports)) if selector is not None else None
        self._pods: dict[str, PodView] = {}
        self._synced = {"pods": False, "pool": pool_name is None}
        self._sink: EndpointSink | None = None
        self.watch_state = {"pods": WatchState(), "pool": WatchState()}
        self._pushed: frozenset[Endpoint] | None = None
        core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
        sel = {"label_selector": selector} if selector else {}
        self._pod_coll = Collection(f"pods in {namespace}", core.list_namespaced_pod, (namespace,), sel)
        self._pool_coll = Collection(
            f"inferencepool {namespace}/{pool_name}",
            custom.list_namespaced_custom_object,
            (GROUP, VERSION, namespace, PLURAL),
            {"field_selector": f"metadata.name={pool_name}"},
        )
        self._objective_coll = Collection(
            f"inferenceobjectives in {namespace}",
            custom.list_namespaced_custom_object,
            (OBJ_GROUP, OBJ_VERSION, namespace, OBJ_PLURAL),
        )
        self.objectives: Objectives | None = None
        """Fed from InferenceObjective objects (pool mode); None: not watched."""
        self.objective_crd: bool | None = None
        """Whether the CRD answered its first list; None until then (or when not watched)."""

    @classmethod
    def from_flags(
        cls,
        pool_name: str | None,
        pool_namespace: str | None,
        endpoint_selector: str | None,
        endpoint_target_ports: str | None,
        api: k8s.ApiClient | None = None,
        watch: WatchConfig | None = None,
    ) -> KubeProvider:
        """GIE's flags: ``--pool-name``, ``--pool-namespace``, ``--endpoint-selector``,
        ``--endpoint-target-ports`` (comma-separated). Raises ValueError on bad flags."""
        return cls(
            api or default_api_client(),
            pool_namespace or "default",
            pool_name=pool_name or None,
            selector=endpoint_selector or None,
            target_ports=parse_ports(endpoint_target_ports),
            watch=watch,
        )

    def endpoints(self) -> list[Endpoint]:
        pool = self.pool
        if pool is None:
            return []
        out: list[Endpoint] = []
        for pod in self._pods.values():
            if all(pod.labels.get(k) == v for k, v in pool.match_labels.items()):
                out.extend(pod.endpoints(pool.target_ports))
        return sorted(out, key=lambda ep: ep.name)

    async def run(self, sink: EndpointSink) -> None:
        self._sink = sink
        async with asyncio.TaskGroup() as tg:
            st = self.watch_state
            tg.create_task(
                watch_forever(self._pod_coll, self.cfg, self._on_pod_list, self._on_pod, st["pods"])
            )
            if self.pool_name is not None:
                pool_coll = self._pool_coll
                tg.create_task(
                    watch_forever(pool_coll, self.cfg, self._on_pool_list, self._on_pool, st["pool"])
                )
                if self.objectives is not None:
                    tg.create_task(self._watch_objectives())

    def attach_objectives(self, objectives: Objectives) -> None:
        """Feed ``objectives`` from the pool's InferenceObjective objects (pool mode only)."""
        if self.pool_name is not None:
            self.objectives = objectives

    async def _watch_objectives(self) -> None:
        """The first list decides whether the CRD exists (404: no; 403: not allowed); then the
        usual list-and-watch loop, resuming from that list's RV."""
        state = self.watch_state.setdefault("objectives", WatchState())
        coll = self._objective_coll
        try:
            items, rv = await asyncio.to_thread(coll.list, self.cfg)
        except k8s.ApiException as exc:
            if exc.status in (403, 404):
                self.objective_crd = False
                why = "not installed" if exc.status == 404 else "not readable (RBAC)"
                log.info("InferenceObjective CRD %s: objective priorities come from config only", why)
                return
            log.warning("%s: %s; listing again with backoff", coll.what, _brief(exc))
        except RETRIABLE as exc:  # a transient failure: the loop below lists again, backing off
            log.warning("%s: %s; listing again with backoff", coll.what, _brief(exc))
        else:
            self._on_objective_list(items)
            state.rv, state.lists = rv, 1
        await watch_forever(coll, self.cfg, self._on_objective_list, self._on_objective, state)

    def _on_objective_list(self, items: list[Obj]) -> None:
        assert self.objectives is not None and self.pool_name is not None, "objectives not attached"
        self.objective_crd = True
        found = {_name(o): objective_priority(o, self.pool_name) for o in items}
        self.objectives.replace({k: v for k, v in found.items() if v is not None})
        log.info("InferenceObjectives for pool %s: %s", self.pool_name, dict(self.objectives.from_crd))

    def _on_objective(self, kind: str, obj: Obj) -> None:
        assert self.objectives is not None and self.pool_name is not None, "objectives not attached"
        prio = None if kind == "DELETED" else objective_priority(obj, self.pool_name)
        if prio is None:
            self.objectives.remove(_name(obj))
        else:
            self.objectives.put(_name(obj), prio)

    def _on_pod_list(self, items: list[Obj]) -> None:
        self._pods = {view.name: view for view in map(PodView.parse, items)}
        self._synced["pods"] = True
        self._push()

    def _on_pod(self, kind: str, obj: Obj) -> None:
        view = PodView.parse(obj)
        if kind == "DELETED":
            self._pods.pop(view.name, None)
        else:
            self._pods[view.name] = view
        self._push()

    def _on_pool_list(self, items: list[Obj]) -> None:
        self._synced["pool"] = True
        if not items:
            log.warning("InferencePool %s/%s not found: no endpoints", self.namespace, self.pool_name)
        self._set_pool(items[0] if items else None)

    def _on_pool(self, kind: str, obj: Obj) -> None:
        self._set_pool(None if kind == "DELETED" else obj)

    def _set_pool(self, obj: Obj | None) -> None:
        try:
            pool = PoolSpec.parse(obj) if obj is not None else None
        except (ValueError, KeyError, TypeError) as exc:
            log.error(
                "InferencePool %s/%s is invalid (%s): no endpoints", self.namespace, self.pool_name, exc
            )
            pool = None
        if pool != self.pool:
            log.info("InferencePool %s/%s: %s", self.namespace, self.pool_name, pool)
        self.pool = pool
        self._push()

    def _push(self) -> None:
        if self._sink is None or not all(self._synced.values()):
            return
        endpoints = self.endpoints()
        current = frozenset(endpoints)
        if current != self._pushed:
            self._pushed = current
            self._sink.set_endpoints(endpoints)
            log.info("kube discovery: %d endpoints", len(endpoints))

"""A small Kubernetes API server on 127.0.0.1 that speaks the real list/watch wire protocol for
pods and InferencePools, with the faults a client must survive.

- **List**: ``{"kind": "PodList", "metadata": {"resourceVersion", "continue"}, "items"}``, paged
  with ``limit``/``continue``; ``labelSelector`` (``k=v,...``) and ``fieldSelector``
  (``metadata.name=x``) are honoured.
- **Watch** (``?watch=true&resourceVersion=N``): a chunked body of one JSON event per line
  (ADDED/MODIFIED/DELETED/BOOKMARK/ERROR), replaying history newer than N, then live events;
  ``timeoutSeconds`` ends the stream cleanly. An object leaving a label selector is sent as
  DELETED, one entering it as ADDED, as the real watch cache does.
- **Faults**: ``expire()`` compacts history (410 Gone at connect, and as an ERROR event on open
  streams), ``drop_watches()`` kills open streams without the terminating chunk (optionally in
  the middle of an event), ``silence(resource, n)`` makes the next n watches send nothing, and
  ``fail_next(...)`` answers the next requests with HTTP errors.

Resource versions are one global counter, as in etcd.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

Obj = dict[str, Any]
PODS, POOLS, OBJECTIVES = "pods", "inferencepools", "inferenceobjectives"
KINDS = {
    PODS: ("v1", "Pod"),
    POOLS: ("inference.networking.k8s.io/v1", "InferencePool"),
    OBJECTIVES: ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"),
}
_END, _DROP, _TEAR = object(), object(), object()


@dataclass
class Request:
    resource: str
    namespace: str
    watch: bool
    query: dict[str, str]


@dataclass
class _Watcher:
    resource: str
    namespace: str
    selector: Mapping[str, str]
    fields: Mapping[str, str]
    queue: asyncio.Queue[object] = field(default_factory=asyncio.Queue)
    silent: bool = False

    def matches(self, obj: Obj | None) -> bool:
        return obj is not None and _matches(obj, self.selector, self.fields)


def _parse_selector(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.replace("==", "=").partition("=")
        out[key.strip()] = value.strip()
    return out


def _matches(obj: Obj, selector: Mapping[str, str], fields: Mapping[str, str]) -> bool:
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return False
    return all(meta.get(k.removeprefix("metadata.")) == v for k, v in fields.items())


class FakeKube:
    def __init__(self, objective_crd: bool = True) -> None:
        """``objective_crd`` False: the InferenceObjective CRD is not installed (its list is a 404,
        as on a real API server)."""
        self.objective_crd = objective_crd
        self.rv = 100
        self.objects: dict[tuple[str, str, str], Obj] = {}
        self.history: list[tuple[int, str, str, str, Obj, Obj | None]] = []
        self.compacted_below = 0
        self.requests: list[Request] = []
        self.watchers: list[_Watcher] = []
        self._fail: list[int] = []
        self._silent: dict[str, int] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get("/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools", self._pools)
        if self.objective_crd:
            path = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferenceobjectives"
            app.router.add_get(path, self._objectives)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        for w in self.watchers:
            w.queue.put_nowait(_END)
        if self._runner is not None:
            await self._runner.cleanup()

    # -- state changes (what a test drives) ------------------------------------------------

    def put(self, resource: str, namespace: str, obj: Obj, quiet: bool = False) -> int:
        """Create or replace an object; emits ADDED or MODIFIED (unless ``quiet``: a change whose
        event was lost to compaction, which only a re-list can reveal). Returns the new RV."""
        obj = copy.deepcopy(obj)
        name = obj["metadata"]["name"]
        old = self.objects.get((resource, namespace, name))
        self.rv += 1
        obj["metadata"].update(namespace=namespace, resourceVersion=str(self.rv))
        obj.setdefault("apiVersion", KINDS[resource][0])
        obj.setdefault("kind", KINDS[resource][1])
        self.objects[(resource, namespace, name)] = obj
        if not quiet:
            self._emit(resource, namespace, "MODIFIED" if old else "ADDED", obj, old)
        return self.rv

    def delete(self, resource: str, namespace: str, name: str) -> int:
        old = self.objects.pop((resource, namespace, name))
        self.rv += 1
        obj = copy.deepcopy(old)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._emit(resource, namespace, "DELETED", obj, old)
        return self.rv

    def bookmark(self, resource: str) -> int:
        """Advance the global RV (other objects changed) and tell open watches with a BOOKMARK."""
        self.rv += 1
        api, kind = KINDS[resource]
        event = {
            "type": "BOOKMARK",
            "object": {"kind": kind, "apiVersion": api, "metadata": {"resourceVersion": str(self.rv)}},
        }
        for w in self.watchers:
            if w.resource == resource and not w.silent:
                w.queue.put_nowait(event)
        return self.rv

    def expire(self, notify_open: bool = True) -> None:
        """Compact history: every RV older than the current one is too old (410 Gone)."""
        self.compacted_below = self.rv
        self.history.clear()
        if notify_open:
            for w in self.watchers:
                if not w.silent:
                    w.queue.put_nowait(self._gone(self.compacted_below - 1))
                    w.queue.put_nowait(_END)

    def drop_watches(self, torn: bool = False) -> int:
        """Kill open watch connections without the terminating chunk; returns how many."""
        for w in self.watchers:
            w.queue.put_nowait(_TEAR if torn else _DROP)
        return len(self.watchers)

    def silence(self, resource: str, n: int = 1) -> None:
        """The next ``n`` watches of ``resource`` open, then never send a byte."""
        self._silent[resource] = self._silent.get(resource, 0) + n

    def fail_next(self, *statuses: int) -> None:
        self._fail.extend(statuses)

    def watch_requests(self, resource: str) -> list[Request]:
        return [r for r in self.requests if r.resource == resource and r.watch]

    def list_requests(self, resource: str) -> list[Request]:
        return [r for r in self.requests if r.resource == resource and not r.watch]

    # -- protocol --------------------------------------------------------------------------

    def _emit(self, resource: str, namespace: str, kind: str, obj: Obj, old: Obj | None) -> None:
        self.history.append((self.rv, resource, namespace, kind, obj, old))
        for w in self.watchers:
            if w.resource == resource and w.namespace == namespace and not w.silent:
                event = self._event_for(w, kind, obj, old)
                if event is not None:
                    w.queue.put_nowait(event)

    @staticmethod
    def _event_for(w: _Watcher, kind: str, obj: Obj, old: Obj | None) -> Obj | None:
        now, before = w.matches(obj) and kind != "DELETED", w.matches(old)
        if now and before:
            return {"type": "MODIFIED", "object": obj}
        if now:
            return {"type": "ADDED", "object": obj}
        if before:
            return {"type": "DELETED", "object": obj}
        return None

    def _gone(self, rv: int) -> Obj:
        msg = f"too old resource version: {rv} ({self.compacted_below})"
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
        return {"type": "ERROR", "object": {**status, "message": msg, "reason": "Expired", "code": 410}}

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, PODS)

    async def _pools(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, POOLS)

    async def _objectives(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, OBJECTIVES)

    async def _serve(self, request: web.Request, resource: str) -> web.StreamResponse:
        ns, q = request.match_info["ns"], dict(request.query)
        watch = q.get("watch") in ("true", "1")
        self.requests.append(Request(resource, ns, watch, q))
        if self._fail:
            code = self._fail.pop(0)
            body = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "code": code,
                "message": "injected",
            }
            return web.json_response(body, status=code)
        sel, fields = _parse_selector(q.get("labelSelector", "")), _parse_selector(q.get("fieldSelector", ""))
        if watch:
            return await self._watch(request, _Watcher(resource, ns, sel, fields), q)
        return self._list(resource, ns, sel, fields, q)

    def _list(
        self, resource: str, ns: str, sel: Mapping[str, str], fields: Mapping[str, str], q: dict[str, str]
    ) -> web.Response:
        items = [
            o
            for (r, n, _), o in sorted(self.objects.items())
            if r == resource and n == ns and _matches(o, sel, fields)
        ]
        start, _, snap = q.get("continue", "").partition(":")
        offset, rv = (int(start), snap) if start else (0, str(self.rv))
        limit = int(q.get("limit") or 0) or len(items) or 1
        meta: Obj = {"resourceVersion": rv}
        if offset + limit < len(items):
            meta["continue"] = f"{offset + limit}:{rv}"
        api, kind = KINDS[resource]
        return web.json_response(
            {
                "kind": f"{kind}List",
                "apiVersion": api,
                "metadata": meta,
                "items": items[offset : offset + limit],
            }
        )

    async def _watch(self, request: web.Request, w: _Watcher, q: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        start = int(q.get("resourceVersion") or self.rv)
        if start < self.compacted_below:
            await resp.write(json.dumps(self._gone(start)).encode() + b"\n")
            await resp.write_eof()
            return resp
        if self._silent.get(w.resource):
            self._silent[w.resource] -= 1
            w.silent = True
        else:
            for rv, resource, ns, kind, obj, old in self.history:
                if rv > start and resource == w.resource and ns == w.namespace:
                    event = self._event_for(w, kind, obj, old)
                    if event is not None:
                        w.queue.put_nowait(event)
        self.watchers.append(w)
        try:
            return await self._pump(request, resp, w, float(q.get("timeoutSeconds") or 0) or None)
        except ConnectionResetError:  # the client went away first
            return resp
        finally:
            self.watchers.remove(w)

    async def _pump(
        self, request: web.Request, resp: web.StreamResponse, w: _Watcher, timeout: float | None
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                item = await asyncio.wait_for(w.queue.get(), left)
            except TimeoutError:
                item = _END
            if item is _END:
                await resp.write_eof()
                return resp
            if item is _DROP or item is _TEAR:
                if item is _TEAR:
                    await resp.write(b'{"type":"MODIFIED","object":{"metadata":')
                assert request.transport is not None, "watch connection already gone"
                request.transport.abort()
                return resp
            await resp.write(json.dumps(item).encode() + b"\n")


def pod(
    name: str,
    ip: str = "",
    ready: bool = True,
    labels: Mapping[str, str] | None = None,
    terminating: bool = False,
) -> Obj:
    meta: Obj = {"name": name, "labels": dict(labels or {"app": "vllm"})}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: Obj = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}, "status": status}


def objective(name: str, pool_name: str, priority: int | None = None) -> Obj:
    """An InferenceObjective (``inference.networking.x-k8s.io/v1alpha2``) for pool ``pool_name``;
    ``priority`` None leaves it unset (GIE reads that as 0)."""
    spec: Obj = {
        "poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool_name}
    }
    if priority is not None:
        spec["priority"] = priority
    return {"metadata": {"name": name}, "spec": spec}


def pool(name: str, labels: Mapping[str, str], ports: list[int], picker: str = "kvpick-picker") -> Obj:
    return {
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": dict(labels)},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": picker, "port": {"number": 9002}, "failureMode": "FailClose"},
        },
    }

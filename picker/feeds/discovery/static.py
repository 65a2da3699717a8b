"""Static discovery: a fixed ``--endpoints ip:port,...`` list, or a YAML file reloaded on change.

File format (either form)::

    endpoints: ["10.0.0.1:8000", "10.0.0.3:8000=prefill", {address: 10.0.0.2, port: 8000, name: pod-b, role: decode}]

A role (``prefill``, ``decode`` or ``both``, as the ``llm-d.ai/role`` pod label) follows
``=`` in a string entry (``--endpoints 10.0.0.1:8000=decode,10.0.0.3:8000=prefill``) or is a
mapping's ``role``; without one an endpoint is ``both``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

import yaml

from picker.core.endpoints.types import Endpoint, EndpointSink, parse_role

log = logging.getLogger(__name__)


def parse_list(spec: str) -> list[Endpoint]:
    return [Endpoint.parse(part) for part in spec.split(",") if part.strip()]


def parse_file_doc(doc: Any) -> list[Endpoint]:
    items = doc.get("endpoints") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise ValueError("endpoints file must be a list, or a mapping with an 'endpoints' list")
    out: list[Endpoint] = []
    for item in items:
        if isinstance(item, str):
            out.append(Endpoint.parse(item))
        elif isinstance(item, dict):
            role = parse_role(item.get("role"))
            out.append(Endpoint(str(item["address"]), int(item["port"]), str(item.get("name", "")), role))
        else:
            raise ValueError(f"bad endpoint entry {item!r}")
    return out


class StaticProvider:
    """Pushes a fixed list once, then idles until cancelled."""

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        self.endpoints = list(endpoints)

    async def run(self, sink: EndpointSink) -> None:
        sink.set_endpoints(self.endpoints)
        await asyncio.Event().wait()


class FileProvider:
    """Re-reads ``path`` when its mtime changes (polled every ``interval_s``, off the event loop).
    A file that fails to parse keeps the last good set and logs the error."""

    def __init__(self, path: str, interval_s: float = 1.0) -> None:
        self.path, self.interval_s = path, interval_s

    def _read(self) -> tuple[float, list[Endpoint]]:
        mtime = os.stat(self.path).st_mtime
        with open(self.path, encoding="utf-8") as fh:
            return mtime, parse_file_doc(yaml.safe_load(fh))

    async def run(self, sink: EndpointSink) -> None:
        seen = -1.0
        while True:
            try:
                mtime = (await asyncio.to_thread(os.stat, self.path)).st_mtime
                if mtime != seen:
                    seen, endpoints = await asyncio.to_thread(self._read)
                    sink.set_endpoints(endpoints)
                    log.info("endpoints file %s: %d endpoints", self.path, len(endpoints))
            except (OSError, ValueError, KeyError, yaml.YAMLError) as exc:
                log.error("endpoints file %s: %s (keeping the last good set)", self.path, exc)
            await asyncio.sleep(self.interval_s)

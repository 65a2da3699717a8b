"""Static discovery: the fixed list, and the YAML file provider's reload and last-good behaviour."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest

from picker.core.endpoints.pool import Pool
from picker.core.endpoints.types import Endpoint
from picker.feeds.discovery.static import FileProvider, StaticProvider, parse_file_doc, parse_list


class Sink:
    """Records every endpoint set pushed by a provider."""

    def __init__(self) -> None:
        self.sets: list[list[str]] = []
        self.changed = asyncio.Event()

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        self.sets.append([e.key for e in endpoints])
        self.changed.set()

    async def next_set(self, timeout: float = 10.0) -> list[str]:
        await asyncio.wait_for(self.changed.wait(), timeout)
        self.changed.clear()
        return self.sets[-1]


def write(path: Path, text: str, mtime: float) -> None:
    """Write and force a distinct mtime (coarse file-system clocks must not hide a change)."""
    path.write_text(text)
    os.utime(path, (mtime, mtime))


@contextlib.asynccontextmanager
async def running(provider: FileProvider | StaticProvider, sink: Sink) -> AsyncIterator[None]:
    task = asyncio.create_task(provider.run(sink))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_parse_list_and_doc() -> None:
    assert [e.key for e in parse_list("10.0.0.1:80, 10.0.0.2:81,")] == ["10.0.0.1:80", "10.0.0.2:81"]
    doc = {"endpoints": ["10.0.0.1:80", {"address": "10.0.0.2", "port": 81, "name": "pod-b"}]}
    eps = parse_file_doc(doc)
    assert [e.key for e in eps] == ["10.0.0.1:80", "10.0.0.2:81"] and eps[1].name == "pod-b"
    assert parse_file_doc(["10.0.0.3:82"])[0].port == 82
    for bad in [{"endpoints": 5}, "x", {"endpoints": [7]}]:
        with pytest.raises(ValueError):
            parse_file_doc(bad)
    with pytest.raises(ValueError, match="is not ip:port"):
        parse_list("10.0.0.1")


async def test_static_provider_pushes_once() -> None:
    sink = Sink()
    async with running(StaticProvider(parse_list("127.0.0.1:1,127.0.0.1:2")), sink):
        assert await sink.next_set() == ["127.0.0.1:1", "127.0.0.1:2"]


async def test_file_provider_reloads_and_keeps_last_good(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    write(path, "endpoints: ['127.0.0.1:8001']\n", 1_000_000)
    sink = Sink()
    pool = Pool()
    async with running(FileProvider(str(path), interval_s=0.02), sink):
        assert await sink.next_set() == ["127.0.0.1:8001"]

        write(path, "endpoints: ['127.0.0.1:8001', {address: 127.0.0.1, port: 8002}]\n", 1_000_010)
        assert await sink.next_set() == ["127.0.0.1:8001", "127.0.0.1:8002"]
        pool.set_endpoints(Endpoint.parse(k) for k in sink.sets[-1])

        pushes = len(sink.sets)
        write(path, "endpoints: [unclosed\n", 1_000_020)  # YAML error
        await asyncio.sleep(0.3)
        write(path, "endpoints: 5\n", 1_000_030)  # wrong shape
        await asyncio.sleep(0.3)
        write(path, "endpoints: [{address: 127.0.0.1}]\n", 1_000_040)  # no port
        await asyncio.sleep(0.3)
        assert len(sink.sets) == pushes, "a bad file pushes nothing: the last good set stays"
        assert len(pool) == 2

        write(path, "- 127.0.0.1:8003\n", 1_000_050)
        assert await sink.next_set() == ["127.0.0.1:8003"]


async def test_file_provider_waits_for_the_file(tmp_path: Path) -> None:
    path = tmp_path / "later.yaml"
    sink = Sink()
    async with running(FileProvider(str(path), interval_s=0.02), sink):
        await asyncio.sleep(0.1)
        assert sink.sets == []
        write(path, "endpoints: ['127.0.0.1:9000']\n", 1_000_000)
        assert await sink.next_set() == ["127.0.0.1:9000"]


def test_ipv6_endpoint_keys_are_bracketed() -> None:
    ep = Endpoint.parse("[fd00::2]:8001")
    assert (ep.address, ep.port, ep.key) == ("fd00::2", 8001, "[fd00::2]:8001")
    assert Endpoint("::1", 80).key == "[::1]:80" and Endpoint("10.0.0.1", 80).key == "10.0.0.1:80"
    assert Endpoint.parse(ep.key) == ep
    with pytest.raises(ValueError, match="bracketed"):
        Endpoint.parse("fd00::2:8001")

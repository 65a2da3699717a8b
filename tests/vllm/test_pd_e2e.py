"""Prefill/decode disaggregation end to end with real KV: a real Envoy, the picker (``pd``
enabled), one prefill and one decode vLLM-CPU replica serving the tiny model, and kvpick's
sidecar (``replica.pd_sidecar``) in front of the decode replica. Both replicas run vLLM's
shared-storage connector (``ExampleConnector``, one directory shared by both): the prefill
replica writes the prompt's KV there, the decode replica reads it.

Asserted on vLLM's own counters: for a disaggregated request the prefill replica computed the
prompt and generated one token; the decode replica loaded the prompt's KV through the connector
(``vllm:external_prefix_cache_hits``) and computed only the part past its last whole block
(``vllm:request_prefill_kv_computed_tokens``, which ExampleConnector recomputes by design: it
loads ``(len - 2) // block * block`` tokens). The greedy token ids equal those of the same
request prefilled and decoded on one replica (the non-disaggregated run, made first, its stored
KV and prefix cache then cleared)."""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvlaunch import PY, Procs, Stack, free_port, http, post_json, wait_port
from picker.feeds.scrape import parse_metrics
from replica.vllm.tiny import ENV, command, cpu_binding
from tests.support.vllm import wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.envoy, pytest.mark.timeout(600)]

BLOCK = 32  # replica.vllm.tiny's --block-size
PROMPT = "Disaggregated serving moves the prompt's KV cache from one replica to another. " * 12


@dataclass
class Rig:
    prefill: str
    decode: str
    sidecar_port: int
    prefill_port: int
    kv_dir: pathlib.Path
    model: str


def _counters(url: str) -> dict[str, float]:
    _, body, _ = http("GET", url + "/metrics")
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith("vllm:") and not line.startswith("vllm:cache_config_info"):
            name, _, value = line.rpartition(" ")
            base = name.split("{", 1)[0]
            with contextlib.suppress(ValueError):
                out[base] = out.get(base, 0.0) + float(value)
    return out


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.fixture(scope="module")
def rig(tiny_model_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    procs = Procs(tmp_path_factory.mktemp("pd-e2e"))
    kv_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvpick-pd-kv-"))
    kv_config = json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(kv_dir)},
        }
    )
    try:
        ports = {"prefill": free_port(), "decode": free_port()}
        for i, (name, port) in enumerate(ports.items()):
            args = command(tiny_model_dir, port, "--kv-transfer-config", kv_config, python=PY)
            procs.start(name, args, env={**ENV, **cpu_binding(i)})
        urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
        wait_healthy(procs, urls)
        sidecar = free_port()
        side = [PY, "-m", "replica.pd_sidecar", "--host", "127.0.0.1", "--port", str(sidecar)]
        wait_port(sidecar, proc=procs.start("sidecar", [*side, "--vllm", urls["decode"]]))
        yield Rig(urls["prefill"], urls["decode"], sidecar, ports["prefill"], kv_dir, str(tiny_model_dir))
    finally:
        procs.stop()
        shutil.rmtree(kv_dir, ignore_errors=True)


def _request(prompt: str, **extra: object) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True, **extra}


def test_disaggregated_request_moves_real_kv_and_decodes_the_same_tokens(
    rig: Rig, tmp_path: pathlib.Path
) -> None:
    # The non-disaggregated run: prefill and decode on one replica, then forget its KV everywhere.
    status, alone = post_json(rig.prefill + "/v1/completions", {"model": rig.model, **_request(PROMPT)})
    assert status == 200, alone
    for entry in rig.kv_dir.iterdir():
        shutil.rmtree(entry)
    for url in (rig.prefill, rig.decode):
        assert http("POST", url + "/reset_prefix_cache")[0] == 200

    config = tmp_path / "picker.yaml"
    config.write_text("pd: {enabled: true, decider: always}\n")
    (tmp_path / "stack").mkdir()
    procs = Procs(tmp_path / "stack")
    st = Stack(procs, [])
    try:
        endpoints = f"127.0.0.1:{rig.sidecar_port}=decode,127.0.0.1:{rig.prefill_port}=prefill"
        st.start_picker("--endpoints", endpoints, "--config-file", str(config), endpoints=[])
        st.start_envoy()
        deadline = time.monotonic() + 60
        while not all(e["health"] == "ready" for e in st.endpoints().values()):
            assert time.monotonic() < deadline, f"endpoints never ready: {st.endpoints()}"
            time.sleep(0.2)
        b_pre, b_dec = _counters(rig.prefill), _counters(rig.decode)
        status, split = post_json(st.url + "/v1/completions", {"model": rig.model, **_request(PROMPT)})
        assert status == 200, split
        time.sleep(0.5)  # vLLM counts a request when its output is processed
        a_pre, a_dec = _counters(rig.prefill), _counters(rig.decode)
        _, sidecar_page, _ = http("GET", f"http://127.0.0.1:{rig.sidecar_port}/metrics")
        _, picker_page, _ = http("GET", f"http://127.0.0.1:{st.metrics_port}/metrics")
    finally:
        procs.stop()

    assert isinstance(split, dict) and isinstance(alone, dict)
    prompt_tokens = split["usage"]["prompt_tokens"]
    assert prompt_tokens > 8 * BLOCK
    assert 'kvpick_pd_decisions_total{decision="disaggregated"} 1.0' in picker_page.decode()
    assert 'kvpick_sidecar_prefill_legs_total{outcome="ok"} 1.0' in sidecar_page.decode()
    # The prefill replica computed the prompt and generated the one token of the prefill leg.
    assert _delta(b_pre, a_pre, "vllm:prompt_tokens_total") == prompt_tokens
    assert _delta(b_pre, a_pre, "vllm:generation_tokens_total") == 1
    assert _delta(b_pre, a_pre, "vllm:request_prefill_kv_computed_tokens_sum") == prompt_tokens
    # The decode replica loaded the KV and computed only the tail past the last whole block.
    loaded = _delta(b_dec, a_dec, "vllm:external_prefix_cache_hits_total")
    computed = _delta(b_dec, a_dec, "vllm:request_prefill_kv_computed_tokens_sum")
    assert loaded == (prompt_tokens - 2) // BLOCK * BLOCK, (loaded, prompt_tokens)
    assert computed == prompt_tokens - loaded <= BLOCK + 1, computed
    assert _delta(b_dec, a_dec, "vllm:prefix_cache_hits_total") == 0, "nothing came from its own cache"
    assert _delta(b_dec, a_dec, "vllm:generation_tokens_total") == 8
    # Greedy outputs equal the non-disaggregated run's.
    assert split["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]  # type: ignore[index]
    assert len(alone["choices"][0]["token_ids"]) == 8  # type: ignore[index]
    assert parse_metrics(sidecar_page.decode()).running == 0

"""``python -m kvlaunch.upstream``, the one fake model server of the tests and the benchmarks, in
both of its modes, as real processes on loopback: echo (says which port served; gauges set over
``/control``) and ``--fixed`` (``bench.datapath``'s: a fixed answer, the body never parsed)."""

from __future__ import annotations

import json
import pathlib

from prometheus_client.parser import text_string_to_metric_families

from kvlaunch import PY, Procs, free_port, http, post_json, wait_port


def _gauges(text: bytes) -> dict[str, float]:
    """The vLLM gauges the picker scrapes, from a ``/metrics`` page."""
    names = {
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_requests_running": "running",
        "vllm:kv_cache_usage_perc": "kv",
    }
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name in names:
                out[names[s.name]] = s.value
            elif s.name == "vllm:cache_config_info":
                out["num_gpu_blocks"] = int(s.labels["num_gpu_blocks"])
    return out


def _start(tmp_path: pathlib.Path, *args: str) -> tuple[Procs, list[int]]:
    procs = Procs(tmp_path)
    ports = [free_port(), free_port()]
    proc = procs.start("up", [PY, "-m", "kvlaunch.upstream", "--ports", ",".join(map(str, ports)), *args])
    for port in ports:
        wait_port(port, 30, procs=procs, proc=proc)
    return procs, ports


def test_echo_mode_names_the_port_and_serves_set_gauges(tmp_path: pathlib.Path) -> None:
    procs, ports = _start(tmp_path)
    try:
        for port in ports:
            status, doc = post_json(f"http://127.0.0.1:{port}/v1/completions", {"model": "x", "prompt": "p"})
            assert status == 200 and doc["served_by"] == port and doc["model"] == "x"
        body = json.dumps({"model": "x", "stream": True, "chunks": 3}).encode()
        _, raw, _ = http("POST", f"http://127.0.0.1:{ports[0]}/v1/completions", body)
        assert raw.count(b"data: ") == 4 and raw.endswith(b"data: [DONE]\n\n")
        post_json(f"http://127.0.0.1:{ports[1]}/control", {"waiting": 3, "kv": 0.5})
        _, text, _ = http("GET", f"http://127.0.0.1:{ports[1]}/metrics")
        assert _gauges(text) == {"waiting": 3.0, "running": 0.0, "kv": 0.5, "num_gpu_blocks": 1000}
        _, stats, _ = http("GET", f"http://127.0.0.1:{ports[1]}/stats")
        assert json.loads(stats)["served"] == 1
    finally:
        procs.stop()


def test_fixed_mode_answers_without_parsing_the_body(tmp_path: pathlib.Path) -> None:
    procs, ports = _start(tmp_path, "--fixed", "--chunks", "7")
    try:
        url = f"http://127.0.0.1:{ports[1]}/v1/chat/completions"
        status, raw, _ = http("POST", url, b"not json at all")
        assert status == 200 and json.loads(raw)["id"] == "cmpl-bench"
        _, raw, _ = http("POST", url, b'{"stream": true, "broken')  # a mark is enough
        assert raw.count(b"data: ") == 8 and raw.endswith(b"data: [DONE]\n\n")
        _, text, _ = http("GET", f"http://127.0.0.1:{ports[0]}/metrics")
        assert _gauges(text) == {"waiting": 0.0, "running": 0.0, "kv": 0.0, "num_gpu_blocks": 100_000}
        assert http("GET", f"http://127.0.0.1:{ports[0]}/control")[0] == 404, "no echo routes"
    finally:
        procs.stop()

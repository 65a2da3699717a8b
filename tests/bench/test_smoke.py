"""Smoke run of the benchmark through the real stack: 2 simulated replicas, the picker, Envoy."""

from __future__ import annotations

import json
import pathlib

import pytest

from bench.__main__ import main


@pytest.mark.envoy
@pytest.mark.timeout(120)
def test_smoke_suite_end_to_end(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "results"
    rc = main(["--suite", "smoke", "--out", str(out), "--run-dir", str(tmp_path / "run"), "--no-progress"])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    w = doc["workloads"]["generated-shared-prefix"]
    assert w["ideal_hit_rate"] == pytest.approx(3 / 4 * 256 / 288, abs=1e-4)
    assert set(w["routers"]) == {"cost", "cost-approximate", "round-robin"}
    for name, r in w["routers"].items():
        assert {"hit_rate", "ttft_p50", "ttft_p90", "ttft_p99", "throughput_rps", "errors"} <= set(r), name
        assert r["errors"] == 0 and r["requests"] == 16, f"{name}: {r}"
        assert 0 < r["ttft_p50"] <= r["ttft_p90"] <= r["ttft_p99"], f"{name}: {r}"
        assert r["hit_rate"] == pytest.approx(r["server_hit_rate"], abs=1e-4), "usage disagrees with /metrics"
        assert r["hit_rate"] <= w["ideal_hit_rate"] + 1e-4
    assert w["routers"]["cost"]["hit_rate"] > 0, "the shared system prompts never hit"
    assert [set(t["paths"]) for t in doc["overhead"]] == [{"direct", "cost"}]
    md = (out / "results.md").read_text()
    assert "| cost |" in md and "Router overhead" in md
    for png in ("ttft_cdf.png", "hit_rate.png", "throughput.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png

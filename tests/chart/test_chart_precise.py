"""Chart values for precise prefix mode: vLLM replicas publishing KV events, two picker replicas
with a PodDisruptionBudget, the picker config's ``prefix`` section and a tokenizer volume."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from picker.core import config as picker_config
from tests.chart.test_chart import RELEASE, one, render, validate

pytestmark = [pytest.mark.chart, pytest.mark.precise]

PRECISE: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "vllm": {"enabled": True, "replicas": 4},
    "picker": {
        "replicas": 2,
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": 1},
        "config": {
            "policy": "cost",
            "prefix": {"mode": "precise", "kv_events_port": 5557, "tokenizer": "/models/tokenizer"},
        },
        "extraVolumes": [{"name": "tokenizer", "configMap": {"name": "llama-tokenizer"}}],
        "extraVolumeMounts": [{"name": "tokenizer", "mountPath": "/models/tokenizer", "readOnly": True}],
    },
}


def test_precise_values_render_and_validate() -> None:
    docs = render(PRECISE)
    for d in docs:
        validate(d)
    picker = one(docs, "Deployment", f"{RELEASE}-picker")
    assert picker["spec"]["replicas"] == 2
    assert one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    pod = picker["spec"]["template"]["spec"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "tokenizer", "mountPath": "/models/tokenizer", "readOnly": True} in mounts
    assert {"name": "tokenizer", "configMap": {"name": "llama-tokenizer"}} in pod["volumes"]
    raw = yaml.safe_load(one(docs, "ConfigMap", f"{RELEASE}-picker")["data"]["config.yaml"])
    cfg = picker_config.load(raw)
    assert cfg.prefix.mode == "precise" and cfg.prefix.kv_events_port == 5557
    vllm = one(docs, "Deployment", f"{RELEASE}-vllm")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    assert ports["kv-events"] == cfg.prefix.kv_events_port, "the picker subscribes where vLLM publishes"

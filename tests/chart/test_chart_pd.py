"""The chart with prefill/decode disaggregation (``pd.enabled``): a prefill and a decode vLLM
Deployment labelled ``llm-d.ai/role``, the P/D sidecar on decode pods in front of vLLM, the
connector's ``--kv-transfer-config`` on both roles, the picker's ``pd:`` config, and the
NetworkPolicy between the roles; every object validated."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest
import yaml

from picker.core import config as picker_config
from replica.pd_sidecar.__main__ import main as sidecar_main
from tests.chart.test_chart import RELEASE, one, render, validate

pytestmark = pytest.mark.chart

PD: dict[str, Any] = {
    "vllm": {"enabled": True},
    "pd": {"enabled": True, "prefill": {"replicas": 2}, "decode": {"replicas": 3}},
}
SHARED: dict[str, Any] = {
    "vllm": {"enabled": True},
    "pd": {
        "enabled": True,
        "kvTransferConfig": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
        "sharedStorage": {"persistentVolumeClaim": {"claimName": "kv"}},
        "sidecar": {"connector": "shared-storage", "prefillTimeoutS": 30, "allowPrefillers": ["10.0.0.0/8"]},
        "decider": "token-threshold",
        "deciderParams": {"threshold_tokens": 256},
    },
}


def _pod(docs: list[dict[str, Any]], role: str) -> tuple[dict[str, Any], dict[str, Any]]:
    dep = one(docs, "Deployment", f"{RELEASE}-vllm-{role}")
    return dep, dep["spec"]["template"]["spec"]


def _args(container: dict[str, Any]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in container["args"] if "=" in a)


@pytest.mark.parametrize("values", [PD, SHARED], ids=["nixl", "shared-storage"])
def test_prefill_and_decode_deployments_render_and_validate(values: dict[str, Any]) -> None:
    docs = render(values)
    for d in docs:
        validate(d)
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert f"{RELEASE}-vllm" not in names, "the aggregated Deployment gives way to the two roles"
    for role in ("prefill", "decode"):
        dep, spec = _pod(docs, role)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert (
            labels["llm-d.ai/role"] == role
            and dep["spec"]["selector"]["matchLabels"]["llm-d.ai/role"] == role
        )
        pool = one(docs, "InferencePool")["spec"]["selector"]["matchLabels"]
        assert all(labels.get(k) == v for k, v in pool.items()), "both roles are in the pool"
        vllm = next(c for c in spec["containers"] if c["name"] == "vllm")
        assert "--kv-transfer-config" in _args(vllm)
    assert (
        one(docs, "Deployment", f"{RELEASE}-vllm-prefill")["spec"]["replicas"]
        == values["pd"].get("prefill", {"replicas": 1})["replicas"]
    )


def test_decode_pods_run_the_sidecar_on_the_pools_port() -> None:
    docs = render(PD)
    _, pre = _pod(docs, "prefill")
    _, dec = _pod(docs, "decode")
    assert [c["name"] for c in pre["containers"]] == ["vllm"]
    assert [c["name"] for c in dec["containers"]] == ["pd-sidecar", "vllm"]
    side, vllm = dec["containers"]
    target = one(docs, "InferencePool")["spec"]["targetPorts"][0]["number"]
    assert (
        side["ports"][0]["containerPort"]
        == target
        == int(_args(_pod(docs, "prefill")[1]["containers"][0])["--port"])
    )
    a = _args(side)
    assert (
        a["--port"] == str(target) and a["--vllm"] == "http://127.0.0.1:8200" and a["--connector"] == "nixl"
    )
    assert _args(vllm)["--port"] == "8200"
    assert vllm["readinessProbe"]["httpGet"]["port"] == "vllm", "vLLM's probes follow it to its own port"
    assert side["securityContext"]["readOnlyRootFilesystem"] is True
    # The sidecar's own parser takes the rendered arguments.
    assert sidecar_main([*side["args"], "--prefill-timeout-s", "0"]) == 2  # rejected value: exit 2, no serve


def test_shared_storage_mounts_one_volume_on_both_roles_and_names_it_in_the_connector() -> None:
    docs = render(SHARED)
    for role in ("prefill", "decode"):
        _, spec = _pod(docs, role)
        vllm = next(c for c in spec["containers"] if c["name"] == "vllm")
        kv = yaml.safe_load(_args(vllm)["--kv-transfer-config"])
        assert kv == {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": "/kv"},
        }
        assert {"name": "kv", "mountPath": "/kv"} in vllm["volumeMounts"]
        assert {"name": "kv", "persistentVolumeClaim": {"claimName": "kv"}} in spec["volumes"]
    side = _pod(docs, "decode")[1]["containers"][0]
    assert (
        _args(side)["--allow-prefillers"] == "10.0.0.0/8" and _args(side)["--connector"] == "shared-storage"
    )


def test_the_picker_config_turns_pd_on_and_loads() -> None:
    for values, decider in ((PD, "cost"), (SHARED, "token-threshold")):
        cm = one(render(values), "ConfigMap", f"{RELEASE}-picker")
        cfg = picker_config.load(yaml.safe_load(cm["data"]["config.yaml"]))
        assert cfg.pd.enabled and cfg.pd.decider == decider
        assert cfg.pd.link_bytes_per_s == 50e9 and cfg.pd.kv_bytes_per_token == 131072
    cm = one(render({"vllm": {"enabled": True}}), "ConfigMap", f"{RELEASE}-picker")
    assert not picker_config.load(yaml.safe_load(cm["data"]["config.yaml"])).pd.enabled


def test_network_policy_admits_decode_to_prefill() -> None:
    pol = one(render(PD), "NetworkPolicy", f"{RELEASE}-replicas")
    rules = [
        r
        for r in pol["spec"]["ingress"]
        if any("llm-d.ai/role" in str(f.get("podSelector", {})) for f in r["from"])
    ]
    assert len(rules) == 1
    assert {p["port"] for p in rules[0]["ports"]} == {8000, 5600}
    off = one(render({"vllm": {"enabled": True}}), "NetworkPolicy", f"{RELEASE}-replicas")
    assert "llm-d.ai/role" not in str(off)


def test_pd_off_renders_the_aggregated_deployment_unchanged() -> None:
    docs = render({"vllm": {"enabled": True}})
    dep = one(docs, "Deployment", f"{RELEASE}-vllm")
    spec = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["vllm"]
    assert "--kv-transfer-config" not in _args(spec["containers"][0])
    assert "llm-d.ai/role" not in dep["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize(
    ("values", "why"),
    [
        ({"pd": {"decider": "sometimes"}}, "must be one of"),
        ({"pd": {"sidecar": {"connector": "mooncake"}}}, "must be one of"),
        ({"pd": {"prefill": {"replicas": -1}}}, "minimum"),
        (
            {"pd": {"kvTransferConfig": {"kv_connector": "NixlConnector", "kv_role": "both"}}},
            "must be one of",
        ),
    ],
)
def test_schema_rejects_bad_pd_values(values: dict[str, Any], why: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as info:
        render(values)
    assert why in str(info.value), str(info.value)


def test_the_decode_vllm_port_must_differ_from_the_sidecars() -> None:
    with pytest.raises(Exception, match="decodeVllmPort must differ"):
        render({"vllm": {"enabled": True, "port": 8200}, "pd": {"enabled": True}})

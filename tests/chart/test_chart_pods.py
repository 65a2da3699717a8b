"""The replicas' pods (vLLM and the simulator): non-root under RuntimeDefault seccomp, no
capabilities, a read-only root with every cache vLLM writes on a writable mount, and liveness,
readiness and startup probes on /health, each overridable and checked by the schema."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tests.chart.test_chart import RELEASE, one, render, validate

pytestmark = pytest.mark.chart

BOTH = {"vllm": {"enabled": True}, "simulator": {"enabled": True}}
CACHE_ENV = (
    "HOME",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "VLLM_CACHE_ROOT",
    "VLLM_CONFIG_ROOT",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
)


def pod(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "Deployment", f"{RELEASE}-{component}")["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize("component", ["vllm", "sim"])
def test_replica_pods_are_hardened(component: str) -> None:
    docs = render(BOTH)
    for d in docs:
        validate(d)
    spec = pod(docs, component)
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    c = spec["containers"][0]
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]], "/tmp is writable scratch"


def test_every_vllm_cache_is_on_a_writable_mount() -> None:
    """The root filesystem is read-only: each cache directory vLLM, Hugging Face, Triton and torch
    write to is pointed under a mounted volume, and HOME too (what falls back to ~)."""
    spec = pod(render(BOTH), "vllm")
    c = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounts = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
    for name in CACHE_ENV:
        assert any(env[name].startswith(m + "/") for m in mounts), f"{name}={env[name]} is not writable"
    assert env["TMPDIR"] in mounts and "/dev/shm" in mounts
    assert env["USER"], "getpass.getuser() needs USER: the uid has no passwd entry"
    assert {"name": "KVPICK_CACHE_AWARE_ADMISSION", "value": "1"} in c["env"], "the values' env still follows"
    assert {"name": "cache", "emptyDir": {}} in spec["volumes"]
    pvc = {"persistentVolumeClaim": {"claimName": "models"}}
    spec = pod(render({"vllm": {"enabled": True, "cacheVolume": pvc}}), "vllm")
    assert {"name": "cache", **pvc} in spec["volumes"]


def test_vllm_probes() -> None:
    c = pod(render(BOTH), "vllm")["containers"][0]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 1800, "a slow model load is not killed"
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60, "one slow /health is no restart"
    sim = pod(render(BOTH), "sim")["containers"][0]
    health = {"path": "/health", "port": "http"}
    assert sim["livenessProbe"]["httpGet"] == sim["readinessProbe"]["httpGet"] == health


def test_pod_settings_are_overridable() -> None:
    values = {
        "vllm": {
            "enabled": True,
            "podSecurityContext": {
                "runAsNonRoot": True,
                "runAsUser": 2000,
                "runAsGroup": 2000,
                "fsGroup": 2000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": False,
                "capabilities": {"drop": ["ALL"]},
            },
            # Helm merges maps: switching the handler means nulling the default's.
            "livenessProbe": {"httpGet": None, "tcpSocket": {"port": "http"}, "periodSeconds": 30},
        },
        "simulator": {"enabled": True, "livenessProbe": {"httpGet": {"path": "/health", "port": 8000}}},
    }
    docs = render(values)
    for d in docs:
        validate(d)
    spec = pod(docs, "vllm")
    assert spec["securityContext"]["runAsUser"] == 2000
    assert spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False
    assert spec["containers"][0]["livenessProbe"] == {
        "tcpSocket": {"port": "http"},
        "periodSeconds": 30,
        "timeoutSeconds": 5,
        "failureThreshold": 6,
    }
    assert pod(docs, "sim")["containers"][0]["livenessProbe"]["httpGet"]["port"] == 8000


SC = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
BAD_POD_VALUES = [
    ({"vllm": {"podSecurityContext": {**SC, "runAsUser": 0}}}, "/vllm/podSecurityContext/runAsUser", "minimum"),
    ({"vllm": {"podSecurityContext": {**SC, "runAsUser": "vllm"}}}, "/vllm/podSecurityContext/runAsUser", "want integer"),
    ({"simulator": {"podSecurityContext": {**SC, "seccompProfile": {"type": "Off"}}}}, "/simulator/podSecurityContext/seccompProfile/type", "RuntimeDefault"),
    ({"vllm": {"securityContext": {"allowPrivilegeEscalation": "no"}}}, "/vllm/securityContext/allowPrivilegeEscalation", "want boolean"),
    ({"simulator": {"securityContext": {"capabilities": {"drop": "ALL"}}}}, "/simulator/securityContext/capabilities/drop", "want array"),
    ({"vllm": {"securityContext": {"readOnlyRootFs": True}}}, "/vllm/securityContext", "readOnlyRootFs"),
    ({"vllm": {"livenessProbe": {"httpGet": None, "periodSeconds": 10}}}, "/vllm/livenessProbe", "oneOf"),
    ({"vllm": {"livenessProbe": {"httpGet": {"port": 8000}, "failureThreshold": 0}}}, "/vllm/livenessProbe/failureThreshold", "minimum"),
    ({"vllm": {"startupProbe": {"httpGet": {"port": 8000}, "tcpSocket": {"port": 8000}}}}, "/vllm/startupProbe", "oneOf"),
    ({"simulator": {"livenessProbe": {"httpget": {"port": 8000}}}}, "/simulator/livenessProbe", "httpget"),
    ({"vllm": {"cacheVolume": {"emptyDir": {}, "hostPath": {"path": "/m"}}}}, "/vllm/cacheVolume", "maxProperties"),
    ({"vllm": {"cacheVolume": {"name": "x"}}}, "", "invalid propertyName 'name'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("values", "where", "why"), BAD_POD_VALUES, ids=[f"{w}:{y}" for _, w, y in BAD_POD_VALUES]
)
def test_schema_rejects_bad_pod_values(values: dict[str, Any], where: str, why: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as info:
        render(values)
    message = str(info.value)
    assert f"at '{where}'" in message and why in message, message

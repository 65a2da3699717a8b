"""The Helm chart (charts/kvpick), rendered and linted with Helm's own Go SDK (helm-python-sdk).

Every rendered object is validated: built-in kinds with kubernetes-validate (strict, at the oldest
supported and the newest Kubernetes), InferencePool, Gateway and HTTPRoute against their CRDs'
openAPIV3Schema (tests/chart/data, read from kubernetes-sigs/gateway-api-inference-extension
config/crd/bases/inference.networking.k8s.io_inferencepools.yaml and kubernetes-sigs/gateway-api
config/crd/standard; descriptions and status dropped). Unknown fields fail, as they would be pruned.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import helm_python
import jsonschema
import kubernetes
import kubernetes_validate
import pytest
import yaml

from picker.__main__ import build_parser
from picker.core import config as picker_config
from picker.feeds.discovery.kube import KubeProvider
from replica.sim.__main__ import parser as sim_parser
from replica.vllm import launcher

pytestmark = pytest.mark.chart
ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvpick"
DATA = pathlib.Path(__file__).parent / "data"
NS, RELEASE = "serving", "llm"
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.schema.json",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway-v1.schema.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.schema.json",
}
# Kinds of other projects' CRDs with no schema here: checked for shape by the tests below.
UNCHECKED = {
    "ServiceMonitor",
    "DestinationRule",
    "HealthCheckPolicy",
    "GCPBackendPolicy",
    "Certificate",
    "Issuer",
    "ClientTrafficPolicy",
}

GATEWAY = {"create": True, "port": 80}
ROUTE = {"enabled": True}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "vllm": {"enabled": True, "replicas": 4, "hfTokenSecret": "hf"},
        "simulator": {"enabled": False},
    },
    "simulator": {"simulator": {"enabled": True, "replicas": 3, "args": ["--kv-blocks=2048"]}},
    "data-parallel": {"inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8001}]}},
    "label-selector": {
        "inferencePool": {"enabled": False, "targetPorts": [{"number": 8000}, {"number": 8001}]},
        "simulator": {"enabled": True},
    },
    "monitoring": {"picker": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}},
    "envoy-gateway": {
        "provider": "envoy-gateway",
        "gateway": {**GATEWAY, "className": "eg"},
        "httpRoute": ROUTE,
    },
    "kgateway": {"provider": "kgateway", "gateway": {**GATEWAY, "className": "kgateway"}, "httpRoute": ROUTE},
    "istio": {"provider": "istio", "gateway": {**GATEWAY, "className": "istio"}, "httpRoute": ROUTE},
    "gke": {
        "provider": "gke",
        "gateway": {
            **GATEWAY,
            "className": "gke-l7-regional-external-managed",
            "ipBlocks": ["10.129.0.0/23"],
        },
        "httpRoute": {"enabled": True, "requestTimeout": ""},
    },
    "replicas-hardened": {
        "vllm": {"enabled": True, "cacheVolume": {"persistentVolumeClaim": {"claimName": "models"}}},
        "simulator": {"enabled": True},
        "inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8001}]},
        "prefix": {"kvEventsReplayPort": 5600},
        "replicaNetworkPolicy": {"admitMonitoring": True, "extraFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]},
    },
    "existing-gateway": {
        "httpRoute": {"enabled": True, "gatewayName": "inference-gw", "gatewayNamespace": "gw"}
    },
    "cert-manager": {"tls": {"certManager": {"enabled": True}}},
    "istio-mtls": {
        "provider": "istio",
        "gateway": {**GATEWAY, "className": "istio"},
        "httpRoute": ROUTE,
        "tls": {"clientAuth": True},
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = helm_python.Chart.load(str(CHART))
    manifests = chart.render(values=values, name=RELEASE, namespace=NS)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if not path.endswith(".txt"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def notes(values: dict[str, Any]) -> str:
    chart = helm_python.Chart.load(str(CHART))
    return chart.render(values=values, name=RELEASE, namespace=NS)["kvpick/templates/NOTES.txt"]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (
        f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    )
    return found[0]


def _closed(schema: Any) -> Any:
    """Forbid unknown fields wherever the CRD lists properties (the API server would prune them)."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    schema = _closed(json.loads((DATA / CRD_SCHEMAS[(api_version, kind)]).read_text()))
    schema["properties"]["metadata"] = {"type": "object"}
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def validate(obj: dict[str, Any]) -> None:
    key = (obj["apiVersion"], obj["kind"])
    assert obj["metadata"]["name"] and obj["metadata"].get("namespace") in (NS, None), obj["metadata"]
    if key in CRD_SCHEMAS:
        errors = sorted(crd_validator(*key).iter_errors(obj), key=str)
        assert not errors, f"{obj['kind']} {obj['metadata']['name']}: " + "; ".join(e.message for e in errors)
    elif obj["kind"] not in UNCHECKED:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_every_object_validates(case: str) -> None:
    docs = render(VALUE_SETS[case])
    assert docs, "nothing rendered"
    for obj in docs:
        validate(obj)
    for pool in (d for d in docs if d["kind"] == "InferencePool"):
        ports = [p["number"] for p in pool["spec"]["targetPorts"]]
        assert len(ports) == len(set(ports)), "InferencePool targetPorts must be unique (CRD CEL rule)"


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_lint(case: str) -> None:
    report = helm_python.lint(str(CHART), VALUE_SETS[case])
    assert report["errors"] == [], report


def test_defaults_picker_pool_and_rbac() -> None:
    docs = render({})
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "ConfigMap",
            "Deployment",
            "InferencePool",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "Role",
            "RoleBinding",
            "Secret",  # the pickers' and the gateway's certificates (mTLS: tests/chart/test_chart_tls.py)
            "Secret",
            "Service",
            "Service",
            "ServiceAccount",
        ]
    )
    picker = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]["template"]["spec"]
    container = picker["containers"][0]
    args = build_parser().parse_args(container["args"])  # the picker accepts every rendered flag
    assert container["command"] == ["python", "-m", "picker"]
    assert (args.grpc_port, args.grpc_health_port, args.metrics_port) == (9002, 9003, 9090)
    assert (args.pool_name, args.pool_namespace, args.secure_serving) == (RELEASE, NS, True)
    assert args.endpoint_selector is None and args.endpoint_target_ports is None
    provider = kube_provider(args)
    assert provider.pool_name == RELEASE and provider.namespace == NS
    assert args.config_file == "/etc/kvpick/config.yaml"
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert picker["securityContext"]["runAsNonRoot"] is True
    assert picker["serviceAccountName"] == f"{RELEASE}-picker"

    cm = one(docs, "ConfigMap")
    cfg = picker_config.load(yaml.safe_load(cm["data"]["config.yaml"]))  # the picker's own loader
    assert cfg.policy == "cost"

    svc = one(docs, "Service", f"{RELEASE}-picker")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {
        "grpc": 9002,
        "grpc-health": 9003,
        "metrics": 9090,
    }
    assert svc["spec"]["selector"].items() <= picker_labels(docs).items()

    pool = one(docs, "InferencePool")
    assert pool["metadata"]["name"] == args.pool_name
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": svc["metadata"]["name"],
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    role = one(docs, "Role")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        },
        {
            "apiGroups": ["inference.networking.x-k8s.io"],
            "resources": ["inferenceobjectives"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    binding = one(docs, "RoleBinding")
    assert (
        binding["roleRef"]["kind"] == "Role"
        and binding["subjects"][0]["name"] == picker["serviceAccountName"]
    )
    assert one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1, "two pickers: one at a time"


def kube_provider(args: argparse.Namespace) -> KubeProvider:
    """The picker's kube provider, built from the rendered flags (it rejects a bad combination)."""
    return KubeProvider.from_flags(
        pool_name=args.pool_name,
        pool_namespace=args.pool_namespace,
        endpoint_selector=args.endpoint_selector,
        endpoint_target_ports=args.endpoint_target_ports,
        api=kubernetes.client.ApiClient(),
    )


def test_label_selector_mode_without_inference_pool() -> None:
    """inferencePool.enabled=false, for clusters without the CRD: no InferencePool object, no
    RBAC on inferencepools, and the picker selects the replica pods by label on the target ports."""
    values = VALUE_SETS["label-selector"]
    docs = render(values)
    assert not [d for d in docs if d["kind"] == "InferencePool"]
    container = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    assert args.pool_name is None and args.pool_namespace == NS
    assert (args.endpoint_selector, args.endpoint_target_ports) == ("kvpick.io/pool=kvpick", "8000,8001")
    provider = kube_provider(args)
    assert provider.pool is not None and provider.pool.target_ports == (8000, 8001)
    selected = dict(term.split("=", 1) for term in args.endpoint_selector.split(","))
    sim_labels = one(docs, "Deployment", f"{RELEASE}-sim")["spec"]["template"]["metadata"]["labels"]
    assert selected.items() <= sim_labels.items(), "the picker would not select the chart's own replicas"
    assert one(docs, "Role")["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    text = notes(values)
    assert "No InferencePool" in text and "kind InferencePool" not in text


def picker_labels(docs: list[dict[str, Any]]) -> dict[str, str]:
    labels: dict[str, str] = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]["template"]["metadata"][
        "labels"
    ]
    return labels


def test_gpu_replicas() -> None:
    docs = render(VALUE_SETS["gpu"])
    dep = one(docs, "Deployment", f"{RELEASE}-vllm")
    pod = dep["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert dep["spec"]["replicas"] == 4
    assert c["command"] == ["python3", "-m", "replica.vllm", "serve"]
    assert "--model=meta-llama/Llama-3.1-8B-Instruct" in c["args"]
    # vLLM schedules asynchronously on GPU by default; a sync Scheduler subclass loses that.
    assert f"--scheduler-cls={launcher.ASYNC_CLS}" in c["args"]
    cmd = launcher.build_command(None, c["args"], async_scheduling=False)  # the launcher keeps it
    assert [a for a in cmd if a.startswith("--scheduler-cls")] == [f"--scheduler-cls={launcher.ASYNC_CLS}"]
    assert "--enable-prefix-caching" in c["args"]
    kv = json.loads(
        next(a for a in c["args"] if a.startswith("--kv-events-config=")).removeprefix("--kv-events-config=")
    )
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert kv["enable_kv_cache_events"] is True and kv["endpoint"].endswith(f":{ports['kv-events']}")
    assert ports["http"] == one(docs, "InferencePool")["spec"]["targetPorts"][0]["number"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in c["env"]
    assert (
        one(docs, "InferencePool")["spec"]["selector"]["matchLabels"].items()
        <= pod["metadata"]["labels"].items()
    )
    assert not [d for d in docs if d["metadata"]["name"] == f"{RELEASE}-sim"]


def test_simulator_replicas() -> None:
    docs = render(VALUE_SETS["simulator"])
    dep = one(docs, "Deployment", f"{RELEASE}-sim")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "replica.sim"] and c["args"] == [
        "--host=0.0.0.0",
        "--port=8000",
        "--model=Qwen/Qwen2.5-7B-Instruct",
        "--kv-events-port=5557",
        "--kv-blocks=2048",
    ]
    args = sim_parser().parse_args(c["args"])  # the simulator accepts every rendered flag
    # The simulator binds 127.0.0.1 unless told otherwise; the kubelet's probe and the gateway
    # reach the pod on its IP.
    assert args.host == "0.0.0.0" and args.port == c["ports"][0]["containerPort"]
    assert one(docs, "InferencePool")["spec"]["selector"]["matchLabels"].items() <= (
        dep["spec"]["template"]["metadata"]["labels"].items()
    )
    assert "nvidia.com/gpu" not in json.dumps(dep)
    assert "/v1/completions" not in notes(VALUE_SETS["simulator"]), (
        "NOTES promise a gateway the chart did not make"
    )


def test_one_model_for_every_replica_and_the_notes() -> None:
    """The top-level `model` is what vLLM loads, what the simulator answers to, and what NOTES.txt's
    example request sends: a client following the NOTES never gets a 404 for an unknown model."""
    model = "Qwen/Qwen3-8B"
    values = {
        "model": model,
        "vllm": {"enabled": True},
        "simulator": {"enabled": True},
        **{k: VALUE_SETS["envoy-gateway"][k] for k in ("gateway", "httpRoute")},
    }
    docs = render(values)
    vllm = one(docs, "Deployment", f"{RELEASE}-vllm")["spec"]["template"]["spec"]["containers"][0]
    assert [a for a in vllm["args"] if a.startswith("--model")] == [f"--model={model}"]
    sim = one(docs, "Deployment", f"{RELEASE}-sim")["spec"]["template"]["spec"]["containers"][0]
    assert sim_parser().parse_args(sim["args"]).model == model
    body = next(line for line in notes(values).splitlines() if line.strip().startswith("-d '"))
    assert json.loads(body.strip().removeprefix("-d '").removesuffix("'"))["model"] == model


@pytest.mark.parametrize("provider", ["envoy-gateway", "kgateway", "istio", "gke"])
def test_providers(provider: str) -> None:
    values = VALUE_SETS[provider]
    docs = render(values)
    gw = one(docs, "Gateway")
    assert gw["spec"]["gatewayClassName"] == values["gateway"]["className"]
    route = one(docs, "HTTPRoute")
    assert route["spec"]["parentRefs"][0]["name"] == gw["metadata"]["name"]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert backend == {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": RELEASE}
    assert ("timeouts" in route["spec"]["rules"][0]) is (provider != "gke")
    extra = {d["kind"] for d in docs} & UNCHECKED
    assert extra == {
        "istio": {"DestinationRule"},
        "gke": {"HealthCheckPolicy", "GCPBackendPolicy"},
        "envoy-gateway": {"ClientTrafficPolicy"},
    }.get(provider, set())
    if provider == "istio":
        dr = one(docs, "DestinationRule")
        assert dr["spec"]["host"] == f"{RELEASE}-picker.{NS}.svc.cluster.local"
        assert dr["spec"]["trafficPolicy"]["tls"]["mode"] == "SIMPLE"
    if provider == "gke":
        for kind in ("HealthCheckPolicy", "GCPBackendPolicy"):
            ref = one(docs, kind)["spec"]["targetRef"]
            assert ref == {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": RELEASE}
    text = notes(values)
    assert f"get gateway {RELEASE}-gateway" in text and "/v1/completions" in text


def test_install_guide_values_render() -> None:
    """docs/install.md's values file is valid for this chart and does what it says."""
    guide = (ROOT / "docs" / "install.md").read_text()
    block = next(b for b in guide.split("```yaml\n")[1:] if b.startswith("# my-values.yaml"))
    values = yaml.safe_load(block.split("```")[0])
    docs = render(values)
    c = one(docs, "Deployment", f"{RELEASE}-vllm")["spec"]["template"]["spec"]["containers"][0]
    assert f"--model={values['model']}" in c["args"]
    assert f"--scheduler-cls={launcher.ASYNC_CLS}" in c["args"] and launcher.ASYNC_CLS in guide
    assert values["model"] in notes(values)


def test_existing_gateway_and_service_monitor() -> None:
    route = one(render(VALUE_SETS["existing-gateway"]), "HTTPRoute")
    assert route["spec"]["parentRefs"][0] | {} == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": "inference-gw",
        "namespace": "gw",
    }
    sm = one(render(VALUE_SETS["monitoring"]), "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"


BAD_VALUES = [
    ({"picker": {"replicas": 0}}, "/picker/replicas", "minimum"),
    ({"picker": {"grpcPort": 70000}}, "/picker/grpcPort", "maximum"),
    ({"inferencePool": {"targetPorts": []}}, "/inferencePool/targetPorts", "minItems"),
    ({"inferencePool": {"targetPorts": [{"number": 8000}] * 2}}, "/inferencePool/targetPorts", "are equal"),
    ({"inferencePool": {"failureMode": "Open"}}, "/inferencePool/failureMode", "FailClose"),
    ({"inferencePool": {"matchLabels": {"app": "bad value!"}}}, "/inferencePool/matchLabels/app", "pattern"),
    ({"provider": "nginx"}, "/provider", "envoy-gateway"),
    ({"gateway": {"create": True}}, "/gateway/className", "minLength"),
    ({"inferencePool": {"enabled": "no"}}, "/inferencePool/enabled", "want boolean"),
    (
        {"inferencePool": {"enabled": False}, "httpRoute": {"enabled": True}},
        "/httpRoute/enabled",
        "must be false",
    ),
    ({"inferencePool": {"enabled": False}, "provider": "gke"}, "/provider", "must be one of"),
    ({"vllm": {"schedulerCls": "NoModule"}}, "/vllm/schedulerCls", "pattern"),
    ({"vllm": {"args": ["enable-prefix-caching"]}}, "/vllm/args/0", "pattern"),
    ({"httpRoute": {"requestTimeout": "five minutes"}}, "/httpRoute/requestTimeout", "pattern"),
    ({"picker": {"imageTag": "x"}}, "/picker", "imageTag"),
    ({"vllm": {"model": "x"}}, "/vllm", "additional properties 'model' not allowed"),
    ({"model": ""}, "/model", "minLength"),
    ({"model": "my model"}, "/model", "pattern"),
    ({"replicas": 3}, "", "additional properties 'replicas' not allowed"),
]


@pytest.mark.parametrize(("values", "where", "why"), BAD_VALUES, ids=[w or "root" for _, w, _ in BAD_VALUES])
def test_schema_rejects_bad_values(values: dict[str, Any], where: str, why: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as info:
        render(values)
    message = str(info.value)
    assert f"at '{where}'" in message and why in message, message
    assert any(where in e and why in e for e in helm_python.lint(str(CHART), values)["errors"])


def _leaves(doc: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(doc, dict) and doc:
        for key, value in doc.items():
            yield from _leaves(value, (*path, key))
    else:
        yield path


def test_schema_covers_every_value() -> None:
    """Each value in values.yaml is described by the schema, down to a node that is deliberately
    free-form (a probe, the picker config, resources, labels)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in _leaves(values):
        node = schema
        for key in path:
            props = node.get("properties")
            if props is None:
                assert node.get("type") == "object", f"{'.'.join(path)}: schema stops at a non-object"
                break
            assert key in props, f"values.yaml key {'.'.join(path)} is not in values.schema.json"
            node = props[key]
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values)


def test_validators_catch_mistakes() -> None:
    """The checks above can fail: a typo in a built-in object, and a pool the CRD would refuse."""
    docs = render({})
    dep = one(docs, "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(dep)
    pool = one(docs, "InferencePool")
    pool["spec"]["targetPorts"] = [{"number": p} for p in range(8000, 8009)]  # 9 ranks: over the CRD's 8
    with pytest.raises(AssertionError, match="InferencePool"):
        validate(pool)
    pool["spec"] = {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"port": 8000}]}
    with pytest.raises(AssertionError, match="number"):
        validate(pool)

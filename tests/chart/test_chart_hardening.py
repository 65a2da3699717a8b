"""The chart's production settings: the NetworkPolicy admits only the release's gateway to ext_proc, the
termination grace covers preStop plus the picker's drain, replicas and PDB agree, the debug API is
off and metrics stay on 9090. The NetworkPolicy is evaluated here the way Kubernetes reads it."""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Any

import helm_python
import pytest

from picker.__main__ import build_parser
from tests.chart.test_chart import CHART, NS, RELEASE, one, picker_labels, render

pytestmark = pytest.mark.chart


def ns(name: str) -> dict[str, str]:
    """A namespace's labels: Kubernetes sets kubernetes.io/metadata.name on every namespace."""
    return {"kubernetes.io/metadata.name": name}


# The release's own Gateway (provider none: llm-gateway in the release namespace), as the Gateway
# API label marks its pods; other gateways' pods; Prometheus; anyone else.
OWN_GW = ({"gateway.networking.k8s.io/gateway-name": f"{RELEASE}-gateway"}, ns(NS))
OTHER_GW = ({"gateway.networking.k8s.io/gateway-name": "tenant-gw"}, ns("tenant-a"))
OTHER_GW_HERE = ({"gateway.networking.k8s.io/gateway-name": "tenant-gw"}, ns(NS))
EG_GW = ({"gateway.envoyproxy.io/owning-gateway-name": "eg"}, ns("envoy-gateway-system"))
PROMETHEUS = ({"app.kubernetes.io/name": "prometheus"}, ns("monitoring"))
FAKE_PROMETHEUS = ({"app.kubernetes.io/name": "prometheus"}, ns("tenant-a"))
OTHER = ({"app": "someone-else"}, ns("tenant-a"))


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) on labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, vals = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in vals,
            "NotIn": key not in labels or labels[key] not in vals,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _peer_admits(peer: dict[str, Any], pod: dict[str, str], ns: dict[str, str], own_ns: bool) -> bool:
    if "ipBlock" in peer:
        return False  # pods here are addressed by labels
    ns_ok = _selects(peer["namespaceSelector"], ns) if "namespaceSelector" in peer else own_ns
    return ns_ok and _selects(peer.get("podSelector", {}), pod)


def admitted(
    policy: dict[str, Any], pod: dict[str, str], ns: dict[str, str], port: int, own_ns: bool = False
) -> bool:
    """Whether ``policy`` lets a pod (labels, namespace labels), in another namespace unless
    ``own_ns``, reach ``port``."""
    for rule in policy["spec"]["ingress"]:
        if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
            continue
        peers = rule.get("from")
        if not peers or any(_peer_admits(p, pod, ns, own_ns) for p in peers):
            return True
    return False


def test_only_gateway_pods_reach_ext_proc() -> None:
    """The release's Gateway's pods, not any pod carrying a gateway label; metrics only from
    Prometheus in `monitoring`; health open; the debug port never."""
    docs = render({})
    policy = one(docs, "NetworkPolicy")
    assert _selects(policy["spec"]["podSelector"], picker_labels(docs))
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert admitted(policy, *OWN_GW, 9002)
    for pod, labels in (OTHER_GW, OTHER_GW_HERE, EG_GW, OTHER, PROMETHEUS):
        assert not admitted(policy, pod, labels, 9002), f"{pod} in {labels} could call ext_proc"
    assert admitted(policy, *OTHER, 9003), "health is open (it reveals nothing)"
    assert admitted(policy, *PROMETHEUS, 9090)
    for pod, labels in (OTHER, FAKE_PROMETHEUS, OWN_GW):
        assert not admitted(policy, pod, labels, 9090), f"{pod} in {labels} could read metrics"
    assert not admitted(policy, *OTHER, 9091), "the debug port is never opened"


def test_network_policy_selector_is_configurable() -> None:
    values = {
        "gateway": {
            "namespaceSelector": {"matchLabels": ns("gw")},
            "podSelector": {"matchLabels": {"app": "istio-gw"}},
        },
        # Helm merges maps: null drops the default's pod labels, leaving {} (every pod there).
        "monitoring": {"namespaceSelector": {"matchLabels": ns("obs")}, "podSelector": {"matchLabels": None}},
    }
    policy = one(render(values), "NetworkPolicy")
    assert admitted(policy, {"app": "istio-gw"}, ns("gw"), 9002)
    assert not admitted(policy, *OWN_GW, 9002) and not admitted(policy, {"app": "istio-gw"}, ns(NS), 9002)
    assert admitted(policy, {"any": "pod"}, ns("obs"), 9090) and not admitted(policy, *PROMETHEUS, 9090)
    gke = {"provider": "gke", "gateway": {"ipBlocks": ["10.129.0.0/23"]}}
    rule = one(render(gke), "NetworkPolicy")["spec"]["ingress"][0]
    assert rule["from"] == [
        {"ipBlock": {"cidr": "10.129.0.0/23"}},
        {"ipBlock": {"cidr": "35.191.0.0/16"}},
        {"ipBlock": {"cidr": "130.211.0.0/22"}},
    ], "GKE's proxies and health checks, no pods"
    off = {"picker": {"networkPolicy": {"enabled": False}}}
    assert not [d for d in render(off) if d["kind"] == "NetworkPolicy"]


def test_termination_grace_covers_prestop_and_drain() -> None:
    docs = render({})
    spec = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    args = build_parser().parse_args(container["args"])
    sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] == 130, "GIE's termination grace"
    assert sleep + args.drain_timeout + 5 <= pod["terminationGracePeriodSeconds"], (
        "the kubelet would SIGKILL the picker while streams still drain"
    )
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }


def test_debug_api_off_and_metrics_on_9090() -> None:
    docs = render({})
    container = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    assert args.enable_debug_api is False and args.enable_explain_grpc is False
    assert args.metrics_port == 9090
    assert [p["containerPort"] for p in container["ports"]] == [9002, 9003, 9090, 5560]
    assert {p["port"] for p in one(docs, "Service", f"{RELEASE}-picker")["spec"]["ports"]} == {
        9002,
        9003,
        9090,
    }


def test_replicas_and_pdb_agree() -> None:
    """Two pickers and a PDB by default (a drain evicts one at a time); one picker needs the PDB off."""
    two = render({})
    assert one(two, "Deployment", f"{RELEASE}-picker")["spec"]["replicas"] == 2
    pdb = one(two, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= picker_labels(two).items()
    with pytest.raises(helm_python.HelmValuesError, match="minimum"):
        render({"picker": {"replicas": 1}})
    single = render(
        {"picker": {"replicas": 1, "podDisruptionBudget": {"enabled": False, "maxUnavailable": 1}}}
    )
    assert not [d for d in single if d["kind"] == "PodDisruptionBudget"]


def test_kind_gateway_is_admitted_by_the_default_policy() -> None:
    """deploy/kind's plain Envoy gateway carries the Gateway API label the default policy admits."""
    import sys

    sys.path.insert(0, str(CHART.parents[1] / "deploy" / "kind"))
    import envoy_manifest

    docs = envoy_manifest.manifests(NS, "p:9002", True, "envoy", 8080, gateway_name=f"{RELEASE}-gateway")
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert admitted(one(render({}), "NetworkPolicy"), pod, ns(NS), 9002)
    e2e = (CHART.parents[1] / "deploy" / "kind" / "e2e.sh").read_text()
    assert '--gateway-name "$RELEASE-gateway"' in e2e, "e2e.sh labels its Envoy as the release's Gateway"


def test_values_say_what_two_pickers_do() -> None:
    text = (CHART / "values.yaml").read_text()
    assert "agree" in text and "active-active" in text


def _render_module() -> ModuleType:
    """deploy/envoy/render.py (a script, not a package), loaded by path."""
    path = CHART.parents[1] / "deploy" / "envoy" / "render.py"
    spec = importlib.util.spec_from_file_location("kvpick_envoy_render", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


INFERENCE_PATHS = list(_render_module().INFERENCE_PATHS)
"""render.py's ``--allowed-paths`` default, which the chart's ``httpRoute.paths`` default repeats."""


def _route_paths(values: dict[str, Any]) -> list[tuple[str, str]]:
    route = one(render(values), "HTTPRoute")
    [rule] = route["spec"]["rules"]
    return [(m["path"]["type"], m["path"]["value"]) for m in rule["matches"]]


def test_http_route_routes_only_the_inference_paths() -> None:
    """The HTTPRoute matches the inference API's paths only (the same allowlist as render.py's
    --allowed-paths): a replica's /metrics, /tokenize or /reset_prefix_cache matches no rule, and
    the gateway answers 404 without reaching a replica. The list is values' httpRoute.paths."""
    on = {"httpRoute": {"enabled": True}, "gateway": {"create": True, "className": "eg"}}
    assert _route_paths(on) == [("PathPrefix", p) for p in INFERENCE_PATHS]
    mine = {**on, "httpRoute": {"enabled": True, "paths": ["/v1/completions", "/custom"]}}
    assert _route_paths(mine) == [("PathPrefix", "/v1/completions"), ("PathPrefix", "/custom")]
    for bad in ([], ["v1/completions"], ["/a b"]):
        with pytest.raises(helm_python.HelmValuesError):
            render({**on, "httpRoute": {"enabled": True, "paths": bad}})

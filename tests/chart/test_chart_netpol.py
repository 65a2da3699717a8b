"""The NetworkPolicies as Kubernetes reads them: the replicas take the gateway's proxies and the
pickers on the serving port and only the pickers on the KV-event ports; each provider's default
gateway selector matches the labels that implementation puts on its proxy pods; and the pickers
spread over nodes."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tests.chart.test_chart import NS, RELEASE, VALUE_SETS, one, picker_labels, render, validate
from tests.chart.test_chart_hardening import OTHER, PROMETHEUS, _selects, admitted, ns

pytestmark = pytest.mark.chart

REPLICAS = {"vllm": {"enabled": True}, "simulator": {"enabled": True}}
OWN_GW = ({"gateway.networking.k8s.io/gateway-name": f"{RELEASE}-gateway"}, ns(NS))


def replica_policy(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "NetworkPolicy", f"{RELEASE}-replicas")


def pod_labels(docs: list[dict[str, Any]], component: str) -> dict[str, str]:
    labels: dict[str, str] = one(docs, "Deployment", f"{RELEASE}-{component}")["spec"]["template"][
        "metadata"
    ]["labels"]
    return labels


def test_replicas_take_the_gateway_and_the_pickers_only() -> None:
    docs = render(REPLICAS)
    for d in docs:
        validate(d)
    policy = replica_policy(docs)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for component in ("vllm", "sim"):
        assert _selects(policy["spec"]["podSelector"], pod_labels(docs, component)), component
    assert not _selects(policy["spec"]["podSelector"], picker_labels(docs)), "the pickers have their own"
    picker = (picker_labels(docs), ns(NS))
    assert admitted(policy, *OWN_GW, 8000), "the gateway sends inference requests"
    assert admitted(policy, *picker, 8000, own_ns=True), "the pickers scrape /metrics, /health, /tokenize"
    assert admitted(policy, *picker, 5557, own_ns=True), "the pickers subscribe to KV events"
    assert not admitted(policy, *OWN_GW, 5557), "the gateway has no business with KV events"
    for pod, labels in (OTHER, PROMETHEUS, ({"app": "x"}, ns(NS))):
        for port in (8000, 5557, 5558):
            assert not admitted(policy, pod, labels, port, own_ns=labels == ns(NS)), (pod, port)
    assert not admitted(policy, picker_labels(docs), ns("elsewhere"), 8000), "another namespace's pickers"
    ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert ports == {8000, 5557}, "nothing else is open"


def test_replica_ports_follow_ranks_replay_and_ports() -> None:
    """One KV-event port per data-parallel rank (kvEventsPort + r), the replay port per rank when
    set (vLLM publishes there, the picker asks there), and the serving ports the pool names."""
    values = {
        **REPLICAS,
        "inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8001}]},
        "prefix": {"kvEventsReplayPort": 5600},
    }
    docs = render(values)
    for d in docs:
        validate(d)
    rules = replica_policy(docs)["spec"]["ingress"]
    assert [p["port"] for p in rules[0]["ports"]] == [8000, 8001]
    assert sorted(p["port"] for p in rules[1]["ports"]) == [5557, 5558, 5600, 5601]
    vllm = one(docs, "Deployment", f"{RELEASE}-vllm")["spec"]["template"]["spec"]["containers"][0]
    assert '"replay_endpoint":"tcp://*:5600"' in next(a for a in vllm["args"] if "kv-events-config" in a)
    assert {"name": "kv-replay", "containerPort": 5600, "protocol": "TCP"} in vllm["ports"]
    picker = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]["template"]["spec"]["containers"][0]
    assert "--kv-events-replay-port=5600" in picker["args"]
    sim_only = replica_policy(
        render({"simulator": {"enabled": True}, "prefix": {"kvEventsReplayPort": 5600}})
    )
    assert [p["port"] for p in sim_only["spec"]["ingress"][1]["ports"]] == [5557], (
        "the simulator has no replay"
    )


def test_replica_policy_options() -> None:
    assert not [
        d for d in render({}) if d["kind"] == "NetworkPolicy" and "replicas" in d["metadata"]["name"]
    ], "no chart replicas, no policy over somebody else's pods"
    off = render({**REPLICAS, "replicaNetworkPolicy": {"enabled": False}})
    assert [d["metadata"]["name"] for d in off if d["kind"] == "NetworkPolicy"] == [f"{RELEASE}-picker"]
    cidr = {"ipBlock": {"cidr": "172.18.0.2/32"}}
    docs = render({**REPLICAS, "replicaNetworkPolicy": {"admitMonitoring": True, "extraFrom": [cidr]}})
    for d in docs:
        validate(d)
    policy = replica_policy(docs)
    assert admitted(policy, *PROMETHEUS, 8000) and not admitted(policy, *PROMETHEUS, 5557)
    assert cidr in policy["spec"]["ingress"][0]["from"]


EG_POD = {
    "gateway.envoyproxy.io/owning-gateway-name": f"{RELEASE}-gateway",
    "gateway.envoyproxy.io/owning-gateway-namespace": NS,
    "app.kubernetes.io/managed-by": "envoy-gateway",
}
GWAPI_POD = {"gateway.networking.k8s.io/gateway-name": f"{RELEASE}-gateway"}


@pytest.mark.parametrize(
    ("provider", "pod", "namespace"),
    [
        ("envoy-gateway", EG_POD, "envoy-gateway-system"),  # proxies in the controller's namespace
        ("istio", GWAPI_POD, NS),  # deployed beside the Gateway
        ("kgateway", GWAPI_POD, NS),
    ],
)
def test_each_provider_admits_its_own_proxies(provider: str, pod: dict[str, str], namespace: str) -> None:
    docs = render(VALUE_SETS[provider] | REPLICAS)
    for d in docs:
        validate(d)
    for policy, port in (
        (one(docs, "NetworkPolicy", f"{RELEASE}-picker"), 9002),
        (replica_policy(docs), 8000),
    ):
        assert admitted(policy, pod, ns(namespace), port), (provider, port)
        assert not admitted(policy, pod, ns("tenant-a"), port), "the same labels elsewhere"
        other = {k: ("tenant-gw" if k.endswith("gateway-name") else v) for k, v in pod.items()}
        assert not admitted(policy, other, ns(namespace), port), "another Gateway's proxies"


def test_existing_gateway_and_gke() -> None:
    docs = render(VALUE_SETS["existing-gateway"] | REPLICAS)
    policy = one(docs, "NetworkPolicy", f"{RELEASE}-picker")
    assert admitted(policy, {"gateway.networking.k8s.io/gateway-name": "inference-gw"}, ns("gw"), 9002)
    assert not admitted(policy, *OWN_GW, 9002)
    gke = render(VALUE_SETS["gke"] | REPLICAS)
    for policy in (one(gke, "NetworkPolicy", f"{RELEASE}-picker"), replica_policy(gke)):
        peers = policy["spec"]["ingress"][0]["from"]
        cidrs = [p["ipBlock"]["cidr"] for p in peers if "ipBlock" in p]
        assert cidrs == ["10.129.0.0/23", "35.191.0.0/16", "130.211.0.0/22"]
        assert not any("namespaceSelector" in p and "podSelector" not in p for p in peers)


def test_pickers_spread_over_nodes() -> None:
    docs = render({})
    spec = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]["template"]["spec"]
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway", "fewer nodes than pickers still schedules"
    assert _selects(spread["labelSelector"], picker_labels(docs)), "it counts the pickers"
    assert spread["matchLabelKeys"] == ["pod-template-hash"]
    zone = {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"app": "x"}},
    }
    docs = render({"picker": {"topologySpreadConstraints": [zone]}})
    for d in docs:
        validate(d)
    spec = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]["template"]["spec"]
    assert spec["topologySpreadConstraints"] == [zone]
    spec = one(render({"picker": {"topologySpreadConstraints": []}}), "Deployment", f"{RELEASE}-picker")
    assert "topologySpreadConstraints" not in spec["spec"]["template"]["spec"]


BAD = [
    ({"provider": "gke"}, "/gateway/ipBlocks", "minItems"),
    ({"gateway": {"ipBlocks": ["10.0.0.0"]}}, "/gateway/ipBlocks/0", "pattern"),
    (
        {"gateway": {"podSelector": {"matchLabels": {"a": 1}}}},
        "/gateway/podSelector/matchLabels/a",
        "want string",
    ),
    ({"gateway": {"podSelector": {"app": "x"}}}, "/gateway/podSelector", "additional properties 'app'"),
    (
        {"monitoring": {"namespaceSelector": {"matchLabels": None}}},
        "/monitoring/namespaceSelector",
        "minProperties",
    ),
    ({"picker": {"networkPolicy": {"gatewayFrom": []}}}, "/picker/networkPolicy", "gatewayFrom"),
    ({"replicaNetworkPolicy": {"extraFrom": [{}]}}, "/replicaNetworkPolicy/extraFrom/0", "minProperties"),
    ({"replicaNetworkPolicy": {"enabled": "yes"}}, "/replicaNetworkPolicy/enabled", "want boolean"),
    ({"prefix": {"kvEventsReplayPort": 70000}}, "/prefix/kvEventsReplayPort", "maximum"),
    ({"vllm": {"kvEventsConfig": {"replay_endpoint": "tcp://*:1"}}}, "/vllm/kvEventsConfig", "not"),
    (
        {
            "picker": {
                "topologySpreadConstraints": [
                    {"maxSkew": 1, "topologyKey": "h", "whenUnsatisfiable": "Never"}
                ]
            }
        },
        "/picker/topologySpreadConstraints/0/whenUnsatisfiable",
        "ScheduleAnyway",
    ),
    (
        {"picker": {"topologySpreadConstraints": [{"maxSkew": 0}]}},
        "/picker/topologySpreadConstraints/0",
        "missing",
    ),
]


@pytest.mark.parametrize(("values", "where", "why"), BAD, ids=[f"{w}:{y}" for _, w, y in BAD])
def test_schema_rejects_bad_policy_values(values: dict[str, Any], where: str, why: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as info:
        render(values)
    message = str(info.value)
    assert f"at '{where}'" in message and why in message, message

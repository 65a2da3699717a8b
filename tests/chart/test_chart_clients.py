"""Slow clients on a chart-managed Envoy Gateway: a ClientTrafficPolicy on the Gateway bounds the
time to receive a request (408 past it) and the client connections per Envoy; only for provider
envoy-gateway and a Gateway in the release namespace (a policy attaches to a local Gateway)."""

from __future__ import annotations

import helm_python
import pytest

from tests.chart.test_chart import NS, RELEASE, VALUE_SETS, one, render, validate

pytestmark = pytest.mark.chart
EG = VALUE_SETS["envoy-gateway"]


def test_envoy_gateway_gets_a_client_traffic_policy_on_its_gateway() -> None:
    docs = render(EG)
    policy = one(docs, "ClientTrafficPolicy", f"{RELEASE}-clients")
    validate(policy)
    assert policy["apiVersion"] == "gateway.envoyproxy.io/v1alpha1" and policy["metadata"]["namespace"] == NS
    gateway = one(docs, "Gateway")
    [target] = policy["spec"]["targetRefs"]
    assert target == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": gateway["metadata"]["name"],
    }
    assert policy["spec"]["timeout"]["http"]["requestReceivedTimeout"] == "30s"
    assert policy["spec"]["connection"]["connectionLimit"]["value"] == 50000
    limits = {"requestReceivedTimeout": "5s", "connectionLimit": 1000}
    tuned = render({**EG, "gateway": {**EG["gateway"], "clientTraffic": limits}})
    spec = one(tuned, "ClientTrafficPolicy")["spec"]
    assert spec["timeout"]["http"]["requestReceivedTimeout"] == "5s"
    assert spec["connection"]["connectionLimit"]["value"] == 1000


@pytest.mark.parametrize(
    "values",
    [
        VALUE_SETS["kgateway"],
        VALUE_SETS["istio"],
        {**EG, "gateway": {**EG["gateway"], "clientTraffic": {"enabled": False}}},
        {
            **EG,
            "gateway": {"create": False},
            "httpRoute": {"enabled": True, "gatewayName": "g", "gatewayNamespace": "gw"},
        },
    ],
    ids=["kgateway", "istio", "disabled", "gateway-elsewhere"],
)
def test_no_policy_where_it_cannot_apply(values: dict[str, object]) -> None:
    assert not [d for d in render(values) if d["kind"] == "ClientTrafficPolicy"]


def test_the_schema_refuses_a_bad_timeout() -> None:
    with pytest.raises(helm_python.errors.HelmValuesError, match="requestReceivedTimeout"):
        render({**EG, "gateway": {**EG["gateway"], "clientTraffic": {"requestReceivedTimeout": "soon"}}})

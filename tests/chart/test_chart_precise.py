"""Chart values for precise prefix mode and several pickers: the replicas publish KV events where
the pickers subscribe, the tokenizer volume is mounted where the picker reads it, and the pickers
find each other through a headless Service that only picker pods may reach on the peer port."""

from __future__ import annotations

import json
from typing import Any

import helm_python
import pytest

from picker.__main__ import _peer_options, build_config, build_parser
from tests.chart.test_chart import NS, RELEASE, one, picker_labels, render, sim_parser, validate
from tests.chart.test_chart_hardening import _selects, admitted

pytestmark = [pytest.mark.chart, pytest.mark.precise]

PRECISE: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "vllm": {"enabled": True, "replicas": 4},
    "prefix": {
        "mode": "precise",
        "kvEventsPort": 5600,
        "tokenizerVolume": {"configMap": {"name": "llama-tokenizer"}},
    },
    "picker": {"replicas": 3},
}


def picker_args(docs: list[dict[str, Any]]) -> Any:
    container = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]["template"]["spec"]["containers"][0]
    return build_parser().parse_args(container["args"])


def test_precise_values_render_and_validate() -> None:
    docs = render(PRECISE)
    for d in docs:
        validate(d)
    picker = one(docs, "Deployment", f"{RELEASE}-picker")
    assert picker["spec"]["replicas"] == 3
    assert one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    pod = picker["spec"]["template"]["spec"]
    args = picker_args(docs)
    assert (args.prefix_mode, args.kv_events_port, args.tokenizer) == ("precise", 5600, "/models/tokenizer")
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "tokenizer", "mountPath": args.tokenizer, "readOnly": True} in mounts
    assert {"name": "tokenizer", "configMap": {"name": "llama-tokenizer"}} in pod["volumes"]
    vllm = one(docs, "Deployment", f"{RELEASE}-vllm")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    assert ports["kv-events"] == args.kv_events_port, "the picker subscribes where vLLM publishes"
    kv = json.loads(next(a for a in vllm["args"] if a.startswith("--kv-events-config=")).split("=", 1)[1])
    assert kv["endpoint"] == "tcp://*:5600" and kv["enable_kv_cache_events"] is True


def test_data_parallel_ranks_are_subscribed_at_their_offset_ports() -> None:
    """One targetPort per rank, in rank order: the picker subscribes rank r at kvEventsPort + r."""
    ranks = {"inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8001}, {"number": 8002}]}}
    for values, ports in ((ranks, (8000, 8001, 8002)), ({}, (8000,))):
        args = picker_args(render(values))
        args.config_file = None  # the ConfigMap's file is not here; the flag overrides it anyway
        assert build_config(args).prefix.data_parallel_ports == ports


def test_defaults_publish_and_subscribe_on_one_port_without_a_tokenizer() -> None:
    docs = render({"simulator": {"enabled": True}})
    args = picker_args(docs)
    assert (args.prefix_mode, args.kv_events_port, args.tokenizer) == ("auto", 5557, None)
    pod = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]["template"]["spec"]
    assert "tokenizer" not in {v["name"] for v in pod["volumes"]}
    sim = one(docs, "Deployment", f"{RELEASE}-sim")["spec"]["template"]["spec"]["containers"][0]
    assert sim_parser().parse_args(sim["args"]).kv_events_port == args.kv_events_port
    with pytest.raises(helm_python.HelmValuesError, match="kvEventsConfig"):  # one place names the port
        render({"vllm": {"enabled": True, "kvEventsConfig": {"enable_kv_cache_events": True,
                "publisher": "zmq", "endpoint": "tcp://*:1"}}})  # fmt: skip


def test_pickers_find_each_other_through_a_headless_service() -> None:
    """--peers-dns names the headless Service over the picker pods (not-ready ones too), on the
    port each picker binds; the NetworkPolicy admits picker pods, and nobody else, to that port."""
    docs = render({})
    args = picker_args(docs)
    svc = one(docs, "Service", f"{RELEASE}-picker-peers")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert _selects({"matchLabels": svc["spec"]["selector"]}, picker_labels(docs))
    port = svc["spec"]["ports"][0]["port"]
    assert args.peers_dns == f"{RELEASE}-picker-peers.{NS}.svc:{port}"
    assert args.peer_bind == f"tcp://*:{port}"
    assert _peer_options(args)["peer_dns"] == args.peers_dns
    policy = one(docs, "NetworkPolicy")
    assert admitted(policy, picker_labels(docs), {"name": NS}, port, own_ns=True)
    assert not admitted(policy, {"app": "other"}, {"name": NS}, port, own_ns=True)
    assert not admitted(policy, picker_labels(docs), {"name": "elsewhere"}, port), "another release's"
    off = render({"picker": {"peers": {"enabled": False, "port": 5560}}})
    assert not picker_args(off).peers_dns
    assert len([d for d in off if d["kind"] == "Service"]) == 1

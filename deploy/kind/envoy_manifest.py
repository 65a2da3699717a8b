#!/usr/bin/env python3
"""Print Kubernetes manifests for a plain Envoy gateway in front of the picker, for the kind test.

The Envoy config is deploy/envoy/render.py's (ext_proc to the picker, ORIGINAL_DST upstream keyed
by x-gateway-destination-endpoint), with two changes for a cluster: the pickers are reached by a
DNS name (STRICT_DNS), and responses carry ``x-kvpick-upstream: %UPSTREAM_HOST%`` so the
test can see which replica served each request.

    python3 deploy/kind/envoy_manifest.py --namespace kvpick --picker kvpick-picker-peers.kvpick.svc.cluster.local:9002

Name the chart's headless ``<release>-picker-peers`` Service, as e2e.sh does: it resolves to every
picker pod's address, so Envoy sees one host per picker, health-checks each (every 0.5 s), ejects a
dead one and retries its streams on another (render.py's failover). The ClusterIP
``<release>-picker`` Service would be one host to Envoy, and kube-proxy would keep sending new
streams to a dead pod until its readiness probe failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
from typing import Any

RENDER = pathlib.Path(__file__).resolve().parents[1] / "envoy" / "render.py"
UPSTREAM_HEADER = "x-kvpick-upstream"
GATEWAY_LABEL = "gateway.networking.k8s.io/gateway-name"


CLIENT_CERT_DIR = "/etc/kvpick/gateway-tls"
"""Where the gateway's client certificate Secret is mounted (``--client-secret``)."""


def envoy_config(picker: str, tls: bool, listen_port: int, client_cert_dir: str = "") -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("kvpick_envoy_render", RENDER)
    assert spec is not None and spec.loader is not None, f"cannot load {RENDER}"
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    cfg: dict[str, Any] = render.render(
        listen_port=listen_port, picker=picker, tls=tls, client_cert_dir=client_cert_dir
    )
    resources = cfg["static_resources"]
    for picker_cluster in (c for c in resources["clusters"] if c["name"].startswith("kvpick_picker")):
        picker_cluster["type"] = "STRICT_DNS"  # both: the streamed routes' cluster too
        picker_cluster["dns_lookup_family"] = "V4_ONLY"
    hcm = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    vhost = hcm["route_config"]["virtual_hosts"][0]
    vhost["response_headers_to_add"] = [
        {
            "header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_HOST%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
    ]
    return cfg


def manifests(
    namespace: str,
    picker: str,
    tls: bool,
    image: str,
    port: int,
    gateway_name: str = "kvpick-gateway",
    client_secret: str = "",
) -> list[dict[str, Any]]:
    """``gateway_name``: the Gateway this Envoy stands in for, on its pods' Gateway API label; the
    chart's NetworkPolicies admit pods labelled ``<release>-gateway`` in its namespace (provider none).
    ``client_secret``: the chart's ``<release>-gateway-client-tls`` Secret, mounted at
    :data:`CLIENT_CERT_DIR`: Envoy presents its certificate to the picker (mTLS)."""
    labels = {"app.kubernetes.io/name": "kvpick-envoy"}
    meta = {"name": "kvpick-envoy", "namespace": namespace, "labels": labels}
    cert_dir = CLIENT_CERT_DIR if client_secret else ""
    config = json.dumps(
        envoy_config(picker, tls, port, cert_dir), indent=1
    )  # JSON is YAML: Envoy reads it as is
    container = {
        "name": "envoy",
        "image": image,
        "args": ["-c", "/etc/envoy/envoy.yaml", "--log-level", "info"],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 2},
        # As `make docker-e2e` runs it: non-root, no capabilities, read-only root with /tmp writable.
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/envoy"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": "kvpick-envoy"}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    if client_secret:
        container["volumeMounts"].append(
            {"name": "client-tls", "mountPath": CLIENT_CERT_DIR, "readOnly": True}
        )
        pod_spec["volumes"].append({"name": "client-tls", "secret": {"secretName": client_secret}})
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"envoy.yaml": config}},
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                # The Gateway API label: the chart's default NetworkPolicies admit it (ext_proc, replicas).
                "template": {
                    "metadata": {"labels": {**labels, GATEWAY_LABEL: gateway_name}},
                    "spec": pod_spec,
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {"selector": labels, "ports": [{"name": "http", "port": port, "targetPort": "http"}]},
        },
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--namespace", default="kvpick")
    p.add_argument(
        "--picker", required=True, help="the pickers' headless Service host:port (ext_proc gRPC; module doc)"
    )
    p.add_argument("--plaintext", action="store_true", help="the picker runs with --secure-serving=false")
    p.add_argument(
        "--image", default="envoyproxy/envoy:v1.36-latest", help="e2e.sh passes our kvpick envoy image"
    )
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--gateway-name",
        default="kvpick-gateway",
        help="the pods' gateway.networking.k8s.io/gateway-name: <release>-gateway, which the chart admits",
    )
    p.add_argument(
        "--client-secret",
        default="",
        help="the chart's <release>-gateway-client-tls Secret: Envoy presents its certificate to the "
        "picker (mTLS, the chart's default with provider none); default: none",
    )
    args = p.parse_args(argv)
    docs = manifests(
        args.namespace,
        args.picker,
        not args.plaintext,
        args.image,
        args.port,
        args.gateway_name,
        args.client_secret,
    )
    sys.stdout.write("\n---\n".join(json.dumps(d, indent=1) for d in docs) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""The kind test's driver for deploy/kind/checks.py (the checks ``make docker-e2e`` runs too).

The replicas are the Helm release's pods in the InferencePool (label ``kvpick.io/pool``); their
``/metrics`` are read through the API server's pod proxy (``kubectl get --raw``), and killing one
is a forced pod deletion (its Deployment then starts a replacement, which joins the checks once
it is Running). The picker's gRPC health port must be reachable at ``--health`` (e2e.sh
port-forwards it).

    python deploy/kind/check.py --url http://127.0.0.1:18080 --namespace kvpick --model M \\
        --health 127.0.0.1:19003
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import subprocess
import sys
from types import ModuleType

HERE = pathlib.Path(__file__).resolve().parent


def _load_checks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvpick_e2e_checks", HERE / "checks.py")
    assert spec is not None and spec.loader is not None, "cannot load deploy/kind/checks.py"
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


checks = _load_checks()


class KubeCluster:
    """checks.Cluster over the release's replica pods. ``killed`` is written only by :meth:`kill`."""

    def __init__(self, namespace: str, selector: str, port: int) -> None:
        self.namespace, self.selector, self.port = namespace, selector, port
        self.killed: set[str] = set()
        self.ips: dict[str, str] = {}

    def _kubectl(self, *args: str) -> str:
        return subprocess.check_output(["kubectl", "-n", self.namespace, *args], text=True)

    def replicas(self) -> list[str]:
        pods = json.loads(self._kubectl("get", "pods", "-l", self.selector, "-o", "json"))["items"]
        live = []
        for pod in pods:
            name = pod["metadata"]["name"]
            ready = any(
                c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])
            )
            if ready and name not in self.killed and not pod["metadata"].get("deletionTimestamp"):
                self.ips[name] = pod["status"]["podIP"]
                live.append(name)
        return sorted(live)

    def address(self, name: str) -> str:
        return f"{self.ips[name]}:{self.port}"

    def metrics(self, name: str) -> str:
        return self._kubectl(
            "get", "--raw", f"/api/v1/namespaces/{self.namespace}/pods/{name}:{self.port}/proxy/metrics"
        )

    def kill(self, name: str) -> None:
        self._kubectl("delete", "pod", name, "--grace-period=0", "--force", "--wait=false")
        self.killed.add(name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the gateway (Envoy) base URL")
    p.add_argument("--namespace", required=True)
    p.add_argument("--model", required=True, help="the chart's `model` value (e2e.sh passes both)")
    p.add_argument("--health", default="", help="the picker's gRPC health port host:port (kubelet's probe)")
    p.add_argument("--selector", default="kvpick.io/pool=kvpick", help="the replica pods' labels")
    p.add_argument("--port", type=int, default=8000, help="the replicas' serving port")
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--kill-deadline", type=float, default=60.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cluster = KubeCluster(args.namespace, args.selector, args.port)
    gw = checks.Gateway(args.url, args.model)
    checks.run_all(
        cluster, gw, health=args.health or None, groups=args.groups, kill_deadline_s=args.kill_deadline
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

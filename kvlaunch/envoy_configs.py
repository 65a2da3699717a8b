"""Every Envoy config the project ships, as render.py arguments, and the same configs pointed at a
test stack's ports (the committed files name 127.0.0.1:8001,8002 and the picker at :9002)."""

from __future__ import annotations

import importlib.util
from typing import Any

import yaml

from .procs import ROOT, free_port
from .stack import Stack

CONTRACT = "127.0.0.1:8001,127.0.0.1:8002"
"""The endpoints the committed configs name: the replica pair of docs/install.md's plain-Envoy setup."""

SHIPPED: dict[str, list[str]] = {
    "envoy.yaml": [],
    "envoy-fallback.yaml": ["--upstream", "pool", "--endpoints", CONTRACT],
    "envoy-failopen.yaml": ["--failure-mode", "open", "--fallback", CONTRACT],
}
"""deploy/envoy/<name>: the render.py arguments that produce it (besides ``-o``)."""

KIND = "kind"
"""deploy/kind/envoy_manifest.py's config: render.py's default with a STRICT_DNS picker."""

ALL = [*SHIPPED, KIND]


def local_args(name: str, upstreams: list[int]) -> list[str]:
    """render.py arguments for shipped config ``name`` with the test's upstream ports."""
    eps = ",".join(f"127.0.0.1:{p}" for p in upstreams)
    return [eps if a == CONTRACT else a for a in SHIPPED[name]]


def kind_config(picker: str, listen_port: int, admin_port: int, client_cert_dir: str = "") -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location(
        "envoy_manifest", ROOT / "deploy" / "kind" / "envoy_manifest.py"
    )
    assert spec is not None and spec.loader is not None
    manifest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(manifest)
    cfg: dict[str, Any] = manifest.envoy_config(
        picker, tls=True, listen_port=listen_port, client_cert_dir=client_cert_dir
    )
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    return cfg


def kind_config_text(picker_port: int, listen_port: int, admin_port: int, client_cert_dir: str = "") -> str:
    cfg = kind_config(f"localhost:{picker_port}", listen_port, admin_port, client_cert_dir)
    return yaml.safe_dump(cfg, sort_keys=False)


def start_envoy(st: Stack, name: str, *extra: str) -> None:
    """Start Envoy on ``st`` with shipped config ``name`` (its picker must be up)."""
    if name == KIND:
        st.envoy_port = st.envoy_port or free_port()
        cert_dir = str(st.pki.gateway) if st.pki is not None else ""  # as the chart's Secret mounted
        st.start_envoy(config=kind_config_text(st.grpc_port, st.envoy_port, free_port(), cert_dir))
    else:
        st.start_envoy(*local_args(name, st.upstreams), *extra)

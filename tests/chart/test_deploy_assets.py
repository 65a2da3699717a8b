"""deploy/kind and deploy/docker assets that can be checked without Docker or a cluster: the
kind gateway's Envoy config (validated by the real Envoy binary), its manifests
(kubernetes-validate), and the scripts' clean SKIPPED exit where their tools are missing."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import kubernetes_validate
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENVOY = pathlib.Path(sys.executable).parent / "envoy"
sys.path.insert(0, str(ROOT / "deploy" / "kind"))
import envoy_manifest  # noqa: E402

pytestmark = pytest.mark.chart
PICKER = "kvpick-picker.kvpick.svc.cluster.local:9002"


@pytest.mark.envoy
def test_kind_envoy_config_is_valid_for_envoy(tmp_path: pathlib.Path) -> None:
    assert ENVOY.exists(), f"no envoy binary at {ENVOY}"
    cfg = envoy_manifest.envoy_config(PICKER, tls=True, listen_port=8080)
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run(
        [str(ENVOY), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    assert clusters["kvpick_picker"]["type"] == "STRICT_DNS"
    assert clusters["kvpick_upstream"]["type"] == "ORIGINAL_DST"


def test_kind_envoy_manifests_validate() -> None:
    docs = envoy_manifest.manifests("kvpick", PICKER, True, "envoyproxy/envoy:v1.36-latest", 8080)
    assert [d["kind"] for d in docs] == ["ConfigMap", "Deployment", "Service"]
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("script", ["deploy/kind/e2e.sh", "deploy/docker/build.sh"])
def test_scripts_skip_cleanly_without_their_tools(script: str, tmp_path: pathlib.Path) -> None:
    """With a PATH holding only bash's basics (no docker, kind, helm), the scripts say SKIPPED and exit 0."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "dirname", "cat", "seq", "grep", "printf"):
        found = shutil.which(tool)
        if found:
            (bindir / tool).symlink_to(found)
    env = {"PATH": str(bindir), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [str(bindir / "bash"), script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("SKIPPED: "), proc.stdout + proc.stderr
    assert os.access(ROOT / script, os.X_OK), f"{script} is not executable"

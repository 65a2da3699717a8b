"""deploy/kind and deploy/docker assets that can be checked without Docker or a cluster: the
kind gateway's Envoy config (validated by the real Envoy binary), its manifests
(kubernetes-validate), the scripts' clean SKIPPED exit where their tools are missing, and e2e.sh's
command lines (run against stub tools)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENVOY = pathlib.Path(sys.executable).parent / "envoy"
sys.path.insert(0, str(ROOT / "deploy" / "kind"))
import envoy_manifest  # noqa: E402

from replica.sim.__main__ import parser as sim_parser  # noqa: E402
from tests.chart.test_chart import RELEASE, one, render  # noqa: E402

pytestmark = pytest.mark.chart
PICKER = "kvpick-picker.kvpick.svc.cluster.local:9002"
_spec = importlib.util.spec_from_file_location("kind_check", ROOT / "deploy" / "kind" / "check.py")
assert _spec and _spec.loader
kind_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kind_check)


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


def test_kind_envoy_reaches_each_picker_pod() -> None:
    """e2e.sh points Envoy at the chart's headless peers Service on the ext_proc port: a STRICT_DNS
    cluster over every picker pod (not-ready ones too; the health checks sort them out), each
    health-checked and ejected on its own, with the ext_proc stream retried on another."""
    script = (ROOT / "deploy/kind/e2e.sh").read_text()
    arg = '--picker "$RELEASE-picker-peers.$NAMESPACE.svc.cluster.local:9002"'
    assert arg in script, "e2e.sh must name the headless peers Service"
    docs = render({})
    svc = one(docs, "Service", f"{RELEASE}-picker-peers")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    pod = one(docs, "Deployment", f"{RELEASE}-picker")["spec"]["template"]
    assert all(pod["metadata"]["labels"][k] == v for k, v in svc["spec"]["selector"].items())
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert ports["grpc"] == 9002, "the name's port must be the pods' ext_proc port"
    name = f"{RELEASE}-picker-peers.kvpick.svc.cluster.local"
    cfg = envoy_manifest.envoy_config(f"{name}:9002", tls=True, listen_port=8080)
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "kvpick_picker")
    assert cluster["type"] == "STRICT_DNS"
    addr = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert addr["socket_address"] == {"address": name, "port_value": 9002}
    assert cluster["health_checks"][0]["grpc_health_check"]["service_name"].endswith("ExternalProcessor")
    assert cluster["outlier_detection"]["consecutive_local_origin_failure"] == 1
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if "ext_proc" in f["name"])
    assert "retry_policy" in ext_proc["typed_config"]["grpc_service"]


@pytest.mark.parametrize(
    "script", ["deploy/kind/e2e.sh", "deploy/docker/build.sh", "deploy/docker/base-image.sh"]
)
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


STUB = """#!{python}
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
"""


def _set_values(argv: list[str]) -> dict[str, Any]:
    """The values a `helm upgrade --install` command line sets with --set and --set-string."""
    values: dict[str, Any] = {}
    for flag, arg in itertools.pairwise(argv):
        if flag not in ("--set", "--set-string"):
            continue
        for item in arg.split(","):
            key, _, raw = item.partition("=")
            node: Any = values
            *parents, leaf = key.split(".")
            for part in parents:
                name, _, index = part.partition("[")  # a list item: extraFrom[0]
                if index:
                    items = node.setdefault(name, [])
                    i = int(index.rstrip("]"))
                    items.extend({} for _ in range(i + 1 - len(items)))
                    node = items[i]
                else:
                    node = node.setdefault(part, {})
            node[leaf] = raw if flag == "--set-string" else yaml.safe_load(raw)
    return values


def test_kind_e2e_sends_the_model_the_chart_serves(tmp_path: pathlib.Path) -> None:
    """e2e.sh run against stub docker/kind/helm/kubectl/curl/python: the model check.py sends is
    the model the chart, installed with e2e.sh's --set values, gives the simulator replicas."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "dirname", "cat", "seq", "grep", "printf", "sleep", "mktemp", "rm", "awk"):
        found = shutil.which(tool)
        if found:
            (bindir / tool).symlink_to(found)
    for tool in ("docker", "kind", "helm", "kubectl", "curl", "python3"):
        (bindir / tool).write_text(STUB.format(python=sys.executable))
        (bindir / tool).chmod(0o755)
    log = tmp_path / "calls.jsonl"
    env = {"PATH": str(bindir), "HOME": str(tmp_path), "STUB_LOG": str(log), "PYTHON": "python3"}
    proc = subprocess.run(
        [str(bindir / "bash"), "deploy/kind/e2e.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    helm = next(c for c in calls if c[:3] == ["helm", "upgrade", "--install"])
    check = next(c for c in calls if c[:2] == ["python3", "deploy/kind/check.py"])
    sent = kind_check.build_parser().parse_args(check[2:]).model

    values = _set_values(helm)
    docs = render(values)  # the chart's schema validates e2e.sh's values too
    # check.py reads /metrics through the API server's pod proxy: the control plane is admitted.
    extra = values["replicaNetworkPolicy"]["extraFrom"]
    assert [list(p) for p in extra] == [["ipBlock"]] and extra[0]["ipBlock"]["cidr"].endswith("/32")
    sim = one(docs, "Deployment", f"{RELEASE}-sim")["spec"]["template"]["spec"]["containers"][0]
    assert sim_parser().parse_args(sim["args"]).model == sent


def test_docker_e2e_skips_cleanly_without_docker(tmp_path: pathlib.Path) -> None:
    """`make docker-e2e`'s driver with no docker on PATH says SKIPPED and exits 0."""
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "deploy/docker/e2e.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("SKIPPED: "), proc.stdout + proc.stderr


UNREACHABLE_DOCKER = """#!/bin/sh
echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2
exit 1
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["bash", "deploy/docker/build.sh"],
        ["bash", "deploy/docker/base-image.sh"],
        [sys.executable, "deploy/docker/e2e.py"],
        ["make", "--no-print-directory", "docker-e2e"],
    ],
    ids=["images", "base-image", "e2e.py", "make-docker-e2e"],
)
def test_docker_targets_skip_cleanly_when_the_daemon_is_unreachable(
    argv: list[str], tmp_path: pathlib.Path
) -> None:
    """A docker CLI whose daemon does not answer: every image/e2e entry point says SKIPPED, exit 0.
    With a real docker CLI on this machine it is that CLI pointed at a socket nobody serves;
    without one, a stand-in that fails `docker info` as the CLI does."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "sh", "dirname", "cat", "make", "python3"):
        found = shutil.which(tool)
        if found:
            (bindir / tool).symlink_to(found)
    real = shutil.which("docker")
    if real:
        (bindir / "docker").symlink_to(real)
    else:
        (bindir / "docker").write_text(UNREACHABLE_DOCKER)
        (bindir / "docker").chmod(0o755)
    if argv[0] == "make" and not (bindir / "make").exists():
        pytest.skip("no make on this machine")
    env = {
        "PATH": str(bindir),
        "HOME": str(tmp_path),
        "DOCKER_HOST": f"unix://{tmp_path}/nobody.sock",
        "DOCKER_CONFIG": str(tmp_path / "docker-config"),
    }
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("SKIPPED: "), proc.stdout + proc.stderr
    assert "daemon unreachable" in proc.stdout, proc.stdout


def test_image_requirements_are_the_packages_dependencies() -> None:
    """deploy/docker/requirements.py (the images' dependency layer) lists exactly pyproject's
    dependencies plus the extras asked for, and refuses an extra pyproject does not have."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    script = [sys.executable, "deploy/docker/requirements.py", "pyproject.toml"]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*script, *extra], cwd=ROOT, capture_output=True, text=True, timeout=30)

    assert run().stdout.splitlines() == project["dependencies"]
    want = project["dependencies"] + project["optional-dependencies"]["replica"]
    assert run("replica").stdout.splitlines() == want
    bad = run("no-such-extra")
    assert bad.returncode != 0 and "unknown extra 'no-such-extra'" in bad.stderr, bad.stderr


def test_e2e_checks_read_counters_as_prometheus_writes_them() -> None:
    """checks.counter_sum sums every label set of a counter in prometheus_client's own text
    output, and only that counter (not a name it is a prefix of, not _created samples)."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    spec = importlib.util.spec_from_file_location("kvpick_e2e_checks", ROOT / "deploy" / "kind" / "checks.py")
    assert spec is not None and spec.loader is not None
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    reg = CollectorRegistry()
    ok = Counter("vllm:request_success", "", ["finished_reason"], registry=reg)
    ok.labels("stop").inc(3)
    ok.labels("length").inc(2)
    Counter("vllm:request_success_extra", "", registry=reg).inc(100)
    text = generate_latest(reg).decode()
    assert checks.counter_sum(text, "vllm:request_success_total") == 5.0
    assert checks.counter_sum(text, "vllm:prefix_cache_hits_total") == 0.0


def _copied(dockerfile: str) -> set[str]:
    """The build-context paths a Dockerfile's COPY lines take (``--from`` stages aside)."""
    out: set[str] = set()
    for line in (ROOT / "deploy/docker" / dockerfile).read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            out.update(w.rstrip("/") for w in words[1:-1] if not w.startswith("--"))
    return out


def _sent(dockerfile: str) -> set[str]:
    """What the Dockerfile's ``.dockerignore`` lets into the build context (``*``, then ``!path``)."""
    lines = (ROOT / "deploy/docker" / f"{dockerfile}.dockerignore").read_text().splitlines()
    assert "*" in lines, "the ignore file must start from nothing"
    return {ln[1:] for ln in lines if ln.startswith("!")}


@pytest.mark.parametrize(
    ("dockerfile", "packages"),
    [("Dockerfile.picker", {"picker", "proto"}), ("Dockerfile.sim", {"replica"})],
)
def test_image_holds_only_its_packages(dockerfile: str, packages: set[str], tmp_path: pathlib.Path) -> None:
    """The picker image gets picker and proto and nothing else of kvpick, the simulator's image
    only replica: the context sent, the files copied, and the wheel that the Dockerfile's install
    line builds from exactly those files (KVPICK_PACKAGES as the Dockerfile sets it)."""
    support = {
        "pyproject.toml",
        "setup.py",
        "README.md",
        "deploy/docker/pip-install.sh",
        "deploy/docker/requirements.py",
    }
    copied = _copied(dockerfile)
    assert copied == support | packages
    assert _sent(dockerfile) == copied
    text = (ROOT / "deploy/docker" / dockerfile).read_text()
    assert f"KVPICK_PACKAGES={','.join(sorted(packages, key=['picker', 'proto', 'replica'].index))} " in text
    src = tmp_path / "src"
    for path in copied:
        dest = src / pathlib.Path(path).name if path.startswith("deploy/") else src / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / path).is_dir():
            shutil.copytree(ROOT / path, dest, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / path, dest)
    env = {**os.environ, "KVPICK_PACKAGES": ",".join(sorted(packages))}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src),
            "-w",
            str(tmp_path / "w"),
        ],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        timeout=180,
    )
    (wheel,) = (tmp_path / "w").glob("kvpick-*.whl")
    top = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in top if not t.endswith(".dist-info")} == packages


def test_setup_refuses_an_unknown_package() -> None:
    proc = subprocess.run(
        [sys.executable, "setup.py", "--name"],
        cwd=ROOT,
        env={**os.environ, "KVPICK_PACKAGES": "picker,nosuch"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "nosuch" in proc.stdout + proc.stderr

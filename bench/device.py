"""``make device-check`` (``python -m bench.device``): the offline GPU node's one run (at most 8
minutes; docs/benchmarks.md#on-the-offline-gpu-node).

    python -m bench.device                 # on the node: the kit in .device/wheels, parts a and b
    python -m bench.device --dry-run       # here: reduced scale, what is installed

1. **Environment.** Where the current interpreter lacks a kit's packages (the node: Python 3.12,
   torch, nothing else), a fresh venv ``.device/venv`` (``--system-site-packages``, for torch)
   gets every wheel of the kit (``pip install --no-index --no-deps``) and the script runs again
   in it; the checkout itself is on the path (kvpick is not installed).
2. **Part b** (kit ``picker``): ``bench.gpu_profile.run(out_dir, dry)`` in a child process, ended
   when its budget is spent; skipped, with a note, where the module is not in this checkout.
3. **Part a, scale-out** (``bench.datapath``'s machinery): one fixed-response upstream per upstream
   CPU, and in front of it kvpick behind Envoy (``--concurrency`` = Envoy's CPUs) with the picker
   at ``--workers 1, 2, 4, 8`` (kit ``picker``; dry: 1, 2), 3 separate pickers sharing their picks
   (``kvpick-3p``), and vllm-router and sglang-router (kit ``peers``); ``direct`` (straight to one
   upstream process) beside them. Cases ``8k-c64`` and ``220k-c150``. Per router: req/s, p50, p99,
   the router's CPU per request (every process of it, from ``/proc``), Envoy's, and the cores it
   kept busy. The load generator (``wrk`` where there is one, else ``bench.httpload``) runs on its
   own CPUs; :func:`bench.datapath.split_cores` says which, and the output repeats it.
4. ``device.json`` and ``device.md`` in ``$OUT`` (default ``bench/results/raw/device-TIMESTAMP``).

The whole keeps to ``--budget`` seconds (450, from the first start, the venv included): part b
gets ``--budget-b`` of it, part a the rest less a margin, its run length chosen to fit; what would
not fit is skipped and listed. Which kit: ``--kit``, default every kit in ``.device/wheels`` (one
per run on the node: the whole exceeds the 64 MiB a run carries), else what is installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import pathlib
import platform
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .device_pack import DEVICE_DIR, ROOT, WHEELS

if TYPE_CHECKING:  # imported once the kit is installed: bench.datapath needs orjson
    from . import datapath as dp

T0_ENV = "KVPICK_DEVICE_T0"
VENV_ENV = "KVPICK_DEVICE_VENV"
KITS = ("picker", "peers")
CASES = ("8k-c64", "220k-c150")
PEERS = ("vllm-router", "sglang-router")
"""``bench.routers.PEERS``, named here before anything but the standard library can be imported."""
B_MARGIN_S = 40.0
"""Part b's own budget is this much under the parent's hard stop (one point, the files)."""
T0 = float(os.environ.get(T0_ENV, time.time()))
PY = sys.executable
ENVOY = str(pathlib.Path(PY).parent / "envoy")
"""``kvlaunch.PY``/``ENVOY``, named without importing ``kvlaunch``: until :func:`ensure_env` has
installed the kit this module may import the standard library alone (tests/bench/test_device.py)."""


def say(msg: str) -> None:
    print(f"[device {time.time() - T0:6.1f}s] {msg}", flush=True)


def installed(kit: str) -> bool:
    """Whether this interpreter can run ``kit``'s routers."""
    if kit == "picker":
        mods = (
            "grpc",
            "google.protobuf",
            "xds",
            "cryptography",
            "aiohttp",
            "orjson",
            "zmq",
            "msgspec",
            "tokenizers",
        )
        return pathlib.Path(ENVOY).exists() and all(importlib.util.find_spec(m) for m in mods)
    bins = pathlib.Path(PY).parent
    return all((bins / p).exists() for p in PEERS) and all(
        importlib.util.find_spec(m) for m in ("aiohttp", "orjson")
    )


def choose_kits(arg: str) -> list[str]:
    if arg != "auto":
        return list(KITS) if arg == "all" else [arg]
    packed = [k for k in KITS if (WHEELS / k / "wheels.txt").is_file()]
    return packed or [k for k in KITS if installed(k)]


def make_venv(venv: pathlib.Path) -> None:
    """A venv at ``venv`` that sees this interpreter's packages (torch on the node) behind its own.

    ``--system-site-packages`` reaches the *base* interpreter's site-packages only; where this
    Python is itself a venv (the node's ``/opt/torch/.venv``) torch sits in its own, so a .pth file
    appends this interpreter's site-packages after the new venv's (the kit's versions win)."""
    made = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    if made.returncode != 0:  # no ensurepip on this Python: a venv without pip, this pip fills it
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
            check=True,
        )
    purelib = pathlib.Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    parent = [p for p in site.getsitepackages() if pathlib.Path(p).is_dir()]
    (purelib / "kvpick-parent-site.pth").write_text("".join(f"{p}\n" for p in parent))


def ensure_env(kits: list[str], argv: list[str]) -> None:
    """Install the kits into ``.device/venv`` and run again there, unless this interpreter has them."""
    missing = [k for k in kits if not installed(k)]
    if not missing:
        return
    if os.environ.get(VENV_ENV):
        raise SystemExit(f"bench.device: kits {missing} still not importable in {PY} after installing")
    venv = DEVICE_DIR / "venv"
    py = venv / "bin" / "python"
    if not py.exists():
        say(f"creating {venv.relative_to(ROOT)} (--system-site-packages) with {sys.executable}")
        make_venv(venv)
    pip = (
        [str(py), "-m", "pip"]
        if (venv / "bin" / "pip").exists()
        else [sys.executable, "-m", "pip", "--python", str(py)]
    )
    wheels = list({w.name: str(w) for k in kits for w in sorted((WHEELS / k).glob("*.whl"))}.values())
    if not wheels:
        raise SystemExit(f"bench.device: no wheels under {WHEELS} for {kits}: run `make device-pack` first")
    say(f"installing {len(wheels)} wheels of {', '.join(kits)} (--no-index --no-deps)")
    subprocess.run([*pip, "install", "--quiet", "--no-index", "--no-deps", *wheels], check=True)
    say(f"re-running in {py}")
    env = {**os.environ, VENV_ENV: "1", T0_ENV: str(T0), "PYTHONPATH": str(ROOT)}
    os.execve(str(py), [str(py), "-m", "bench.device", *argv], env)


# ---- part b ---------------------------------------------------------------------------------------


def part_b(out: pathlib.Path, dry: bool, budget: float) -> dict[str, Any]:
    """``bench.gpu_profile.run`` in a child process, within ``budget`` seconds."""
    d = out / "gpu_profile"
    d.mkdir(parents=True, exist_ok=True)
    result = d / "_result.json"
    cmd = [PY, "-m", "bench.device", "--gpu-profile-child", str(d), "--budget-b", str(budget)]
    cmd += ["--dry-run"] if dry else []
    say(f"part b: bench.gpu_profile.run({d.relative_to(out.parent)}, dry={dry}), budget {budget:.0f} s")
    t = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(1.0, budget))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"status": "timeout", "note": f"ended after its budget of {budget:.0f} s", "seconds": budget}
    seconds = round(time.monotonic() - t, 1)
    if rc != 0 or not result.exists():
        return {"status": "error", "note": f"exited with {rc}", "seconds": seconds}
    doc: dict[str, Any] = json.loads(result.read_text())
    result.unlink()
    return {**doc, "seconds": seconds}


def gpu_profile_child(out_dir: pathlib.Path, dry: bool, budget: float) -> int:
    """Part b's child: run the profile, write ``{status, result | note}`` to ``_result.json``.
    Where ``run`` takes a ``budget_s`` it gets the budget less :data:`B_MARGIN_S` (a quarter at most), to finish its
    last point and write its files before the parent's hard stop."""
    try:
        gpu_profile = importlib.import_module("bench.gpu_profile")
    except ModuleNotFoundError as exc:
        if exc.name != "bench.gpu_profile":  # the module is there, one of its imports is not
            raise
        doc: dict[str, Any] = {"status": "skipped", "note": "bench.gpu_profile is not in this checkout"}
    else:
        extra = {}
        if "budget_s" in inspect.signature(gpu_profile.run).parameters:
            extra["budget_s"] = max(1.0, budget - min(B_MARGIN_S, budget / 4))
        doc = {"status": "ok", "result": gpu_profile.run(out_dir, dry, **extra)}
    (out_dir / "_result.json").write_text(json.dumps(doc, indent=1, default=str))
    return 0


# ---- part a ---------------------------------------------------------------------------------------


def routers_for(
    kits: list[str], workers: list[int]
) -> tuple[list[str], dict[str, dp.Variant], dict[str, int]]:
    routers = ["direct"]
    variants: dict[str, tuple[list[str], list[str], str]] = {}
    pickers: dict[str, int] = {}
    if "picker" in kits:
        for w in workers:
            routers.append(f"kvpick-w{w}")
            variants[f"kvpick-w{w}"] = ([], ["--workers", str(w)], "")
        routers.append("kvpick-3p")
        pickers["kvpick-3p"] = 3
    if "peers" in kits:
        routers += [p for p in PEERS if (pathlib.Path(PY).parent / p).exists()]
    return routers, variants, pickers


def part_a(a: argparse.Namespace, kits: list[str], out: pathlib.Path, deadline: float) -> dict[str, Any]:
    from . import datapath as dp

    workers = [int(w) for w in a.workers.split(",")]
    routers, variants, pickers = routers_for(kits, workers)
    layout = dp.split_cores(os.sched_getaffinity(0))
    loadgen = dp.Loadgen("wrk" if shutil.which("wrk") and a.loadgen != "python" else "python", layout.loadgen)
    say(f"part a: {', '.join(routers)}; cores: {layout.note}; load generator {loadgen.kind}")
    cases = [dp.CASES[c] for c in CASES]
    runs: list[dp.Run] = []
    skipped: list[str] = []
    run_dir = out / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory() as tmp,
        dp.stack(routers, variants, run_dir, layout, pickers) as targets,
    ):
        say(f"part a: {len(targets)} routers up")
        time.sleep(a.settle)
        idle = dp.idle_rates(targets, a.idle)
        slots = len(cases) * len(targets)
        per = (deadline - time.monotonic()) / slots - 1.0  # 1 s per run: checks, forks, /proc reads
        duration = a.duration or max(1.0, min(10.0, per - a.warmup))
        say(f"part a: {slots} runs of {a.warmup:.1f} s warm-up + {duration:.1f} s")
        for case in cases:
            body_file = pathlib.Path(tmp) / f"{case.name}.json"
            body_file.write_bytes(dp.make_body(case.body_bytes, case.stream))
            lua = pathlib.Path(tmp) / f"{case.name}.lua"
            lua.write_text(case.lua())
            for name, t in targets.items():
                if time.monotonic() + a.warmup + duration + 1.0 > deadline:
                    skipped.append(f"{case.name} {name}")
                    continue
                dp.check_answer(name, t, case)
                loadgen.drive(t.url, case, body_file, lua, a.warmup)
                run = dp.measure(case, name, t, 0, (body_file, lua), duration, idle.get(name, 0.0), loadgen)
                runs.append(run)
                say(
                    f"{case.name:10} {name:14} {run.rps:8.0f} req/s  p50 {run.p50_ms:7.2f} ms  "
                    f"cpu {run.cpu_ms_per_req:6.3f} ms/req  envoy {run.envoy_cpu_ms_per_req:6.3f}  errors {run.errors}"
                )
    if skipped:
        say(f"part a: out of budget, skipped {', '.join(skipped)}")
    return {
        "routers": routers,
        "cases": list(CASES),
        "cores": asdict(layout),
        "cores_note": layout.note,
        "envoy_concurrency": layout.envoy_concurrency,
        "loadgen": loadgen.kind,
        "duration_s": duration,
        "warmup_s": a.warmup,
        "idle_cpu_s_per_s": idle,
        "runs": [asdict(r) for r in runs],
        "skipped": skipped,
    }


def table(runs: list[dict[str, Any]]) -> str:
    """Part a's table: one row per case and router."""
    lines = [
        "| case | router | req/s | p50 ms | p99 ms | router CPU ms/req | Envoy CPU ms/req | router cores busy | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        busy = r["cpu_ms_per_req"] * r["rps"] / 1e3
        router = "–" if r["router"] == "direct" else f"{r['cpu_ms_per_req']:.3f}"
        envoy = f"{r['envoy_cpu_ms_per_req']:.3f}" if r["envoy_cpu_ms_per_req"] else "–"
        lines.append(
            f"| {r['case']} | {r['router']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{router} | {envoy} | {'–' if r['router'] == 'direct' else f'{busy:.2f}'} | {r['errors']} |"
        )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    model = ""
    with open("/proc/cpuinfo") as fh:
        model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    gpus = ""
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        gpus = done.stdout.strip()
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpus": gpus,
        "wrk": shutil.which("wrk") or "",
    }


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    out = [
        f"# bench.device ({'dry run' if doc['dry_run'] else 'full run'}, kits: {', '.join(doc['kits'])})",
        "",
        f"`{doc['command']}` — {m['cpus']} CPUs ({m['cpu_model']}), Python {m['python']}"
        + (f", {m['gpus']}" if m["gpus"] else "")
        + f"; {doc['seconds']:.0f} s in all.",
        "",
    ]
    a = doc["parts"].get("a")
    if a is not None:
        out += ["## a: scale-out", ""]
        if "error" in a:
            out += [f"Failed: {a['error']}", ""]
        else:
            out += [
                f"Cores: {a['cores_note']}. Envoy `--concurrency {a['envoy_concurrency']}`; load generator "
                f"{a['loadgen']}; one run of {a['warmup_s']:.1f} s warm-up + {a['duration_s']:.1f} s per case and "
                "router. Router CPU is every process of the router (all picker workers, all 3 pickers); "
                "cores busy = router CPU ms/req × req/s / 1000.",
                "",
                table(a["runs"]),
                "",
            ]
            if a["skipped"]:
                out += [f"Skipped (out of budget): {', '.join(a['skipped'])}.", ""]
    b = doc["parts"].get("b")
    if b is not None:
        out += ["## b: GPU profile", "", f"Status: {b['status']} ({b.get('seconds', 0):.0f} s)."]
        if b.get("note"):
            out.append(f"Note: {b['note']}.")
        result = b.get("result")
        if isinstance(result, dict):
            out += ["", "| key | value |", "|---|---|"]
            out += [f"| {k} | {v} |" for k, v in result.items() if isinstance(v, str | int | float | bool)]
        out.append("")
    return "\n".join(out)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.device",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dry-run", action="store_true", help="reduced scale: workers 1,2, short runs, 150 s budget"
    )
    p.add_argument("--kit", default="auto", choices=("auto", "all", *KITS))
    p.add_argument("--parts", default="", help="a, b or a,b (default: a,b with the picker kit, else a)")
    p.add_argument(
        "--out", default=os.environ.get("OUT", ""), help="default $OUT, else bench/results/raw/device-*"
    )
    p.add_argument("--budget", type=float, default=0.0, help="seconds in all (default 450; dry 150)")
    p.add_argument("--budget-b", type=float, default=0.0, help="seconds for part b (default 180; dry 40)")
    p.add_argument("--workers", default="", help="picker --workers values (default 1,2,4,8; dry 1,2)")
    p.add_argument(
        "--duration", type=float, default=0.0, help="seconds per run (default: fit the budget; dry 1.5)"
    )
    p.add_argument(
        "--warmup", type=float, default=0.0, help="seconds of warm-up per run (default 1; dry 0.5)"
    )
    p.add_argument("--idle", type=float, default=0.0, help="seconds to measure idle CPU (default 3; dry 1)")
    p.add_argument("--settle", type=float, default=0.0, help="seconds after start-up (default 3; dry 1)")
    p.add_argument("--loadgen", choices=("auto", "python"), default="auto")
    p.add_argument("--gpu-profile-child", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    dry = a.dry_run
    a.budget = a.budget or (150.0 if dry else 450.0)
    a.budget_b = a.budget_b or (40.0 if dry else 180.0)
    a.workers = a.workers or ("1,2" if dry else "1,2,4,8")
    a.duration = a.duration or (1.5 if dry else 0.0)
    a.warmup = a.warmup or (0.5 if dry else 1.0)
    a.idle = a.idle or (1.0 if dry else 3.0)
    a.settle = a.settle or (1.0 if dry else 3.0)
    return a


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.gpu_profile_child:
        return gpu_profile_child(pathlib.Path(a.gpu_profile_child), a.dry_run, a.budget_b)
    kits = choose_kits(a.kit)
    if not kits:
        say("no kit packed (make device-pack) and none installed")
        return 2
    say(f"kits {', '.join(kits)}; budget {a.budget:.0f} s")
    ensure_env(kits, argv)
    parts = a.parts.split(",") if a.parts else (["b", "a"] if "picker" in kits else ["a"])
    out = pathlib.Path(a.out or ROOT / "bench" / "results" / "raw" / time.strftime("device-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.budget - (time.time() - T0)
    doc: dict[str, Any] = {
        "command": "python -m bench.device " + " ".join(argv),
        "dry_run": a.dry_run,
        "kits": kits,
        "machine": machine(),
        "parts": {},
    }
    if "b" in parts:
        doc["parts"]["b"] = part_b(out, a.dry_run, min(a.budget_b, deadline - time.monotonic() - 30))
        say(f"part b: {doc['parts']['b']['status']}")
    if "a" in parts:
        try:
            doc["parts"]["a"] = part_a(a, kits, out, deadline - 15)
        except Exception as exc:  # one part's failure still writes the other's results
            doc["parts"]["a"] = {"error": f"{exc.__class__.__name__}: {exc}"[:3000]}
            say(f"part a failed: {exc}")
    doc["seconds"] = round(time.time() - T0, 1)
    (out / "device.json").write_text(json.dumps(doc, indent=1, default=str))
    md = markdown(doc)
    (out / "device.md").write_text(md)
    print(md)
    say(f"wrote {out / 'device.json'} and {out / 'device.md'}")
    return 0 if "error" not in doc["parts"].get("a", {}) else 1


if __name__ == "__main__":
    raise SystemExit(main())

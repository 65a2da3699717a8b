"""Which packages a build of kvpick holds; everything else is in pyproject.toml.

``KVPICK_PACKAGES`` names the top-level packages to include, comma-separated (default: all of
:data:`PACKAGES`). The picker-only install and the picker image set ``picker,proto``: the
picker's code and nothing that runs beside a model server, benchmarks or launches processes.
"""

from __future__ import annotations

import os

from setuptools import find_packages, setup

PACKAGES = ("picker", "proto", "replica", "bench", "kvlaunch")


def chosen(value: str | None) -> list[str]:
    names = [n.strip() for n in (value or ",".join(PACKAGES)).split(",") if n.strip()]
    unknown = sorted(set(names) - set(PACKAGES))
    if unknown or not names:
        raise SystemExit(f"KVPICK_PACKAGES={value!r}: choose from {','.join(PACKAGES)} ({unknown} unknown)")
    return names


setup(
    packages=find_packages(
        include=[p for n in chosen(os.environ.get("KVPICK_PACKAGES")) for p in (n, f"{n}.*")]
    )
)

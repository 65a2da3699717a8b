#!/usr/bin/env python3
"""Print kvpick's requirements (``project.dependencies`` plus the named extras) from pyproject.toml.

Image builds install these in a layer of their own before the sources are copied, so editing the
sources reruns only ``pip install --no-deps`` of kvpick itself, not the dependency install.
Usage: ``requirements.py PYPROJECT [EXTRA[,EXTRA...]]``; an unknown extra is an error.
"""

from __future__ import annotations

import sys
import tomllib


def requirements(pyproject: str, extras: str) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    optional = project.get("optional-dependencies", {})
    for extra in filter(None, extras.split(",")):
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r} (pyproject.toml has {sorted(optional)})")
        reqs += optional[extra]
    return reqs


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")))

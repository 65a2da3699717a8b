"""The repository is self-contained: the studies' default trace is the copy under ``bench/data``
(resolved from the module file, not the working directory), and no tracked file names a path in
the machine's shared folder."""

from __future__ import annotations

import hashlib
import pathlib
import subprocess

import pytest

from bench import mooncake_trace, suites

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRACE_SHA256 = "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"


OUTSIDE = (".." + "/shared/", "/work" + "/shared", "DESIGN" + " §")
"""Paths outside the repository, and the old design document's citations (spelled in pieces so
this file does not hold them)."""


def test_default_trace_is_the_mooncake_copy_in_the_repository() -> None:
    path = mooncake_trace.DEFAULT_TRACE
    assert path.is_absolute() and path.is_relative_to(ROOT / "bench" / "data")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == TRACE_SHA256, "bench/data/README.md"
    rows = mooncake_trace.read(str(path))
    assert len(rows) == 3993 and rows[0].hash_ids[:3] == (0, 1, 2)
    assert path == suites.DEFAULT_TRACE


def test_no_tracked_file_points_into_the_shared_folder() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    found = subprocess.run(
        [
            "git",
            "grep",
            "-n",
            "-I",
            "-F",
            "-e",
            OUTSIDE[0],
            "-e",
            OUTSIDE[1],
            "-e",
            OUTSIDE[2],
            "--",
            ".",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode == 1, f"paths outside the repository:\n{found.stdout}"

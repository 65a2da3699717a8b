"""The README names every flag ``python -m picker`` takes and every metric the picker exports."""

from __future__ import annotations

import argparse
import fnmatch
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from picker.__main__ import build_parser
from picker.serving.telemetry import Telemetry

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def _readme_flags() -> tuple[set[str], list[str]]:
    """Flags written out in the README, and its wildcards such as ``--zap-*``."""
    named = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)(?![\w*-])", README))
    wildcards = re.findall(r"(?<![\w-])(--[a-z0-9*-]*\*[a-z0-9*-]*)", README)
    return named, wildcards


def test_every_picker_flag_is_in_the_readme() -> None:
    named, wildcards = _readme_flags()
    flags = {
        opt
        for action in build_parser()._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help" and action.help != argparse.SUPPRESS
    }
    assert flags, "build_parser() gave no flags"
    missing = sorted(f for f in flags if f not in named and not any(fnmatch.fnmatch(f, w) for w in wildcards))
    assert not missing, f"README.md does not name these picker flags: {missing}"


def test_every_exported_metric_is_in_the_readme() -> None:
    registry = CollectorRegistry()
    Telemetry(registry=registry)
    names = {metric.name for metric in registry.collect()}
    assert any(n.startswith("kvpick_") for n in names), names
    missing = sorted(n for n in names if n not in README)
    assert not missing, f"README.md does not name these metrics: {missing}"

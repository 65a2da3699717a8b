"""The docs: generated reference pages current, a short README, and no broken relative link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from picker import docgen

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT = 8192
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_reference_pages_are_current() -> None:
    for rel, text in docgen.pages().items():
        path = ROOT / rel
        assert path.exists(), f"{rel} is missing: run `make docs`"
        assert path.read_text(encoding="utf-8") == text, f"{rel} is stale: run `make docs`"


def test_every_flag_and_metric_is_in_the_reference() -> None:
    from prometheus_client import CollectorRegistry

    from picker.__main__ import build_parser
    from picker.serving.telemetry import Telemetry

    page = docgen.configuration_page()
    flags = {
        o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"
    }
    assert flags and not sorted(f for f in flags if f"`{f}`" not in page)
    registry = CollectorRegistry()
    Telemetry(registry=registry)
    metrics = docgen.metrics_page()
    assert not sorted(m.name for m in registry.collect() if f"`{m.name}" not in metrics)


def test_field_docstrings_are_read() -> None:
    from picker.core.config import ScrapeConfig

    docs = docgen.field_docs(ScrapeConfig)
    assert docs["unreachable_after"].startswith("Consecutive failed scrapes")


def test_readme_is_short() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move detail to docs/"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code blocks are not links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_no_link_leaves_the_repository() -> None:
    for page in _pages():
        outside = ".." + "/shared" in page.read_text(encoding="utf-8")  # in pieces: not in this file either
        assert not outside, f"{page.relative_to(ROOT)} points outside the repository (a shared folder)"

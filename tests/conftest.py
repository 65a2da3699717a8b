from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from kvlaunch import Stack, stack


@pytest.fixture
def envoy_stack(tmp_path: pathlib.Path) -> Iterator[Stack]:
    """Two upstreams, the picker (TLS, cost policy) and Envoy (ORIGINAL_DST, fail-close)."""
    with stack(tmp_path, n=2) as st:
        yield st

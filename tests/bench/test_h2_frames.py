"""``bench.h2_frames`` through the real Envoy: its default HTTP/2 codec (nghttp2) sends an
ext_proc server 16 KiB DATA frames whatever the server advertises, and oghttp2 follows a larger
``SETTINGS_MAX_FRAME_SIZE`` (the evidence behind bench/results/2026-11-28-extproc-floor.md)."""

from __future__ import annotations

import re

import pytest

from bench import h2_frames

pytestmark = pytest.mark.timeout(240)


def test_envoy_data_frames_per_codec_and_max_frame_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert h2_frames.main(["--size", str(200 * 1024), "--requests", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    largest = {}
    for line in lines:
        m = re.match(
            r"(\w+), SETTINGS_MAX_FRAME_SIZE (\d+): (\d+)/(\d+) answered 200; .*largest frame (\d+) B", line
        )
        assert m, line
        assert m[3] == m[4], line
        largest[(m[1], int(m[2]))] = int(m[5])
    assert largest[("nghttp2", 1 << 14)] == largest[("nghttp2", (1 << 24) - 1)] == 16384
    assert largest[("oghttp2", 1 << 14)] == 16384
    assert largest[("oghttp2", (1 << 24) - 1)] > 16384

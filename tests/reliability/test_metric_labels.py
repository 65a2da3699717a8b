"""Client-chosen model names never grow the picker's ``/metrics`` without bound: a name becomes
a label value only when it is configured or a replica serves it, else "other"; known names are cut
to 128 characters with control characters replaced. Through a real Envoy and picker: 1 MiB,
NUL-laden and hundreds of distinct model names add less than 64 KB to ``/metrics``."""

from __future__ import annotations

import pathlib

import pytest

from kvlaunch import http, post_json, stack

pytestmark = [pytest.mark.reliability, pytest.mark.envoy]


def _metrics(port: int) -> bytes:
    status, body, _ = http("GET", f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    return body


def test_client_model_names_do_not_grow_metrics(tmp_path: pathlib.Path) -> None:
    with stack(tmp_path) as st:  # the fake replicas report model_name="m"
        for _ in range(3):
            assert post_json(st.url + "/v1/completions", {"model": "m", "prompt": "p"})[0] == 200
        before = _metrics(st.metrics_port)
        assert b'model_name="m",target_model_name="m"' in before, "a served model is its own label"
        names = ["x" * (1 << 20), "evil\x00name\x00" * 1000, "\x00", "a\nb\r\x1b[31m", "m\x00"]
        names += [f"client-model-{i}" for i in range(300)]
        for name in names:
            status, body = post_json(st.url + "/v1/completions", {"model": name, "prompt": "p"})
            assert status == 200, (name[:40], body)
        st.wait_in_flight_zero()
        after = _metrics(st.metrics_port)
        assert len(after) - len(before) < 64 * 1024, (len(before), len(after))
        assert b"\x00" not in after and b"xxxxxxxxxx" not in after and b"client-model-" not in after
        assert b'model_name="other",target_model_name="other"} 305.0' in after, after[-2000:]

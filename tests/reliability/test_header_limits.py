"""A client with many headers gets a clean JSON 431 or its answer, never a 5xx, in every shipped
Envoy config. Envoy's connection manager limit (max_headers_count) also bounds the request after
ext_proc's header mutation, which Envoy refused with a 500 when the picker's destination header
pushed a request just under the limit past it (88-95 client headers); render.py's header check
answers 431 before ext_proc past 100 headers or 60 KiB, far under Envoy's own limits (1,000
headers, 96 KiB), which leave room for the picker's mutation."""

from __future__ import annotations

import json
import pathlib
import time

import pytest

from kvlaunch import Procs, Stack, envoy_configs, free_port, http, post_json
from kvlaunch.envoy_configs import ALL

pytestmark = [pytest.mark.reliability, pytest.mark.envoy]
COUNTS = [0, 80, 85, 88, 90, 92, 95, 98, 100, 110, 116, 120, 200, 900]
KIB = [50, 59, 61, 70, 90]
"""Headers of 1 KiB each: past 60 KiB of headers a JSON 431 too (Envoy's own limit is 96 KiB)."""


def _post(url: str, n: int, size: int = 1) -> tuple[int, bytes, dict[str, str]]:
    headers = {f"x-client-{i}": "v" * size for i in range(n)}
    body = json.dumps({"model": "m", "prompt": "p"}).encode()
    return http("POST", url + "/v1/completions", body, headers)


@pytest.mark.parametrize("name", ALL)
def test_many_headers_get_431_or_success_never_5xx(name: str, tmp_path: pathlib.Path) -> None:
    st = Stack(Procs(tmp_path), [free_port(), free_port()])
    try:
        st.start_upstreams()
        st.start_picker(*(("--fallbacks", "1") if name == "envoy-fallback.yaml" else ()))
        envoy_configs.start_envoy(st, name)
        deadline = time.monotonic() + 20
        while post_json(st.url + "/v1/completions", {"model": "m", "prompt": "w"})[0] != 200:
            assert time.monotonic() < deadline, st.procs.log("envoy")
            time.sleep(0.2)
        statuses: dict[str, int] = {}
        for n, size in [(n, 1) for n in COUNTS] + [(k, 1000) for k in KIB]:
            try:
                status, body, headers = _post(st.url, n, size)
            except OSError as err:  # a reset is not an answer either
                raise AssertionError(f"{n} headers: connection failed: {err}") from err
            statuses[f"{n}x{size}B"] = status
            assert status == 200 or status == 431, (n, status, body, st.procs.log("envoy")[-2000:])
            if status == 431:
                assert headers.get("content-type") == "application/json", (n, headers)
                assert json.loads(body)["error"]["code"] == 431, (n, body)
        assert statuses["0x1B"] == statuses["80x1B"] == statuses["50x1000B"] == 200, statuses
        assert statuses["120x1B"] == statuses["900x1B"] == statuses["61x1000B"] == 431, statuses
        print(name, statuses)
    finally:
        st.procs.stop()

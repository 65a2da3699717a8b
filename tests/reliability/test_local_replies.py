"""Envoy's local replies to requests ext_proc never saw open no picker stream (issue 23 item 4).

Envoy runs every local reply through ext_proc's encode path, including a 408 for a body the buffer
filter still held, the header check's 431 and the allowlist's 404. With the response path SEND in
the filter's config, each opened a picker stream for the response headers alone; under a burst of
408s a few of those ended CANCELLED and fail-close made them 500s. The rendered configs now SKIP
the response path unless the picker's answer to the request headers turns it on for a request it
routed (``--response-headers always``, or fallbacks). Through a real Envoy and the picker: the
picker's own message counters do not move while Envoy answers 404, 431 and 408 locally, and a
routed request (buffered, and chunked on the streamed route) still sends its response headers
where the picker asks for them.
"""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest

from bench.reliability import slowbody
from kvlaunch import http, post_json, stack
from tests.support.metrics import extproc_messages

pytestmark = [pytest.mark.reliability, pytest.mark.envoy]


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        k: after.get(k, 0) - before.get(k, 0)
        for k in after.keys() | before.keys()
        if after.get(k, 0) != before.get(k, 0)
    }


@pytest.mark.parametrize("response_headers", ["when-needed", "always"])
def test_local_replies_open_no_picker_stream(response_headers: str, tmp_path: pathlib.Path) -> None:
    with stack(
        tmp_path, picker_args=("--response-headers", response_headers), envoy_args=("--request-timeout", "1s")
    ) as st:
        before = extproc_messages(st)
        status, body, _ = http("POST", st.url + "/reset_prefix_cache", b"{}")
        assert status == 404, body
        many = {f"x-client-{i}": "v" for i in range(120)}
        status, body, _ = http("POST", st.url + "/v1/completions", b'{"model":"m","prompt":"p"}', many)
        assert status == 431, body
        slow = asyncio.run(slowbody.flood(st.envoy_port, 20, normal=0, hold_s=10, ramp_per_s=200))
        assert dict(slow.slow) == {408: 20}, slow.summary()
        assert _delta(before, extproc_messages(st)) == {}, "a local reply reached the picker"

        # Routed requests keep their response path where the picker asks for it.
        sent = 1 if response_headers == "always" else 0
        before = extproc_messages(st)
        status, doc = post_json(st.url + "/v1/completions", {"model": "m", "prompt": "buffered"})
        assert status == 200, doc
        got = _delta(before, extproc_messages(st))
        assert got.get("request_headers") == 1 and got.get("response_headers", 0) == sent, got
        before = extproc_messages(st)
        status, raw = slowbody.post_chunked(
            st.envoy_port, json.dumps({"model": "m", "prompt": "chunked"}).encode()
        )
        assert status == 200, raw
        got = _delta(before, extproc_messages(st))
        assert got.get("request_headers") == 1 and got.get("response_headers") == 1, got

"""Slow or stalled clients cannot exhaust the picker (issue 23 item 4). Through a real Envoy in
each shipped config, the picker and simulated replicas: 400 clients send their headers and then
trickle the body (300 with a content-length, 100 chunked) while normal requests flow. Every slow
client gets Envoy's JSON 408 once the request timeout (3 s here) passes, and every normal request
succeeds. The picker's stream cap is 200 here: a slow client that held a picker stream while it
trickled (the content-length ones did, before the buffer filter) would fill it and fail the
normal requests. Chunked slow bodies hold a picker stream until the timeout, on the streamed routes' own picker
cluster, whose cap (a quarter of ``--picker-streams``) they fill without touching the buffered
routes'. The full 5,000-client flood is ``python -m bench.reliability slowbody``."""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest

from bench.reliability import slowbody
from kvlaunch import Procs, http, stack
from kvlaunch.envoy_configs import SHIPPED

pytestmark = [pytest.mark.reliability, pytest.mark.envoy]


async def _floods(port: int) -> tuple[slowbody.Outcome, slowbody.Outcome]:
    sized, chunked = await asyncio.gather(
        slowbody.flood(port, 300, normal=4, hold_s=20, ramp_per_s=400),
        slowbody.flood(port, 100, normal=0, hold_s=20, chunked=True, ramp_per_s=200),
    )
    return sized, chunked


@pytest.mark.parametrize("name", list(SHIPPED))
def test_slow_bodies_get_408_and_normal_requests_succeed(name: str, tmp_path: pathlib.Path) -> None:
    procs = Procs(tmp_path)
    try:
        st = slowbody.start_stack(
            procs, 2, ("--request-timeout", "3s"), ("--max-concurrent-streams", "200"), shipped=name
        )
        sized, chunked = asyncio.run(_floods(st.envoy_port))
        counts = slowbody.envoy_stats(st.admin_port, ("kvpick.downstream_rq_timeout",))
    finally:
        procs.stop()
    for out, n in ((sized, 300), (chunked, 100)):
        assert out.connected == n, out.summary()
        assert dict(out.slow) == {408: n}, out.summary()
        err = json.loads(out.slow_bodies[0])["error"]
        assert err["type"] == "request_timeout" and err["code"] == 408, out.slow_bodies[0]
    normal = sized.summary()
    assert normal["normal_sent"] >= 20 and set(sized.normal) == {200}, normal
    assert counts == {"http.kvpick.downstream_rq_timeout": 400}, counts


def test_the_request_timeout_ends_at_the_request(tmp_path: pathlib.Path) -> None:
    """Envoy disarms the request timeout once the request is whole: a response streamed for longer
    (3 s of SSE against a 1 s timeout) arrives complete, through the buffered and the streamed
    (chunked) routes alike."""
    with stack(tmp_path, envoy_args=("--request-timeout", "1s")) as st:
        doc = {"model": "m", "prompt": "p", "stream": True, "chunks": 15, "delay": 0.2}
        status, body, _ = http("POST", st.url + "/v1/completions", json.dumps(doc).encode())
        assert status == 200 and body.endswith(b"data: [DONE]\n\n") and body.count(b"data:") == 16, body
        status, body = slowbody.post_chunked(st.envoy_port, json.dumps(doc).encode())
        assert status == 200 and body.endswith(b"data: [DONE]\n\n") and body.count(b"data:") == 16, body


def test_a_chunked_flood_fills_only_the_streamed_routes_picker_streams(tmp_path: pathlib.Path) -> None:
    """300 slow chunked clients against ``--picker-streams 200`` (streamed routes: 50): 50 hold a
    stream until their 408, the rest are refused at once (ext_proc's fail-close 503, as with the picker down),
    and the normal (buffered) requests all succeed. With one cap for both, the 300 would hold all
    200 and fail every normal request."""
    procs = Procs(tmp_path)
    try:
        st = slowbody.start_stack(
            procs,
            2,
            ("--request-timeout", "3s", "--picker-streams", "200"),
            ("--max-concurrent-streams", "400"),
        )
        out = asyncio.run(
            slowbody.flood(st.envoy_port, 300, normal=4, hold_s=20, chunked=True, ramp_per_s=600)
        )
        counts = slowbody.envoy_stats(st.admin_port, ("kvpick_picker_streamed.upstream_rq_503",))
    finally:
        procs.stop()
    summary = out.summary()
    assert set(out.slow) <= {408, 503} and out.slow[408] >= 40 and out.slow[503] >= 200, summary
    assert sum(counts.values()) >= 200, counts
    assert summary["normal_sent"] >= 20 and set(out.normal) == {200}, summary

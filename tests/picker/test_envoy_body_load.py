"""Every body shape counts as load from the moment it is routed (issue 23): through a real Envoy
with the default rendered config and simulated replicas, a long prompt sent chunked (no
content-length, under 1 MiB) or with a content-length of at least 1 MiB (both take the
FULL_DUPLEX_STREAMED route twins) stays in flight on its replica while it prefills, the TTFT
estimates show it, and small requests sent beside it go to the other replicas."""

from __future__ import annotations

import pathlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest

from bench.body_load import WORDS, long_body, post_raw, start_stack
from kvlaunch import Procs, Stack, http, post_json

pytestmark = pytest.mark.envoy


def _explain(st: Stack, doc: dict[str, Any]) -> dict[str, Any]:
    url = f"http://127.0.0.1:{st.debug_port}/debug/explain?path=/v1/completions"
    _, body, _ = http("POST", url, orjson.dumps(doc), st.debug_headers)
    return dict(orjson.loads(body))


@pytest.mark.parametrize(
    ("chunked", "size", "time_scale"),
    [(True, 600_000, 0.4), (False, 1_100_000, 0.15)],
    ids=["chunked-150k-tokens", "content-length-over-1MiB"],
)
def test_a_long_streamed_prompt_is_load_while_it_prefills_and_small_requests_route_around_it(
    tmp_path: pathlib.Path, chunked: bool, size: int, time_scale: float
) -> None:
    """Each long prompt's prefill lasts several seconds on the simulator (``time_scale``); before
    the fix the picker ended its accounting as soon as it was routed."""
    procs = Procs(tmp_path)
    try:
        st = start_stack(procs, 3, time_scale)
        st.wait_in_flight_zero()
        long: dict[str, Any] = {}
        sender = threading.Thread(target=post_raw, args=(st.envoy_port, long_body(size), chunked, long))
        sender.start()
        deadline = time.monotonic() + 10
        busy: list[str] = []
        while not busy and time.monotonic() < deadline:
            eps = st.endpoints()
            busy = [
                k for k, e in eps.items() if e["in_flight_requests"] == 1 and e["in_flight_tokens"] > 100_000
            ]
            time.sleep(0.1)
        assert busy, f"the long prompt never showed in flight: {st.endpoints()}"
        [hot] = busy
        time.sleep(1.0)  # well into its prefill, and past a scrape or two of the replicas
        eps = st.endpoints()
        assert eps[hot]["in_flight_requests"] == 1 and eps[hot]["pending_prefill_tokens"] > 100_000, eps
        ttft = {
            k: e["ttft_estimate_s"]
            for k, e in _explain(st, {"model": "m", "prompt": "hi"})["endpoints"].items()
        }
        assert ttft[hot] > 1.0 and all(v < ttft[hot] / 10 for k, v in ttft.items() if k != hot), ttft

        sent_before = {k: e["sent_total"] for k, e in eps.items()}
        docs = [{"model": "m", "prompt": f"small request {i} " + WORDS, "max_tokens": 4} for i in range(8)]

        def small(doc: dict[str, Any]) -> tuple[int, float]:
            start = time.monotonic()
            status, _ = post_json(st.url + "/v1/completions", doc)
            return status, time.monotonic() - start

        with ThreadPoolExecutor(4) as pool:
            smalls = list(pool.map(small, docs))
        assert all(status == 200 for status, _ in smalls), smalls
        eps = st.endpoints()
        sent = {k: eps[k]["sent_total"] - sent_before[k] for k in eps}
        assert sent[hot] == 0 and sum(sent.values()) == len(docs), f"small requests per replica: {sent}"
        assert eps[hot]["in_flight_requests"] == 1, "the long prompt finished before the small ones"
        slowest = max(s for _, s in smalls)
        sender.join(60)
        assert long.get("status") == 200, long
        assert slowest < long["seconds"] / 3, f"small requests waited: slowest {slowest:.2f} s, long {long}"
        st.wait_in_flight_zero()
    finally:
        procs.stop()

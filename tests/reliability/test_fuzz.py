"""A seeded fuzz subset (2,000 generated request bodies and header sets plus the edge corpus)
through a real Envoy and the picker: every answer is an upstream's 2xx or a 4xx with the JSON error
body; no 5xx, no picker crash, and every in-flight counter back at 0. The long variant (100,000):
``python -m bench.reliability fuzz``."""

from __future__ import annotations

import asyncio
import pathlib
import time

import pytest

from bench.reliability import checks, fuzz
from kvlaunch import stack

pytestmark = [pytest.mark.reliability, pytest.mark.envoy]
SEED, N = 20261123, 2000


def test_fuzzed_requests_get_an_upstream_answer_or_a_json_4xx(tmp_path: pathlib.Path) -> None:
    todo = fuzz.edge_cases(oversize=2) + fuzz.generate(N, SEED)
    with stack(tmp_path, n=2) as st:
        start = time.monotonic()
        tally = asyncio.run(fuzz.send_all(st.url, todo, set(st.upstreams), concurrency=64))
        took = time.monotonic() - start
        assert tally.sent == len(todo) >= N
        assert tally.failed == 0, "\n".join(tally.failures)
        assert tally.classes["ok_2xx"] > N // 10 and tally.classes["reject_400"] > N // 10, tally.classes
        assert tally.classes["reject_413"] >= 2, tally.classes
        proc = next(p for n, p in st.procs.procs if n == "picker")
        assert proc.poll() is None, "the picker died"
        assert not checks.crash_lines(st.procs.log("picker")), st.procs.log("picker")[-3000:]
        checks.wait_in_flight_zero(st.metrics_port)
        print(f"fuzz: {tally.sent} requests in {took:.1f} s: {dict(tally.classes)}")

"""Faults under load through a real Envoy (short variants; figures with repeats come from
``python -m bench.reliability faults`` into docs/reliability.md). Bounds are loose: the machine is
shared, and the figures, not these bounds, are what the docs report."""

from __future__ import annotations

import math
import pathlib
import signal

import pytest

from bench.reliability import faults

pytestmark = [pytest.mark.reliability, pytest.mark.envoy]


async def test_replica_sigkill(tmp_path: pathlib.Path) -> None:
    got = await faults.replica_fault(tmp_path, signal.SIGKILL, hold=3.0)
    assert got["last_new_request_s"] < 2.5, got  # 3 refused scrapes 0.2 s apart, plus slack
    assert got["failed"] == got["new_requests_failed"] + got["in_flight_failed"], got
    assert got["in_flight_after"] == {k: 0.0 for k in got["in_flight_after"]}


async def test_replica_sigstop(tmp_path: pathlib.Path) -> None:
    got = await faults.replica_fault(tmp_path, signal.SIGSTOP, hold=5.0)
    assert got["last_new_request_s"] < 4.5, got  # scrape timeout 1 s, 3 failures
    assert got["failed"] == 0, got  # frozen, not dead: SIGCONT lets its streams finish
    assert got["in_flight_after"] == {k: 0.0 for k in got["in_flight_after"]}


async def test_picker_sigkill_fail_open(tmp_path: pathlib.Path) -> None:
    got = await faults.picker_kill(tmp_path, "open")
    assert got["during_outage_failed"] == 0 and got["during_outage_served_unpicked"] > 0, got
    assert got["in_flight_failed"] == 0, got  # response body NONE: the picker is off the stream
    assert got["after_restart_failed"] == 0 and got["recovery_s"] < 10, got


async def test_picker_sigkill_fail_close(tmp_path: pathlib.Path) -> None:
    got = await faults.picker_kill(tmp_path, "close")
    assert got["during_outage"] == got["during_outage_failed"] > 0, got  # as configured: reject
    assert got["during_outage_served_unpicked"] == 0, got
    assert not math.isnan(got["recovery_s"]) and got["recovery_s"] < 10, got


async def test_picker_sigterm_mid_stream_cuts_nothing(tmp_path: pathlib.Path) -> None:
    got = await faults.picker_drain(tmp_path, streams=16, length=4.0)
    assert got["cut"] == 0, got
    assert got["picker_exit_code"] == 0 and got["last_stream_end_s"] <= got["picker_exit_s"] < 30, got


async def test_kube_api_410_and_dropped_watches_lose_no_endpoint(tmp_path: pathlib.Path) -> None:
    got = await faults.kube_watch_faults(tmp_path, hold=2.0)
    assert got["failed"] == 0 and got["min_ready_pods"] == 2 and got["replicas_serving"] == 2, got
    assert got["watches_dropped"] >= 1 and got["relists"] >= 2, got

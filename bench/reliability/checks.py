"""What the reliability runs read back from the picker: in-flight gauges, liveness, its log."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

IN_FLIGHT = ("kvpick_endpoint_in_flight_requests", "kvpick_endpoint_in_flight_tokens")


def in_flight(metrics_port: int) -> dict[str, float]:
    """Sum over endpoints of each in-flight gauge, read from the picker's public /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(IN_FLIGHT, 0.0)
    for fam in text_string_to_metric_families(text):
        if fam.name in out:
            out[fam.name] = sum(s.value for s in fam.samples)
    return out


def wait_in_flight_zero(metrics_port: int, timeout: float = 15.0) -> dict[str, float]:
    """The in-flight gauges once they are all 0; raises AssertionError with the last values."""
    deadline = time.monotonic() + timeout
    while True:
        got = in_flight(metrics_port)
        if not any(got.values()):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"in-flight counters stuck above zero: {got}")
        time.sleep(0.2)


def crash_lines(log: str) -> list[str]:
    """Lines of a picker log that say it crashed or hit an unexpected error."""
    return [line for line in log.splitlines() if "Traceback" in line or "unexpected error" in line]

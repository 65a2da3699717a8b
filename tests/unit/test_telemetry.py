"""The picker's own metrics: per-endpoint series leave with their endpoint."""

from __future__ import annotations

from prometheus_client import generate_latest

from picker.serving.telemetry import Telemetry

GONE, KEPT = "10.0.0.1:8000", "10.0.0.2:8000"


def test_forget_drops_every_series_of_the_departed_endpoint() -> None:
    t = Telemetry()
    for key in (GONE, KEPT):
        t.in_flight.labels(key).set(1)
        t.in_flight_tokens.labels(key).set(10)
        t.scrape_errors.labels(key, "ClientConnectorError").inc()
    t.scrape_errors.labels(GONE, "TimeoutError").inc()
    t.forget(GONE)
    text = generate_latest(t.registry).decode()
    assert GONE not in text, "no series (in-flight, tokens, scrape errors of any reason) outlives it"
    labels = {"endpoint": KEPT, "reason": "ClientConnectorError"}
    assert t.registry.get_sample_value("kvpick_scrape_errors_total", labels) == 1
    assert t.registry.get_sample_value("kvpick_endpoint_in_flight_requests", {"endpoint": KEPT}) == 1
    t.forget(GONE)  # idempotent

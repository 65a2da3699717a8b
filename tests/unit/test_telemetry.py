"""The picker's own metrics: per-endpoint series leave with their endpoint; the per-request ones,
counted in plain numbers, expose what prometheus_client would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from picker.serving.tally import Tally
from picker.serving.telemetry import MAX_LABEL_CHARS, OTHER, Telemetry

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


def _samples(registry: CollectorRegistry) -> list[tuple[str, list[tuple[str, str]], float]]:
    """Every sample but the ``_created`` timestamps, in a stable order."""
    return sorted(
        (s.name, sorted(s.labels.items()), s.value)
        for m in registry.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    )


def test_tally_exposes_what_prometheus_client_would() -> None:
    """Counts kept in plain numbers give the samples prometheus_client's own classes give for the
    same observations: ``le`` inclusive and cumulative, ``+Inf``, ``_sum``, ``_count``, ``_total``."""
    bounds = (0.0, 0.1, 0.25, 1.0)
    values = [0.0, 0.1, 0.1000001, 0.2, 0.25, 0.99, 1.0, 3.5, -1.0]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    tally = Tally()
    hist = tally.histogram("h_seconds", "doc", bounds, ["a"])
    count = tally.counter("c", "doc", ["a", "b"])
    plain = tally.histogram("p", "doc", bounds)
    ours.register(tally)
    ref_hist = Histogram("h_seconds", "doc", ["a"], buckets=bounds, registry=theirs)
    ref_count = Counter("c", "doc", ["a", "b"], registry=theirs)
    Histogram("p", "doc", buckets=bounds, registry=theirs)  # no observation: all zero, as ours
    for v in values:
        hist.labels("x").observe(v)
        ref_hist.labels("x").observe(v)
    count.labels("x", "y").inc()
    count.labels("x", "y").inc(2)
    ref_count.labels("x", "y").inc(3)
    assert plain.labels().counts == [0] * (len(bounds) + 1)
    assert _samples(ours) == _samples(theirs)
    assert {m.name: m.type for m in ours.collect()} == {m.name: m.type for m in theirs.collect()}


def test_model_labels_are_known_names_cut_and_printable() -> None:
    """A client's model name is a label value only when known (configured or served), else
    "other"; a known one is cut to 128 characters, control characters replaced."""
    known = {"llama", "x" * 1000, "a\x00b\nc"}
    t = Telemetry(known_model=known.__contains__)
    for name in ["llama", "llama", "x" * 1000, "a\x00b\nc", "y" * (1 << 20), "evil\x00", ""]:
        t.count_request(name, name)
    series = {k: c.value for k, c in t.objective_requests.series.items()}
    assert series == {
        ("llama", "llama"): 2,
        ("x" * MAX_LABEL_CHARS, "x" * MAX_LABEL_CHARS): 1,
        ("a?b?c", "a?b?c"): 1,
        (OTHER, OTHER): 3,
    }
    text = generate_latest(t.registry)
    assert b"\x00" not in text and len(text) < 16 * 1024


def test_unknown_names_are_never_cached() -> None:
    t = Telemetry()  # nothing known
    for i in range(10_000):
        t.count_request(f"m{i}", f"m{i}")
    assert list(t.objective_requests.series) == [(OTHER, OTHER)]
    assert not t._objective_children

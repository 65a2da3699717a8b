"""The picker's own Prometheus counters, read over its metrics port, for tests that drive a real
Envoy and picker (:class:`kvlaunch.Stack`)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvlaunch import Stack, http


def extproc_messages(st: Stack) -> dict[str, float]:
    """The picker's ``kvpick_extproc_messages_total`` by ``kind`` (a kind never counted is absent)."""
    _, text, _ = http("GET", f"http://127.0.0.1:{st.metrics_port}/metrics")
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text.decode()):
        if fam.name == "kvpick_extproc_messages":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["kind"]] = s.value
    return out

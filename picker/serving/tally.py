"""Per-request metrics counted in plain Python numbers, exposed to Prometheus at scrape time.

prometheus_client's ``Counter.inc`` and ``Histogram.observe`` take a lock and walk its value
classes on every call: about 0.3-0.6 µs each, and a picked request makes a dozen of them (six
plugin timings, the pick latency, the hit ratio, the message kinds, the outcome). Here a count is
an attribute increment and an observation one ``bisect`` (about 0.1 µs), and :class:`Tally`, a
custom collector registered in the telemetry's registry, turns them into the same metric
families (names, help, labels, bucket bounds, cumulative ``le`` buckets, ``_sum`` / ``_count``)
when ``/metrics`` is read.

Writer: the event loop, which runs every ext_proc stream and serves ``/metrics`` too, so counting
and collecting never interleave; nothing here is locked. Label sets are bounded by the callers
(:class:`~picker.serving.telemetry.Telemetry` documents each bound).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class Count:
    """One counter series (``created``: when it was made, the ``_created`` sample)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        assert amount >= 0, f"a counter only goes up, got {amount}"
        self.value += amount


class Observations:
    """One histogram series: ``counts[i]`` holds the observations in ``(bounds[i-1], bounds[i]]``
    (Prometheus's ``le`` is inclusive), the last slot those above every bound."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Family:
    """A metric's series by label values. An unlabelled metric has its one series from the
    start (as prometheus_client exposes it, at zero, before any observation)."""

    __slots__ = ("doc", "labelnames", "name", "series")

    def __init__(self, name: str, doc: str, labelnames: Sequence[str]) -> None:
        self.name, self.doc, self.labelnames = name, doc, tuple(labelnames)


class CounterFamily(_Family):
    """A labelled counter: :meth:`labels` gives the series to keep and ``inc``."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, doc, labelnames)
        self.series: dict[tuple[str, ...], Count] = {} if self.labelnames else {(): Count()}

    def labels(self, *values: str) -> Count:
        assert len(values) == len(self.labelnames), f"{self.name}: labels {self.labelnames}, got {values}"
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = Count()
        return series

    def collect(self) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, c in self.series.items():
            fam.add_metric(values, c.value, created=c.created)
        return fam


class HistogramFamily(_Family):
    """A labelled histogram with fixed bucket bounds (ascending, finite)."""

    def __init__(self, name: str, doc: str, bounds: Sequence[float], labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, doc, labelnames)
        assert list(bounds) == sorted(set(bounds)), f"{name}: bounds must ascend, got {bounds}"
        self.bounds = tuple(float(b) for b in bounds)
        self.series: dict[tuple[str, ...], Observations] = (
            {} if self.labelnames else {(): Observations(self.bounds)}
        )

    def labels(self, *values: str) -> Observations:
        assert len(values) == len(self.labelnames), f"{self.name}: labels {self.labelnames}, got {values}"
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = Observations(self.bounds)
        return series

    def collect(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        for values, obs in self.series.items():
            total, buckets = 0, []
            for le, n in zip(les, obs.counts, strict=True):
                total += n
                buckets.append((le, total))
            fam.add_metric(list(values), buckets, obs.sum)
            labels = dict(zip(self.labelnames, values, strict=True))
            fam.samples.append(Sample(f"{self.name}_created", labels, obs.created))
        return fam


class Tally(Collector):
    """The per-request metric families, collected by a prometheus_client registry (register it
    once every family is made: the registry reads their names then)."""

    def __init__(self) -> None:
        self.families: list[CounterFamily | HistogramFamily] = []

    def counter(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> CounterFamily:
        fam = CounterFamily(name, doc, labelnames)
        self.families.append(fam)
        return fam

    def histogram(
        self, name: str, doc: str, bounds: Sequence[float], labelnames: Sequence[str] = ()
    ) -> HistogramFamily:
        fam = HistogramFamily(name, doc, bounds, labelnames)
        self.families.append(fam)
        return fam

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        for fam in self.families:
            yield fam.collect()

"""Counters, gauges and histograms whose series are plain numbers, for the event loop's thread.

prometheus-client's metrics take a lock and go through three method calls for each update, so
that any thread may update them. The proxy updates its metrics from the event loop alone (a scrape
reads them there too), and a request updates seven series or more: in the server that cost about
a tenth of a plain request's CPU (docs/metrics.md § How a worker keeps its numbers). These
families keep each series as a number the update adds to, and yield the samples prometheus-client
would: the same names, labels, `le` bounds and values, with no `_created` series
(proxy/metrics.py turns those off for every metric).

They implement what the proxy asks of a metric: `labels`, `inc` / `dec` / `set` / `observe` on a
series (on the family itself when it has no labels), `remove`, `remove_by_labels`, `clear`, and
the registry's `collect` and `describe`.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

INF = math.inf


class CounterSeries:
    """One counter series: a total that only goes up."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up: inc() takes a non-negative amount")
        self.value += amount


class GaugeSeries:
    """One gauge series: a level that moves both ways."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class HistogramSeries:
    """One histogram series: observations counted in the bucket of the first bound at or above
    them (the last bound is +Inf), and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.sum += amount
        if amount <= INF:  # false for NaN alone, which prometheus-client counts in no bucket
            self.counts[bisect_left(self.bounds, amount)] += 1


S = TypeVar("S", CounterSeries, GaugeSeries, HistogramSeries)


class Family(Collector, Generic[S]):
    """A metric family: its series by label values, in the order they were first asked for."""

    kind = ""  # the exposition type: counter, gauge or histogram

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        # As prometheus-client does: a counter is named without _total, its samples with it.
        self.name = name.removesuffix("_total") if self.kind == "counter" else name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.series: dict[tuple[str, ...], S] = {}
        self._one: S | None = None if self.labelnames else self._new()
        if registry is not None:
            registry.register(self)

    series_type: Callable[[], S]  # a new series of this kind (a histogram's takes its bounds)

    def _new(self) -> S:
        return self.series_type()

    def labels(self, *values: object) -> S:
        """The series of these label values (str() of each), made on first use; a family
        without labels has one series, `labels()`."""
        if self._one is not None and not values:
            return self._one
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values!r}")
        key = tuple(str(v) for v in values)
        found = self.series.get(key)
        if found is None:
            found = self.series[key] = self._new()
        return found

    def remove(self, *values: object) -> None:
        """Drop the series of these label values, if there is one."""
        if len(values) != len(self.labelnames) or not values:
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values!r}")
        self.series.pop(tuple(str(v) for v in values), None)

    def remove_by_labels(self, labels: Mapping[str, object]) -> None:
        """Drop every series whose labels include all of `labels` (none given: none dropped)."""
        unknown = [k for k in labels if k not in self.labelnames]
        if unknown or not self.labelnames:
            raise ValueError(f"{self.name}: unknown label names {unknown}, has {self.labelnames}")
        at = [(self.labelnames.index(k), str(v)) for k, v in labels.items()]
        if not at:
            return
        for key in [k for k in self.series if all(k[i] == v for i, v in at)]:
            del self.series[key]

    def clear(self) -> None:
        self.series.clear()

    def _unlabelled(self) -> S:
        if self._one is None:
            raise ValueError(f"{self.name} has labels {self.labelnames}: use labels() first")
        return self._one

    @abstractmethod
    def _samples(self, metric: Metric, labels: dict[str, str], series: S) -> None:
        """Add one series' samples to `metric`, as prometheus-client names them."""

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, self.kind)
        if self._one is not None:
            self._samples(metric, {}, self._one)
        for key, series in self.series.items():
            self._samples(metric, dict(zip(self.labelnames, key, strict=True)), series)
        return [metric]


class Counter(Family[CounterSeries]):
    kind = "counter"
    series_type = CounterSeries

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def _samples(self, metric: Metric, labels: dict[str, str], series: CounterSeries) -> None:
        metric.add_sample(f"{self.name}_total", labels, series.value)


class Gauge(Family[GaugeSeries]):
    kind = "gauge"
    series_type = GaugeSeries

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._unlabelled().dec(amount)

    def set(self, value: float) -> None:
        self._unlabelled().set(value)

    def _samples(self, metric: Metric, labels: dict[str, str], series: GaugeSeries) -> None:
        metric.add_sample(self.name, labels, series.value)


class Histogram(Family[HistogramSeries]):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
        *,
        buckets: Sequence[float],
    ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if list(bounds) != sorted(bounds):
            raise ValueError(f"{name}: buckets must be in increasing order")
        self.bounds = bounds if bounds and bounds[-1] == INF else (*bounds, INF)
        # prometheus-client: unannotated
        self._le = tuple(floatToGoString(b) for b in self.bounds)  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> HistogramSeries:
        return HistogramSeries(self.bounds)

    def observe(self, amount: float) -> None:
        self._unlabelled().observe(amount)

    def _samples(self, metric: Metric, labels: dict[str, str], series: HistogramSeries) -> None:
        total = 0
        for le, count in zip(self._le, series.counts, strict=True):
            total += count
            metric.add_sample(f"{self.name}_bucket", {**labels, "le": le}, float(total))
        metric.add_sample(f"{self.name}_count", labels, float(total))
        metric.add_sample(f"{self.name}_sum", labels, series.sum)

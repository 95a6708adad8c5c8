"""proxy/loopmetrics.py: the loop's own counters, gauges and histograms expose exactly what
prometheus-client's would after the same updates, byte for byte."""

from __future__ import annotations

import math

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from proxy import loopmetrics
from proxy.metrics import LATENCY_BUCKETS, Metrics

BOUNDS = (0.001, 0.01, 0.1, 1.0)
# Below every bound, on each bound (counted in its own bucket), between, above all, zero.
AMOUNTS = (0.0, 0.0005, 0.001, 0.002, 0.01, 0.05, 0.1, 1.0, 2.5, 1000.0)
# And NaN, which prometheus-client adds to the sum but counts in no bucket.
ODD_AMOUNTS = (*AMOUNTS, math.inf, math.nan)


def both(build, apply) -> tuple[bytes, bytes]:  # type: ignore[no-untyped-def]
    """The exposition of prometheus-client's metrics and of ours, after the same updates."""
    found = []
    for module in (prometheus_client, loopmetrics):
        registry = CollectorRegistry(auto_describe=True)
        apply(build(module, registry))
        found.append(generate_latest(registry))
    return found[0], found[1]


def test_labelled_series_expose_as_prometheus_client_would() -> None:
    def build(m, r):  # type: ignore[no-untyped-def]
        return (
            m.Counter("t_calls", "Calls.", ["route", "outcome"], registry=r),
            m.Gauge("t_level", "Level.", ["route"], registry=r),
            m.Histogram("t_seconds", "Seconds.", ["route"], registry=r, buckets=BOUNDS),
        )

    def apply(metrics) -> None:  # type: ignore[no-untyped-def]
        calls, level, seconds = metrics
        calls.labels("a", "ok").inc()
        calls.labels("a", "ok").inc(2.5)
        calls.labels("b", "5xx").inc()
        calls.labels("c", "ok")  # made, never counted: exported at 0
        level.labels("a").inc()
        level.labels("a").inc(3)
        level.labels("a").dec()
        level.labels("b").set(7)
        for i, amount in enumerate(AMOUNTS):
            seconds.labels("a" if i % 3 else "b").observe(amount)

    ours, theirs = both(build, apply)
    assert b't_seconds_bucket{le="0.001",route="a"}' in ours  # the test sees samples at all
    assert ours == theirs


def test_families_without_labels_and_a_total_suffix_expose_the_same() -> None:
    def build(m, r):  # type: ignore[no-untyped-def]
        return (
            m.Counter("t_events_total", "Events.", registry=r),
            m.Gauge("t_up", "Up.", registry=r),
            m.Histogram("t_wait_seconds", "Waits.", registry=r, buckets=LATENCY_BUCKETS),
        )

    def apply(metrics) -> None:  # type: ignore[no-untyped-def]
        events, up, wait = metrics
        events.inc()
        events.inc(0.25)
        up.set(True)
        up.dec(0.5)
        for amount in ODD_AMOUNTS:
            wait.observe(amount)

    ours, theirs = both(build, apply)
    assert b"t_events_total 1.25" in ours
    assert ours == theirs


def test_removed_series_are_no_longer_exposed() -> None:
    def build(m, r):  # type: ignore[no-untyped-def]
        return m.Counter("t_calls", "Calls.", ["route", "outcome"], registry=r)

    def apply(calls) -> None:  # type: ignore[no-untyped-def]
        for route in ("a", "b"):
            for outcome in ("ok", "5xx"):
                calls.labels(route, outcome).inc()
        calls.remove_by_labels({"route": "a"})
        calls.remove_by_labels({})  # nothing named: nothing dropped
        calls.remove("b", "5xx")
        calls.remove("b", "gone")  # no such series: nothing to drop
        calls.labels("d", 200).inc()
        calls.remove_by_labels({"outcome": 200})  # the value's text, as labels() takes it
        calls.labels("e", "ok").inc()

    ours, theirs = both(build, apply)
    assert b'route="a"' not in ours and b'outcome="5xx"' not in ours and b'"200"' not in ours
    assert b't_calls_total{outcome="ok",route="b"} 1.0' in ours
    assert ours == theirs


def test_a_label_value_is_its_text_and_the_same_series_each_time() -> None:
    calls = loopmetrics.Counter("t_calls", "Calls.", ["route", "status"])
    assert calls.labels("a", 200) is calls.labels("a", "200")
    calls.labels("a", 200).inc()
    calls.clear()
    assert calls.labels("a", "200").value == 0.0


def test_misuse_is_refused_as_prometheus_client_refuses_it() -> None:
    calls = loopmetrics.Counter("t_calls", "Calls.", ["route"])
    with pytest.raises(ValueError, match="expected labels"):
        calls.labels("a", "extra")
    with pytest.raises(ValueError, match="use labels"):
        calls.inc()
    with pytest.raises(ValueError, match="only goes up"):
        calls.labels("a").inc(-1)
    with pytest.raises(ValueError, match="expected labels"):
        calls.remove("a", "extra")
    with pytest.raises(ValueError, match="unknown label names"):
        calls.remove_by_labels({"status": "ok"})
    with pytest.raises(ValueError, match="increasing"):
        loopmetrics.Histogram("t_s", "S.", buckets=(1.0, 0.5))
    registry = CollectorRegistry(auto_describe=True)
    loopmetrics.Counter("t_calls", "Calls.", registry=registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        loopmetrics.Counter("t_calls", "Calls again.", registry=registry)


def test_a_histogram_counts_an_amount_on_a_bound_in_that_bound_s_bucket() -> None:
    seconds = loopmetrics.Histogram("t_s", "S.", buckets=BOUNDS)
    series = seconds.labels()
    for amount in (0.001, 0.0010001, 1.0, math.inf):
        series.observe(amount)
    assert series.counts == [1, 1, 0, 1, 1]  # <=0.001, <=0.01, <=0.1, <=1, +Inf


def test_every_metric_of_the_proxy_is_collected_once_without_a_duplicate() -> None:
    metrics = Metrics()
    metrics.route("tavily").observe(200, 0.002, 0.0001)
    text = generate_latest(metrics.registry).decode()
    assert 'search_proxy_requests_total{route="tavily",status_class="2xx"} 1.0' in text
    assert 'search_proxy_request_duration_seconds_bucket{le="0.0025",route="tavily"} 1.0' in text
    assert 'search_proxy_overhead_seconds_bucket{le="0.0001",route="tavily"} 1.0' in text
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names))

"""The recent past of every route and endpoint for the status page: the request metrics sampled
once a second (rates, success, latency percentiles, cache hits, sparklines), and the last
errors the proxy answered, redacted. Reading the metrics keeps the hot path free of it."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prometheus_client.registry import Collector

from proxy.config import Config, secret_values
from proxy.logs import Redactor, redact_value
from proxy.metrics import LATENCY_BUCKETS, Metrics

SAMPLE_S = 1.0  # one sample a second
HISTORY = 60  # sparkline points: the last minute
RATE_WINDOW = 10  # seconds requests/s is averaged over
STATS_WINDOW = 60  # seconds success, latency percentiles and cache hits are read over
RECENT_ERRORS = 20  # the last errors of the whole proxy
ROUTE_ERRORS = 5  # the last errors of each route or endpoint
MESSAGE_CHARS = 300
CACHE_LOOKUPS = ("hit", "miss", "stale", "bypass")


@dataclass(frozen=True, slots=True)
class Tick:
    """The counters of every label at one instant (monotonic seconds)."""

    at: float
    answered: Mapping[str, float]  # label -> requests answered
    failed: Mapping[str, float]  # label -> answered with a 4xx or 5xx
    buckets: Mapping[str, tuple[float, ...]]  # label -> cumulative request-duration buckets
    hits: Mapping[str, tuple[float, float]]  # route -> (cache hits, cache lookups)


def _samples(metric: Collector, suffix: str) -> Iterable[tuple[dict[str, str], float]]:
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(suffix):
                yield sample.labels, sample.value


def take_tick(metrics: Metrics, at: float) -> Tick:
    """Read the counters the status page derives its numbers from."""
    answered: dict[str, float] = {}
    failed: dict[str, float] = {}
    for labels, value in _samples(metrics.requests, "_total"):
        route = labels["route"]
        answered[route] = answered.get(route, 0.0) + value
        if labels["status_class"] in ("4xx", "5xx"):
            failed[route] = failed.get(route, 0.0) + value
    buckets: dict[str, list[float]] = {}
    for labels, value in _samples(metrics.request_duration, "_bucket"):
        buckets.setdefault(labels["route"], []).append(value)
    hits: dict[str, tuple[float, float]] = {}
    for labels, value in _samples(metrics.cache_results, "_total"):
        if labels["result"] in CACHE_LOOKUPS:
            hit, lookups = hits.get(labels["route"], (0.0, 0.0))
            hit += value if labels["result"] == "hit" else 0.0
            hits[labels["route"]] = (hit, lookups + value)
    frozen = {route: tuple(counts) for route, counts in buckets.items()}
    return Tick(at, answered, failed, frozen, hits)


def quantile(q: float, bounds: tuple[float, ...], counts: tuple[float, ...]) -> float | None:
    """The q-quantile of a histogram from its cumulative bucket counts (the last one +Inf), as
    Prometheus's histogram_quantile interpolates it; None without observations."""
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    for i, count in enumerate(counts):
        if count >= rank:
            if i >= len(bounds):  # past the highest finite bound
                return bounds[-1]
            lower = bounds[i - 1] if i > 0 else 0.0
            below = counts[i - 1] if i > 0 else 0.0
            if count == below:
                return bounds[i]
            return lower + (bounds[i] - lower) * (rank - below) / (count - below)
    return bounds[-1]


@dataclass(frozen=True, slots=True)
class Recent:
    """One error the proxy answered (or a stream it cut), as the status page lists it."""

    at: str  # UTC, ISO 8601
    label: str  # the route, /v1/search or /mcp
    status: int
    error: str | None  # the proxy's error type; None: the vendor's own answer passed through
    message: str
    request_id: str

    def public(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "route": self.label,
            "status": self.status,
            "error": self.error,
            "message": self.message,
            "request_id": self.request_id,
        }


@dataclass
class Pulse:
    """The sampled history and the last errors. `run()` samples once a second while the app
    serves; `follow()` takes each new config (its secrets, and the routes it removed)."""

    metrics: Metrics
    now: Callable[[], float] = time.monotonic
    ticks: deque[Tick] = field(default_factory=lambda: deque(maxlen=HISTORY + 1))
    errors: deque[Recent] = field(default_factory=lambda: deque(maxlen=RECENT_ERRORS))
    by_label: dict[str, deque[Recent]] = field(default_factory=dict)
    _redactor: Redactor = field(default_factory=Redactor)

    def sample(self) -> None:
        self.ticks.append(take_tick(self.metrics, self.now()))

    async def run(self) -> None:
        """Sample every SAMPLE_S until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_S)

    def follow(self, config: Config, labels: Iterable[str]) -> None:
        """The config now serving: its secrets never show; the errors of labels gone are
        dropped with them."""
        self._redactor.learn(secret_values(config))
        keep = set(labels)
        for label in list(self.by_label):
            if label not in keep:
                del self.by_label[label]

    def record(
        self, label: str, status: int, error: str | None, message: str, request_id: str
    ) -> None:
        """Remember an error answered under `label`; its message is redacted and cut short."""
        text = str(redact_value("message", message, self._redactor.known))
        if len(text) > MESSAGE_CHARS:
            text = text[: MESSAGE_CHARS - 1] + "…"
        at = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        recent = Recent(at, label, status, error, text, request_id)
        self.errors.appendleft(recent)
        ring = self.by_label.get(label)
        if ring is None:
            ring = self.by_label[label] = deque(maxlen=ROUTE_ERRORS)
        ring.appendleft(recent)

    def _window(self, seconds: int) -> tuple[Tick, Tick] | None:
        """The oldest tick within `seconds` of the newest, and the newest; None with one tick."""
        if len(self.ticks) < 2:
            return None
        newest = self.ticks[-1]
        oldest = newest
        for tick in reversed(self.ticks):
            if newest.at - tick.at > seconds + SAMPLE_S / 2:
                break
            oldest = tick
        return (oldest, newest) if oldest is not newest else None

    def numbers(self, label: str) -> dict[str, Any]:
        """Requests/s (over RATE_WINDOW), success %, p50/p99 ms and cache hit % (over
        STATS_WINDOW; None without requests), and the sparklines of the last minute."""
        found: dict[str, Any] = {
            "requests_per_s": None,
            "success_pct": None,
            "p50_ms": None,
            "p99_ms": None,
            "cache_hit_pct": None,
        }
        short = self._window(RATE_WINDOW)
        if short is not None:
            old, new = short
            done = new.answered.get(label, 0.0) - old.answered.get(label, 0.0)
            found["requests_per_s"] = round(done / (new.at - old.at), 2)
        stats = self._window(STATS_WINDOW)
        if stats is not None:
            old, new = stats
            done = new.answered.get(label, 0.0) - old.answered.get(label, 0.0)
            if done > 0:
                failed = new.failed.get(label, 0.0) - old.failed.get(label, 0.0)
                found["success_pct"] = round(100.0 * (done - failed) / done, 1)
                counts = _delta(new.buckets.get(label, ()), old.buckets.get(label, ()))
                for key, q in (("p50_ms", 0.5), ("p99_ms", 0.99)):
                    seconds = quantile(q, LATENCY_BUCKETS, counts)
                    found[key] = round(seconds * 1000, 2) if seconds is not None else None
            hit_new, look_new = new.hits.get(label, (0.0, 0.0))
            hit_old, look_old = old.hits.get(label, (0.0, 0.0))
            if look_new > look_old:
                found["cache_hit_pct"] = round(100.0 * (hit_new - hit_old) / (look_new - look_old))
        found["rate"], found["errors"] = self.sparklines(label)
        return found

    def sparklines(self, label: str) -> tuple[list[float], list[float]]:
        """Requests/s and errors/s (4xx and 5xx) of each second of the last minute, oldest first."""
        rate: list[float] = []
        errors: list[float] = []
        ticks = list(self.ticks)
        for old, new in itertools.pairwise(ticks):
            span = max(new.at - old.at, 1e-3)
            answered = new.answered.get(label, 0.0) - old.answered.get(label, 0.0)
            failed = new.failed.get(label, 0.0) - old.failed.get(label, 0.0)
            rate.append(round(answered / span, 2))
            errors.append(round(failed / span, 2))
        return rate, errors

    def recent(self, label: str | None = None) -> list[dict[str, Any]]:
        """The last errors, newest first: of `label`, or of the whole proxy."""
        ring = self.errors if label is None else self.by_label.get(label, ())
        return [recent.public() for recent in ring]


def _delta(new: tuple[float, ...], old: tuple[float, ...]) -> tuple[float, ...]:
    if len(old) != len(new):  # the label is new since the older tick
        return new
    return tuple(max(0.0, n - o) for n, o in zip(new, old, strict=True))

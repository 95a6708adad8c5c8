"""The metric series of every route, endpoint and provider, created when the routes are built (at
start-up and by each reload) so a dashboard panel reads 0 before the first request instead of
"No data"; a reload drops the series of a route, policy or provider it removed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from policies.breaker import Breaker
from policies.cache import StaleCache
from policies.core.outcome import Outcome
from policies.failover import Failover
from policies.hedge import Hedge
from policies.ratelimit import RateLimit
from policies.retry import SECTION as RETRY
from policies.retry import retry_reasons
from policies.search import SearchRecovery
from proxy.loopmetrics import Family
from proxy.metrics import BREAKER_STATES, Metrics
from proxy.pipeline import Route

# The label values each policy reports (policies/core/events.py), created with its route.
CACHE_RESULTS = ("hit", "miss", "stale", "bypass", "store")
DECISIONS = ("allowed", "delayed", "rejected")
PROBE_RESULTS = ("ok", "failed")
VARIANT_OUTCOMES = ("results", "empty", "failed")
FAILOVER_RESULTS = ("answered", "empty", "failed", "skipped")
HEDGE_RESULTS = ("won", "lost", "cancelled", "refused")
PROVIDER_OUTCOMES = ("results", "empty", "failed", "skipped")
RATELIMIT_BUCKETS = frozenset({"ratelimit_buckets", "ratelimit_buckets_evicted"})
# A route's own series, whatever it configures (RouteMetrics, and its vendor attempts).
ROUTE_FAMILIES = frozenset(
    {
        "requests",
        "request_duration",
        "upstream_duration",
        "overhead",
        "in_flight",
        "upstream_attempts",
        "stream_cuts",
    }
)


class Series:
    """Keeps the exported series in step with the routes serving: `declare` after every build."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._families: dict[str, frozenset[str]] = {}  # route -> metric families it reports
        self._providers: frozenset[str] = frozenset()
        self._fallbacks: frozenset[tuple[str, str]] = frozenset()  # (route, its fallback)

    def declare(self, routes: Mapping[str, Route], providers: Sequence[str]) -> None:
        """Create every series `routes` and the /v1/search `providers` report, set the breaker
        gauges to the breakers' states, and drop what the previous declaration had beyond."""
        m = self.metrics
        families = {name: self._route(m, name, route) for name, route in routes.items()}
        fallbacks: set[tuple[str, str]] = set()
        for name, route in routes.items():
            fallback = route.config.section("fallback")
            if "failovers" in families[name] and fallback is not None:
                fallbacks.update((name, provider) for provider in fallback.providers)
        for name, provider in fallbacks:
            for result in FAILOVER_RESULTS:
                m.failovers.labels(name, provider, result)
        for provider in providers:
            for outcome in PROVIDER_OUTCOMES:
                m.provider_fallbacks.labels(provider, outcome)
        for name, had in self._families.items():
            gone = had - families.get(name, frozenset())
            for family in gone:
                _metric(m, family).remove_by_labels({"route": name})
            if "breaker_state" in gone:
                m.forget_breaker(name)
            if name not in families:
                m.routes.pop(name, None)
        for name, provider in self._fallbacks - fallbacks:
            m.failovers.remove_by_labels({"route": name, "provider": provider})
        for provider in self._providers - set(providers):
            m.provider_fallbacks.remove_by_labels({"provider": provider})
        self._families, self._providers = families, frozenset(providers)
        self._fallbacks = frozenset(fallbacks)
        m.series_dropped()  # what was removed may be declared again by a later reload

    @staticmethod
    def _route(m: Metrics, name: str, route: Route) -> frozenset[str]:
        """Create the series of one route; the families it reports."""
        m.route(name)
        for outcome in Outcome:
            m.upstream_attempts.labels(name, outcome.value)
        found = set(ROUTE_FAMILIES)
        retry = route.config.get(RETRY)
        if retry is not None:
            found |= {"retries", "retry_budget_exhausted"}
            m.retry_budget_exhausted.labels(name)
            for reason in retry_reasons(retry):
                m.retries.labels(name, reason)
        for policy in route.policies:
            found |= _policy(m, name, policy)
        return frozenset(found)


def _policy(m: Metrics, name: str, policy: object) -> set[str]:
    """Create the series one policy of a route reports; their families."""
    if isinstance(policy, Breaker):
        m.breaker_is(name, policy.state)
        m.breaker_open_seconds.labels(name)
        _each(m.breaker_transitions, name, BREAKER_STATES)
        found = {"breaker_state", "breaker_open_seconds", "breaker_transitions"}
        if policy.config.probe is not None:
            _each(m.breaker_probes, name, PROBE_RESULTS)
            found.add("breaker_probes")
        return found
    if isinstance(policy, StaleCache):
        _each(m.cache_results, name, CACHE_RESULTS)
        m.coalesced_requests.labels(name)
        return {"cache_results", "coalesced_requests"}
    if isinstance(policy, RateLimit):
        _each(m.ratelimit_decisions, name, DECISIONS)
        m.ratelimit_wait.labels(name)
        m.ratelimit_buckets.labels(name)
        m.ratelimit_buckets_evicted.labels(name)
        return {"ratelimit_decisions", "ratelimit_wait"} | RATELIMIT_BUCKETS
    if isinstance(policy, SearchRecovery):
        _each(m.search_variants, name, VARIANT_OUTCOMES)
        return {"search_variants"}
    if isinstance(policy, Hedge):
        _each(m.hedges, name, HEDGE_RESULTS)
        return {"hedges"}
    if isinstance(policy, Failover):
        return {"failovers"}  # by fallback: `declare`
    return set()


def _each(metric: Family[Any], route: str, values: Iterable[str]) -> None:
    for value in values:
        metric.labels(route, value)


def _metric(m: Metrics, family: str) -> Family[Any]:
    found = getattr(m, family)
    assert isinstance(found, Family)
    return found

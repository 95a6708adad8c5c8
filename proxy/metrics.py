"""Prometheus metrics, one registry per app, implementing the policies' `Events` hooks.

Labels are bounded: route, status class, outcome, reason, decision. Never query text or client.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics
from prometheus_client import Gauge as ReadGauge
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from policies.core.memory import MemoryBudget
from policies.core.outcome import Outcome
from proxy.loopmetrics import Counter, CounterSeries, Gauge, Histogram

# The *_created series double the exposition and no dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus-client: unannotated

# From sub-millisecond proxy overhead to 60 s upstream calls.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
)
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
RELOAD_RESULTS = ("applied", "unchanged", "failed")


class RouteMetrics:
    """Children bound to one route at start-up, so the hot path does no label lookups."""

    __slots__ = ("duration", "in_flight", "label", "overhead", "requests", "upstream_duration")

    def __init__(self, metrics: Metrics, route: str) -> None:
        self.label = route  # a route's name, or an endpoint's path (/v1/search, /mcp ...)
        self.requests = {c: metrics.requests.labels(route, c) for c in STATUS_CLASSES}
        self.duration = metrics.request_duration.labels(route)
        self.upstream_duration = metrics.upstream_duration.labels(route)
        self.overhead = metrics.overhead.labels(route)
        self.in_flight = metrics.in_flight.labels(route)

    def observe(self, status: int, seconds: float, overhead: float | None) -> None:
        """Record one finished agent request; `overhead` is None where it is not known."""
        self.requests[STATUS_CLASSES[min(max(status // 100, 1), 5) - 1]].inc()
        self.duration.observe(seconds)
        if overhead is not None:
            self.overhead.observe(max(0.0, overhead))


class _OpenTime(Collector):
    """Keeps a seconds counter current (`search_proxy_breaker_open_seconds` per route, Redis's
    degraded time): registered before that counter, it adds the time each key has been in its
    counted state since the last look, at every scrape and every transition, so an hour-long
    outage shows while it lasts, not only once it ends."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self.now = now
        self.counter: Callable[[str], CounterSeries] | None = None  # the counter child of a key
        self.counted_to: dict[str, float] = {}  # key -> time counted up to, while counted

    def transition(self, key: str, state: str) -> None:
        """`key` (a route) entered `state`; time is counted in any state but closed."""
        self.catch_up()
        if state == "closed":
            self.counted_to.pop(key, None)
        else:
            self.counted_to.setdefault(key, self.now())

    def catch_up(self) -> None:
        if self.counter is None:
            return
        now = self.now()
        for key, since in self.counted_to.items():
            self.counter(key).inc(max(0.0, now - since))
            self.counted_to[key] = now

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        self.catch_up()
        return ()


class Metrics:
    """Every metric the proxy exports; also the `policies.core.events.Events` implementation."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[Any, ...]], Any] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "search_proxy_requests",
            "Agent requests answered, by route and status class.",
            ["route", "status_class"],
            registry=r,
        )
        self.request_duration = Histogram(
            "search_proxy_request_duration_seconds",
            "Time from receiving an agent request to the start of its answer.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_duration = Histogram(
            "search_proxy_upstream_duration_seconds",
            "Duration of each upstream attempt (to the end of the body, or the stream's headers).",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "search_proxy_overhead_seconds",
            "Time the proxy itself added: request duration less upstream time and waits.",
            ["route"],
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "search_proxy_in_flight_requests",
            "Agent requests being handled now.",
            ["route"],
            registry=r,
        )
        self.upstream_attempts = Counter(
            "search_proxy_upstream_attempts",
            "Upstream attempts by outcome (ok, client_error, 429, 5xx, timeout, connect_error, "
            "reset, malformed, empty, terminal).",
            ["route", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "search_proxy_retries",
            "Retries scheduled, by the reason of the failed attempt.",
            ["route", "reason"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "search_proxy_retry_budget_exhausted",
            "Retries refused because the route's retry budget was spent.",
            ["route"],
            registry=r,
        )
        self.ratelimit_decisions = Counter(
            "search_proxy_ratelimit",
            "Rate-limit decisions: allowed, delayed (waited for a token) or rejected.",
            ["route", "decision"],
            registry=r,
        )
        self.ratelimit_wait = Histogram(
            "search_proxy_ratelimit_wait_seconds",
            "Time requests waited for a rate-limit token.",
            ["route"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.ratelimit_buckets = Gauge(
            "search_proxy_ratelimit_buckets",
            "Rate-limit buckets held in this process (one per caller with key: client), at most "
            "rate_limit.max_clients.",
            ["route"],
            registry=r,
        )
        self.ratelimit_buckets_evicted = Counter(
            "search_proxy_ratelimit_buckets_evicted",
            "Least-recently-used rate-limit buckets dropped to stay within rate_limit.max_clients.",
            ["route"],
            registry=r,
        )
        self.clients_refused = Counter(
            "search_proxy_clients_refused",
            "Requests refused before any vendor call because of the caller: unknown_token (no "
            "known client token, with clients: configured) or quota (daily quota used).",
            ["reason"],
            registry=r,
        )
        self.breaker_state = Gauge(
            "search_proxy_breaker_state",
            "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            ["route"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "search_proxy_breaker_transitions",
            "Circuit breaker transitions, by the state entered.",
            ["route", "to"],
            registry=r,
        )
        self.open_time = _OpenTime()
        r.register(self.open_time)  # before its counter: each scrape brings the counter up to date
        self.breaker_open_seconds = Counter(
            "search_proxy_breaker_open_seconds",
            "Seconds the circuit breaker was not closed (open or half-open), current at each "
            "scrape.",
            ["route"],
            registry=r,
        )
        self.open_time.counter = self.breaker_open_seconds.labels
        self.breaker_probes = Counter(
            "search_proxy_breaker_probes",
            "Active probes the breaker sent while not closed (breaker.probe), by result: ok or "
            "failed.",
            ["route", "result"],
            registry=r,
        )
        self.cache_results = Counter(
            "search_proxy_cache",
            "Cache outcomes: hit, miss, stale, bypass, store.",
            ["route", "result"],
            registry=r,
        )
        self.coalesced_requests = Counter(
            "search_proxy_coalesced",
            "Requests answered by an identical in-flight request's vendor call.",
            ["route"],
            registry=r,
        )
        self.search_variants = Counter(
            "search_proxy_search_variants",
            "Simplified query variants tried after empty results, by outcome.",
            ["route", "outcome"],
            registry=r,
        )
        self.provider_fallbacks = Counter(
            "search_proxy_search_provider_outcomes",
            "Providers tried by /v1/search, by outcome (results, empty, failed, skipped).",
            ["provider", "outcome"],
            registry=r,
        )
        self.fetch_pages = Counter(
            "search_proxy_fetch_pages",
            "Pages asked of /v1/fetch (and fetch_page), per provider: fetched, cached (the page "
            "cache answered), stale (the cache stood in for a failure); or per provider that did "
            "not give one: failed (it could not read the page), unavailable (down, skipped, out "
            "of calls), refused (the direct fetcher refused the address).",
            ["provider", "outcome"],
            registry=r,
        )
        self.failovers = Counter(
            "search_proxy_failovers",
            "Fallback providers asked for a failed search route, by result (answered, empty, "
            "failed, skipped).",
            ["route", "provider", "result"],
            registry=r,
        )
        self.hedges = Counter(
            "search_proxy_hedges",
            "Hedged attempts, by result: won (its answer was sent), lost (it failed), cancelled "
            "(another attempt answered first); refused: not sent, the hedge budget was spent.",
            ["route", "result"],
            registry=r,
        )
        self.key_calls = Counter(
            "search_proxy_key_calls",
            "Vendor calls made with each key of a route's key pool (key: a short hash, never "
            "the key), by result: used (its answer went on), rate_limited or exhausted (the key "
            "was benched and the call re-sent with another).",
            ["route", "key", "result"],
            registry=r,
        )
        self.keys_benched_total = Counter(
            "search_proxy_keys_benched",
            "Requests that found every key of the route's key pool benched (no call made; "
            "failover takes over where configured).",
            ["route"],
            registry=r,
        )
        self.faults = Counter(
            "search_proxy_faults_injected",
            "Faults injected at an agent's request (X-Search-Proxy-Fault), by fault (a status, "
            "timeout, empty, malformed, latency) and where (vendor, agent); never counted as "
            "upstream attempts.",
            ["route", "fault", "at"],
            registry=r,
        )
        self.stream_cuts = Counter(
            "search_proxy_stream_cuts",
            "Streamed answers cut after their status was sent, by reason: the upstream's failure "
            "(upstream_timeout: silent past timeouts.idle; deadline_exceeded: past "
            "timeouts.stream; upstream_too_large, upstream_unreachable, "
            "upstream_invalid_response), or the agent's side (client_gone, send_timeout, "
            "shutdown).",
            ["route", "reason"],
            registry=r,
        )
        # Registered only when Redis is configured (`redis_configured`): without Redis there is
        # no link to be up or down, and a 0 would read as an outage.
        self.redis_up = Gauge(
            "search_proxy_redis_up",
            "1 while Redis answers, 0 while shared state runs in-process (only with redis: "
            "configured).",
            registry=None,
        )
        self.redis_configured = Gauge(
            "search_proxy_redis_configured",
            "1 when redis: is configured (shared state), 0 when state is in-process by design.",
            registry=r,
        )
        self.redis_transitions = Counter(
            "search_proxy_redis_transitions",
            "Redis reachability changes (to=down: fell back to in-process state; to=up: rejoined).",
            ["to"],
            registry=r,
        )
        self.redis_node = Gauge(
            "search_proxy_redis_node",
            "1 for each Redis node the link sends commands to, by address and role (standalone; "
            "master: the master a Sentinel set names, or a cluster's masters).",
            ["node", "role"],
            registry=r,
        )
        self.redis_failovers = Counter(
            "search_proxy_redis_failovers",
            "Changes of the Redis master in use seen by this replica (a Sentinel or cluster "
            "failover, or a cluster's masters changing).",
            registry=r,
        )
        self.redis_busy_commands = Counter(
            "search_proxy_redis_busy",
            "Redis commands that waited for a connection of their own (redis.max_connections "
            "busy) past the timeout and used in-process state instead.",
            registry=r,
        )
        self.degraded_time = _OpenTime()
        r.register(self.degraded_time)  # before its counter, as open_time
        self.redis_degraded_seconds = Counter(
            "search_proxy_redis_degraded_seconds",
            "Seconds Redis was unreachable and shared state ran in-process, current at each "
            "scrape.",
            registry=r,
        )
        self.degraded_time.counter = lambda _: self.redis_degraded_seconds.labels()
        self.build_info = Gauge(
            "search_proxy_build_info",
            "Always 1; the version of search-proxy serving.",
            ["version"],
            registry=r,
        )
        self.config_info = Gauge(
            "search_proxy_config_info",
            "Always 1; hash: the first 12 hex digits of the SHA-256 of the config file serving.",
            ["hash"],
            registry=r,
        )
        self.config_reloads = Counter(
            "search_proxy_config_reloads",
            "Config reloads (SIGHUP, POST /admin/reload, the file watch), by result: applied, "
            "unchanged (same file) or failed (the old config keeps serving).",
            ["result"],
            registry=r,
        )
        for result in RELOAD_RESULTS:
            self.config_reloads.labels(result)
        for to in ("up", "down"):
            self.redis_transitions.labels(to)
        self.buffered_bytes = ReadGauge(  # read at each scrape (set_function)
            "search_proxy_buffered_bytes",
            "Bytes of bodies held in memory now (agents' bodies, buffered answers), against "
            "server.max_buffered_bytes.",
            registry=r,
        )
        self.memory_budget_refused = Counter(
            "search_proxy_memory_budget_refused",
            "Bodies the memory budget (server.max_buffered_bytes) had no room for: refused "
            "with 503 memory_budget, or a non-JSON answer passed through instead of buffered.",
            registry=r,
        )
        self.buffered_limit = Gauge(
            "search_proxy_buffered_limit_bytes",
            "server.max_buffered_bytes: the most bytes of bodies held in memory at once.",
            registry=r,
        )
        # The process's CPU, memory, open files and start time (process_*), from /proc.
        ProcessCollector(registry=r)
        self.routes: dict[str, RouteMetrics] = {}

    def _child(self, metric: Any, *values: Any) -> Any:
        """`metric.labels(*values)`, found once: labels() checks and converts the values, and an
        event is counted on every request. Label values come from bounded sets (routes,
        outcomes, reasons); `series_dropped` forgets what a reload removed."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def series_dropped(self) -> None:
        """Series were removed (a reload dropped a route, a policy or a provider): look each
        child up again, so that one created again counts into the series exported, not into
        the one removed."""
        self._children.clear()

    def route(self, name: str) -> RouteMetrics:
        """The bound per-route metrics, created when the route is first built."""
        bound = self.routes.get(name)
        if bound is None:
            bound = self.routes[name] = RouteMetrics(self, name)
        return bound

    def identify(self, version: str, config_hash: str) -> None:
        """Set build_info, and config_info to the config now serving (its hash alone)."""
        self.build_info.labels(version).set(1)
        self.config_info.clear()
        self.config_info.labels(config_hash).set(1)

    def watch_budget(self, budget: MemoryBudget) -> None:
        """Export the memory budget's use and limit (read at each scrape), count its refusals."""
        self.buffered_bytes.set_function(lambda: budget.used)
        self.buffered_limit.set(budget.limit)
        budget.on_refused = self.memory_budget_refused.inc

    def redis_is_configured(self, configured: bool) -> None:
        """Export redis_up (starting at 1) only when Redis is configured."""
        self.redis_configured.set(1 if configured else 0)
        if configured:
            self.redis_up.set(1)
            self.registry.register(self.redis_up)

    def breaker_is(self, route: str, state: str) -> None:
        """The gauge (and open time) of a route whose breaker was built or kept by a reload: its
        state now, not counted as a transition."""
        self.breaker_state.labels(route).set(BREAKER_STATES.get(state, 0))
        self.open_time.transition(route, state)

    def forget_breaker(self, route: str) -> None:
        """A route lost its breaker: stop counting its open time."""
        self.open_time.catch_up()
        self.open_time.counted_to.pop(route, None)

    # -- policies.core.events.Events ---------------------------------------------------------------

    def attempt(self, route: str, outcome: Outcome) -> None:
        self._child(self.upstream_attempts, route, outcome).inc()

    def retry(self, route: str, reason: str) -> None:
        self._child(self.retries, route, reason).inc()

    def budget_exhausted(self, route: str) -> None:
        self._child(self.retry_budget_exhausted, route).inc()

    def ratelimit(self, route: str, decision: str, waited_s: float) -> None:
        self._child(self.ratelimit_decisions, route, decision).inc()
        if decision == "delayed":
            self._child(self.ratelimit_wait, route).observe(waited_s)

    def buckets(self, route: str, held: int, evicted: int) -> None:
        self._child(self.ratelimit_buckets, route).set(held)
        if evicted:
            self._child(self.ratelimit_buckets_evicted, route).inc(evicted)

    def breaker_transition(self, route: str, state: str) -> None:
        self._child(self.breaker_state, route).set(BREAKER_STATES.get(state, 0))
        self._child(self.breaker_transitions, route, state).inc()
        self.open_time.transition(route, state)

    def breaker_probe(self, route: str, result: str) -> None:
        self._child(self.breaker_probes, route, result).inc()

    def cache(self, route: str, result: str) -> None:
        self._child(self.cache_results, route, result).inc()

    def coalesced(self, route: str) -> None:
        self._child(self.coalesced_requests, route).inc()

    def search_variant(self, route: str, outcome: str) -> None:
        self._child(self.search_variants, route, outcome).inc()

    def failover(self, route: str, provider: str, result: str) -> None:
        self._child(self.failovers, route, provider, result).inc()

    def hedge(self, route: str, result: str) -> None:
        self._child(self.hedges, route, result).inc()

    def key_call(self, route: str, key: str, result: str) -> None:
        self._child(self.key_calls, route, key, result).inc()

    def keys_benched(self, route: str) -> None:
        self._child(self.keys_benched_total, route).inc()

    def fault(self, route: str, fault: str, at: str) -> None:
        self._child(self.faults, route, fault, at).inc()

    def stream_cut(self, route: str, reason: str) -> None:
        """A streamed answer was cut mid-way; `reason` is an error type or the agent's side."""
        self._child(self.stream_cuts, route, reason).inc()

    def redis_state(self, up: bool) -> None:
        self.redis_up.set(1 if up else 0)
        self.redis_transitions.labels("up" if up else "down").inc()
        self.degraded_time.transition("redis", "closed" if up else "down")

    def redis_nodes(self, nodes: Sequence[tuple[str, str]]) -> None:
        self.redis_node.clear()
        for address, role in nodes:
            self.redis_node.labels(address, role).set(1)

    def redis_failover(self) -> None:
        self.redis_failovers.inc()

    def redis_busy(self) -> None:
        self.redis_busy_commands.inc()

"""Building each route, once at start-up, into its chain of policies around the upstream call.

The order is fixed (README, "How a request flows"); policies a route does not configure are
left out:

    search guard -> [failover] -> cache -> [failover] -> breaker -> search recovery -> retry
                 -> hedge -> rate limit -> upstream

The guard refuses bad queries before anything is spent. The cache sits outside the breaker and
the limiter so an open circuit or a refused token can still be answered stale. The breaker sees
one outcome per request, after retries and hedges. The hedge races each attempt of the retry
loop against the hedges it sends, above the limiter: every attempt, hedges included, and only
attempts that reach the vendor, spends a token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from policies.breaker import Breaker
from policies.cache import KnownCredentials, StaleCache, build_store, default_storable
from policies.core.clock import Clock
from policies.core.credentials import is_credential_name
from policies.core.events import Events
from policies.core.flow import Handler, Policy, Reply, compose
from policies.core.outcome import Classifier, Outcome, status_outcome
from policies.core.redislink import RedisLink
from policies.failover import Exhausted, Failover
from policies.hedge import Hedge
from policies.mcp import McpConfig, McpRoute, McpUpstream, mcp_classifier
from policies.profiles import QueryLocation, VendorProfile, credential_slot, ratelimit_hint
from policies.ratelimit import Hint, RateLimit, bucket_store, quota_hint
from policies.retry import NO_RETRY, Retry
from policies.search import SearchConfig, SearchGuard, SearchRecovery, search_classifier
from policies.translate import Provider
from proxy.config import Config, RouteConfig
from proxy.forward import Upstream
from proxy.metrics import Metrics, RouteMetrics
from proxy.probe import probe_sender


@dataclass
class Route:
    """A route as the server runs it: its config, its composed chain and its stateful parts."""

    config: RouteConfig
    handler: Handler
    metrics: RouteMetrics
    set_headers: tuple[tuple[str, str], ...]
    remove_headers: frozenset[str]
    policies: list[Policy] = field(default_factory=list)
    classify: Classifier = status_outcome
    profile: VendorProfile | None = None
    breaker: Breaker | None = None
    cache: StaleCache | None = None
    missing_key: str | None = None  # a credential header configured empty (unset ${VAR:-})

    @property
    def name(self) -> str:
        return self.config.name


@dataclass
class Deps:
    """What routes are built from, besides their own config."""

    config: Config
    session: aiohttp.ClientSession
    clock: Clock
    metrics: Metrics
    redis: RedisLink | None
    # Every route of the app by name, filled in as they are built (failover looks up its
    # fallbacks when first needed), and the fleet-wide record of exhausted plans.
    routes: dict[str, Route] = field(default_factory=dict)
    exhausted: Exhausted | None = None


def _as_provider(route: Route) -> Provider:
    """Another route, as a failover fallback."""
    assert route.profile is not None  # config only accepts routes with a search section
    breaker = route.breaker
    missing = route.missing_key is not None
    return Provider(
        name=route.name,
        profile=route.profile,
        handler=route.handler,
        classify=route.classify,
        headers=route.set_headers,
        total=route.config.timeouts.total,
        available=lambda: not missing and (breaker is None or breaker.state != "open"),
    )


def _failover(cfg: RouteConfig, profile: VendorProfile, classify: Classifier, deps: Deps) -> Policy:
    fallback = cfg.fallback
    assert fallback is not None
    found: list[Provider] = []

    def providers() -> list[Provider]:
        if not found:
            found.extend(_as_provider(deps.routes[name]) for name in fallback.providers)
        return found

    if deps.exhausted is None:
        deps.exhausted = Exhausted(deps.clock, deps.redis)
    # A configured key left empty (an unset ${VAR:-}) is not sent: the caller's own key is used.
    injects_key = any(
        is_credential_name(name) and not empty_credential(name, value)
        for name, value in cfg.headers.set.items()
    )
    return Failover(
        cfg.name,
        profile,
        classify,
        fallback,
        providers,
        deps.exhausted,
        deps.clock,
        deps.metrics,
        shared_key=injects_key,
    )


def _hedge(
    cfg: RouteConfig,
    profile: VendorProfile | None,
    classify: Classifier,
    retry: Retry,
    deps: Deps,
) -> Hedge:
    """The route's hedge; with `to: fallback` it sends hedges to the first fallback provider."""
    assert cfg.hedge is not None
    found: list[Provider] = []

    def first_fallback() -> Provider | None:
        if not found and cfg.fallback is not None:
            found.append(_as_provider(deps.routes[cfg.fallback.providers[0]]))
        return found[0] if found else None

    return Hedge(
        cfg.name,
        cfg.hedge,
        per_try=cfg.timeouts.per_try,
        clock=deps.clock,
        events=deps.metrics,
        classify=classify,
        profile=profile,
        # A route without a retry section has no retry budget to share: its own budget bounds it.
        retry_budget=retry.budget if cfg.retry is not None else None,
        fallback=first_fallback if cfg.hedge.to == "fallback" else None,
    )


def _profile_hint(profile: VendorProfile, clock: Clock) -> Hint:
    """Pause the bucket when the vendor's headers say the quota is spent (before the 429)."""

    def hint(reply: Reply) -> float | None:
        found = ratelimit_hint(profile, reply.headers, now=clock.wall())
        if found is None or found.remaining > 0:
            return None
        return found.reset_s

    return hint


def _storable(classify: Classifier) -> Callable[[Reply], bool]:
    """A search answer is cached when it is a 2xx the profile reads as results or as empty."""

    def storable(reply: Reply) -> bool:
        return 200 <= reply.status < 300 and classify(reply) in (Outcome.OK, Outcome.EMPTY)

    return storable


def empty_credential(name: str, value: str) -> bool:
    """A credential header whose value is empty, or a bare scheme (`Bearer ` from an unset
    `${VAR:-}`): not sent, so the agent's own key passes through on the route."""
    if not is_credential_name(name):
        return False
    scheme, _, rest = value.strip().partition(" ")
    return not scheme or (scheme.lower() in ("bearer", "basic", "token") and not rest.strip())


def known_credentials(cfg: RouteConfig, profile: VendorProfile | None) -> KnownCredentials:
    """Where this route's requests carry credentials, for its cache key: every header it sets,
    the profile's own search headers, and where its vendor reads the key (its key slot)."""
    headers = {name.lower() for name in cfg.headers.set}
    params: set[str] = set()
    if profile is not None:
        headers.update(name.lower() for name in profile.search_headers)
        slot = credential_slot(profile)
        if slot is not None:
            (headers if slot.kind == "header" else params).add(slot.name.lower())
    return KnownCredentials(frozenset(headers), frozenset(params))


def _mcp_search(route: str, cfg: McpConfig) -> tuple[SearchConfig | None, VendorProfile | None]:
    """Search recovery for an MCP route's search tools: the query is a tool argument
    (`params.arguments.<name>`) of the JSON-RPC tools/call; McpUpstream says when it is empty."""
    if not cfg.search_tools:
        return None, None
    arguments = dict.fromkeys(cfg.search_tools.values())
    profile = VendorProfile(
        name=f"{route}-mcp",
        query_locations=tuple(QueryLocation("json", f"params.arguments.{a}") for a in arguments),
        results_paths=(("result",),),  # unused: the outcome comes from McpUpstream
    )
    return SearchConfig(vendor=profile.name), profile


def build_route(cfg: RouteConfig, deps: Deps) -> Route:
    """Compose one route's policies, in the documented order, around its upstream."""
    events: Events = deps.metrics
    clock = deps.clock
    search = cfg.search
    profile = deps.config.profiles[search.vendor] if search is not None else None
    classify = search_classifier(profile) if profile is not None else status_outcome
    if cfg.mcp is not None:  # per tool call: McpUpstream classifies each final response
        classify = mcp_classifier
        search, profile = _mcp_search(cfg.name, cfg.mcp)

    policies: list[Policy] = []
    if search is not None and profile is not None and cfg.mcp is None:
        policies.append(SearchGuard(cfg.name, profile, search, classify, clock, events))
    failover = None
    if cfg.fallback is not None and profile is not None:
        failover = _failover(cfg, profile, classify, deps)
        if cfg.fallback.prefer == "stale":  # outside the cache: stale entries answer first
            policies.append(failover)
    cache = None
    if cfg.cache is not None:
        cache = StaleCache(
            cfg.name,
            cfg.cache,
            build_store(cfg.cache, deps.redis, clock),
            clock,
            events,
            storable=_storable(classify) if profile is not None or cfg.mcp else default_storable,
            known=known_credentials(cfg, profile),
        )
        policies.append(cache)
    if failover is not None and cfg.fallback is not None and cfg.fallback.prefer == "fresh":
        policies.append(failover)  # inside the cache: stale only when the fallbacks fail too
    breaker = None
    if cfg.breaker is not None:
        # A probe's fleet-wide slot lasts as long as the probe itself may.
        breaker = Breaker(
            cfg.name,
            cfg.breaker,
            clock,
            events,
            deps.redis,
            probe_lease=cfg.timeouts.total,
            send_probe=probe_sender(cfg, deps),
        )
        policies.append(breaker)
    if search is not None and profile is not None and search.on_empty == "simplify":
        policies.append(SearchRecovery(cfg.name, profile, search, classify, clock, events))
    retry = Retry(
        cfg.name,
        cfg.retry or NO_RETRY,
        per_try=cfg.timeouts.per_try,
        clock=clock,
        events=events,
        classify=classify,
        halt=breaker.halts_retries if breaker is not None else None,
    )
    policies.append(retry)
    if cfg.hedge is not None:
        policies.append(_hedge(cfg, profile, classify, retry, deps))
    if cfg.rate_limit is not None:
        hint = _profile_hint(profile, clock) if profile and profile.ratelimit_headers else None
        policies.append(
            RateLimit(
                cfg.name,
                cfg.rate_limit,
                bucket_store(cfg.rate_limit, clock, deps.redis, route=cfg.name, events=events),
                clock,
                events,
                hint=hint or quota_hint(),
            )
        )

    metrics = deps.metrics.route(cfg.name)
    upstream = Upstream(cfg, deps.session, clock, observe=metrics.upstream_duration.observe)
    handler: Handler = compose(policies, upstream)
    if cfg.mcp is not None:
        # Tool calls of idempotent tools go through the chain; everything else straight up.
        chain = compose(policies, McpUpstream(cfg.name, cfg.mcp, upstream, clock))
        handler = McpRoute(cfg.name, cfg.mcp, chain, upstream)
        profile = None  # no vendor dialect: the answers are JSON-RPC
    return Route(
        config=cfg,
        handler=handler,
        metrics=metrics,
        set_headers=tuple((k, v) for k, v in cfg.headers.set.items() if not empty_credential(k, v)),
        missing_key=next((k for k, v in cfg.headers.set.items() if empty_credential(k, v)), None),
        remove_headers=frozenset(h.lower() for h in cfg.headers.remove),
        policies=policies,
        classify=classify,
        profile=profile,
        cache=cache,
        breaker=breaker,
    )

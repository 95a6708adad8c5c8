"""Building each route, once at start-up, into its chain of policies around the upstream call.

The policies and their order are policies/chain.py's. What is the server's is added here: the
upstream call at the bottom of the chain (proxy/forward.py), the route's headers and metrics,
other routes as failover providers, the breaker's side request, and an MCP route's two ends.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from multidict import CIMultiDict

from policies import mcp
from policies.breaker import Breaker
from policies.cache import StaleCache
from policies.chain import build_chain, reader
from policies.core.clock import Clock
from policies.core.credentials import empty_credential
from policies.core.flow import Classifier, Flow, Handler, Policy, compose, status_outcome
from policies.core.kept import Kept
from policies.core.profile import VendorProfile
from policies.core.route import RouteConfig
from policies.core.section import Build, Provider, SideRequest
from policies.keypool import KeyPool
from policies.retry import Retry
from proxy.config import Config
from proxy.forward import Upstream
from proxy.keys import injected_key
from proxy.metrics import Metrics, RouteMetrics
from proxy.outbound import VendorPool
from proxy.replay import Replays, replays_for

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink


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
    keys: KeyPool | None = None  # the route's key pool (`keys:`), which puts a key on each call
    missing_key: str | None = None  # a credential header configured empty (unset ${VAR:-})
    key_variable: str | None = None  # the variable that header reads (TAVILY_API_KEY)
    # The key the route injects, put in the body fields where the profile also reads one.
    body_key: str | None = None
    calls_setting: str = ""  # the config key of the route's call budget, for its message
    # Fresh hits answered again to identical requests without the chain (proxy/replay.py);
    # None: the route's chain does not allow it.
    replays: Replays | None = None

    @property
    def name(self) -> str:
        return self.config.name


@dataclass
class Deps:
    """What routes are built from, besides their own config."""

    config: Config
    vendors: VendorPool
    clock: Clock
    metrics: Metrics
    redis: RedisLink | None
    # Every route of the app by name, filled in as they are built (failover looks up its
    # fallbacks when first needed), and the app-wide parts policies share across routes.
    routes: dict[str, Route] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    # The routes' stateful parts, handed the previous build's on a config reload.
    kept: Kept = field(default_factory=Kept)
    # The route of a name serving now (after a reload, the newest build's): a breaker kept by a
    # reload sends its probes with the headers configured now. None: `routes`.
    serving: Callable[[str], Route | None] | None = None


def as_provider(route: Route, clock: Clock, profile: VendorProfile | None = None) -> Provider:
    """A route with a search section, as a provider of failover, hedging and /v1/search; or
    any route as `profile`'s vendor (a /v1/fetch provider reaching that vendor's extract API)."""
    profile = profile or route.profile
    assert profile is not None  # config only accepts routes with a search section
    breaker = route.breaker

    def circuit_open() -> float | None:
        if breaker is None or breaker.state != "open":
            return None
        return breaker.seconds_until_half_open()

    return Provider(
        name=route.name,
        profile=profile,
        handler=route.handler,
        classify=route.classify,
        headers=route.set_headers,
        total=route.config.timeouts.total,
        clock=clock,
        missing_key=route.missing_key,
        circuit_open=circuit_open,
        key_variable=route.key_variable,
    )


def _providers(deps: Deps) -> Callable[[Sequence[str]], Callable[[], Sequence[Provider]]]:
    """Routes by name as providers, resolved on first use (a fallback may be built later)."""

    def named(names: Sequence[str]) -> Callable[[], Sequence[Provider]]:
        found: list[Provider] = []

        def providers() -> Sequence[Provider]:
            if not found:
                found.extend(as_provider(deps.routes[name], deps.clock) for name in names)
            return found

        return providers

    return named


def _side_request(cfg: RouteConfig, deps: Deps) -> SideRequest:
    """One attempt of `timeouts.per_try` through the route's own upstream, with the built
    route's outbound headers (its credentials from the environment, empty ones left out); it
    returns the vendor's status, or raises the errors a request's attempt would."""
    upstream = Upstream(cfg, deps.vendors, deps.clock)
    numbers = itertools.count(1)
    # Not `deps`: a breaker kept by reloads would hold this build's routes (their caches).
    lookup = deps.serving or deps.routes.get
    clock = deps.clock

    async def send(method: str, target: str, body: bytes) -> int:
        route = lookup(cfg.name)
        headers: CIMultiDict[str] = CIMultiDict(route.set_headers if route is not None else ())
        if body:
            headers["Content-Type"] = "application/json"
        path, _, query = target.partition("?")
        if route is not None and route.keys is not None:  # a key of the pool, in its slot
            name, value = route.keys.side_key()
            if route.keys.slot.kind == "query":
                query = "&".join(p for p in (query, urlencode({name: value})) if p)
            else:
                headers[name] = value
        now = clock.now()
        flow = Flow.new(
            route=cfg.name,
            method=method,
            path=path,
            query_string=query,
            headers=headers,
            body=body,
            request_id=f"breaker-probe-{next(numbers)}",
            client="",
            deadline=now + cfg.timeouts.per_try,
            started=now,
        )
        reply = await upstream(flow)
        reply.discard()  # a streamed answer's connection goes back; nobody reads the body
        return reply.status

    return send


def build_route(cfg: RouteConfig, deps: Deps) -> Route:
    """Compose one route's policies, in the chain's order, around its upstream."""
    read = reader(cfg, deps.config.profiles)
    build = Build(
        route=read.route,
        clock=deps.clock,
        events=deps.metrics,
        redis=deps.redis,
        profile=read.profile,
        classify=read.classify,
        providers=_providers(deps),
        side_request=_side_request(cfg, deps),
        shared=deps.shared,
        kept=deps.kept,
    )
    policies = build_chain(build)
    metrics = deps.metrics.route(cfg.name)
    upstream = Upstream(cfg, deps.vendors, deps.clock, observe=metrics.upstream_duration.observe)
    handler: Handler = compose(policies, upstream)
    profile = read.profile
    mcp_cfg = cfg.get(mcp.SECTION)
    if mcp_cfg is not None:
        # Tool calls of idempotent tools go through the chain; a session's own messages
        # through its retries; everything else straight up.
        handler = mcp.build_route(
            cfg.name,
            mcp_cfg,
            policies=policies,
            upstream=upstream,
            retry=next((p for p in policies if isinstance(p, Retry)), None),
            clock=deps.clock,
            redis=deps.redis,
            cached=cfg.has("cache"),
        )
        profile = None  # no vendor dialect: the answers are JSON-RPC
    keys = next((p for p in policies if isinstance(p, KeyPool)), None)
    missing = next((k for k, v in cfg.headers.set.items() if empty_credential(k, v)), None)
    if cfg.has("keys"):  # the pool is the route's key, or with every key unset, none is
        slot = profile.key_slot if keys is None and profile is not None else None
        missing = None if keys is not None else (slot.name if slot else "keys")
    set_headers = tuple((k, v) for k, v in cfg.headers.set.items() if not empty_credential(k, v))
    return Route(
        config=cfg,
        handler=handler,
        metrics=metrics,
        set_headers=set_headers,
        body_key=injected_key(profile, set_headers) if profile and profile.key_fields else None,
        calls_setting=f"routes.{cfg.name}.max_calls_per_request",
        keys=keys,
        missing_key=missing,
        key_variable=cfg.headers.variables.get(missing) if missing is not None else None,
        remove_headers=frozenset(h.lower() for h in cfg.headers.remove),
        policies=policies,
        classify=read.classify,
        profile=profile,
        cache=next((p for p in policies if isinstance(p, StaleCache)), None),
        breaker=next((p for p in policies if isinstance(p, Breaker)), None),
        replays=None if mcp_cfg is not None else replays_for(policies),
    )

"""What the app builds from one config and serves as a whole: the routes, the router, the search
and fetch APIs (with the direct fetcher), the client gate and the admin endpoints. Built at
start-up and again by each reload, which hands it the previous generation so the routes'
stateful parts live on where unchanged."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import structlog

from policies import ratelimit
from policies.breaker import Breaker
from policies.core.clock import Clock
from policies.core.kept import Kept
from policies.quota import DailyQuota, QuotaStore, quota_store
from proxy.admin import Admin, admin_token
from proxy.clients import ClientGate, keyless_routes
from proxy.config import Config
from proxy.direct import DirectHooks, DirectReader
from proxy.echo import EchoGuard, held_secrets
from proxy.fetch_api import FetchApi
from proxy.metrics import Metrics
from proxy.outbound import VendorPool
from proxy.pipeline import Deps, Route, build_route
from proxy.routing import Router
from proxy.search_api import SearchApi

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

log = structlog.get_logger("search_proxy")


@dataclass
class Generation:
    """One config's routes and the app-wide parts built over them."""

    config: Config
    routes: dict[str, Route]
    router: Router[Route]
    search_api: SearchApi
    fetch_api: FetchApi  # /v1/fetch and the MCP fetch_page tool
    direct: DirectReader | None  # fetch_api.direct's fetcher, when enabled
    openapi_json: bytes  # GET /openapi.json: /v1/search's document, and /v1/fetch's
    admin: Admin
    clients: ClientGate | None  # None: `clients:` not configured, callers not identified
    kept: Kept  # the routes' stateful parts, for the next generation to reuse
    shared: dict[str, Any] = field(default_factory=dict)  # policies' app-wide parts
    quotas: QuotaStore | None = None  # the clients' daily counts, kept by every reload
    # The secrets this config holds, kept out of every answer (proxy/echo.py).
    echo: EchoGuard = field(default_factory=lambda: EchoGuard(()))

    def breakers(self) -> list[Breaker]:
        return [route.breaker for route in self.routes.values() if route.breaker is not None]

    async def start(self) -> None:
        """Start the breakers' background tasks (a breaker kept from before runs already) and
        the direct fetcher (one kept from before is open already)."""
        for breaker in self.breakers():
            await breaker.start()
        if self.direct is not None:
            await self.direct.start()

    async def release(self, successor: Generation | None) -> None:
        """Stop the background tasks of the breakers `successor` does not keep (every one at
        shutdown), and the direct fetcher unless it keeps it; requests still running on this
        generation finish on its chains."""
        keeping = {id(b) for b in successor.breakers()} if successor is not None else set()
        for breaker in self.breakers():
            if id(breaker) not in keeping:
                await breaker.stop()
        if self.direct is not None and (successor is None or successor.direct is not self.direct):
            await self.direct.close()


def build_generation(
    config: Config,
    vendors: VendorPool,
    clock: Clock,
    metrics: Metrics,
    redis: RedisLink | None,
    *,
    previous: Generation | None = None,
    serving: Callable[[str], Route | None] | None = None,
    direct_hooks: DirectHooks | None = None,
) -> Generation:
    """Build every route of `config` and what serves them; with `previous`, reuse its routes'
    stateful parts made from unchanged settings. Nothing is started (`Generation.start`)."""
    deps = Deps(
        config,
        vendors,
        clock,
        metrics,
        redis,
        shared=previous.shared if previous is not None else {},
        kept=Kept(previous.kept if previous is not None else None),
        serving=serving,
    )
    for name, cfg in config.routes.items():
        deps.routes[name] = build_route(cfg, deps)
    deps.kept.built()
    routes = deps.routes
    quotas = previous.quotas if previous is not None else None
    if quotas is None:
        quotas = quota_store(clock, redis)
    search_api = SearchApi(config.search_api, routes, metrics, clock)
    direct = None
    if config.fetch_api.direct.enabled:
        # The same settings keep the same fetcher (its session), so no fetch under way is cut.
        same = previous is not None and previous.config.fetch_api.direct == config.fetch_api.direct
        direct = previous.direct if same and previous is not None else None
        direct = direct or DirectReader(config.fetch_api.direct, clock, direct_hooks)
    _warn_missing_keys(routes, config.search_api.providers)
    fetch_api = FetchApi(config, routes, metrics, clock, redis, direct)
    document = fetch_api.describe(search_api.document)
    return Generation(
        config=config,
        routes=routes,
        router=Router([(r.config.prefix, r) for r in routes.values()]),
        search_api=search_api,
        fetch_api=fetch_api,
        direct=direct,
        openapi_json=orjson.dumps(document, option=orjson.OPT_INDENT_2),
        admin=Admin(routes, admin_token(config.server), config.server.admin_names),
        clients=_client_gate(config, routes, quotas, metrics),
        kept=deps.kept,
        shared=deps.shared,
        quotas=quotas,
        echo=EchoGuard(held_secrets(config)),
    )


def _client_gate(
    config: Config, routes: dict[str, Route], quotas: QuotaStore, metrics: Metrics
) -> ClientGate | None:
    """The client gate when `clients:` is configured; warnings for what it leaves open."""
    if not config.clients:
        for name, cfg in config.routes.items():
            limit = cfg.get(ratelimit.SECTION)
            if limit is not None and limit.key == "client":
                log.warning(
                    "client_key_unverified",
                    route=name,
                    hint="rate_limit.key: client keys on credentials any caller can make up; "
                    "configure clients: to identify callers",
                )
        return None
    limits = {n: c.daily_requests for n, c in config.clients.items() if c.daily_requests}
    gate = ClientGate(config.clients, DailyQuota(limits, quotas), metrics)
    for name in keyless_routes(routes):
        log.warning(
            "route_injects_no_key",
            route=name,
            hint="with clients configured the agent's token is not forwarded: set the vendor "
            "key in this route's headers.set, or its vendor answers without one",
        )
    return gate


def _warn_missing_keys(routes: Mapping[str, Route], providers: Sequence[str]) -> None:
    """One warning naming what to set for each provider of /v1/search and /mcp that has no key
    of its own (its key's variable unset): both skip it, and otherwise only a request refused
    for it would say so. Every generation warns: a reload can add such a provider."""
    unkeyed = {
        name: route.key_variable or f"routes.{name}.headers.set.{route.missing_key}"
        for name in providers
        if (route := routes.get(name)) is not None and route.missing_key is not None
    }
    if unkeyed:
        log.warning(
            "providers_without_key",
            providers=unkeyed,
            hint="POST /v1/search and /mcp skip these providers: export each variable before "
            "starting the proxy (a /v1/search request's credentials can stand in); their own "
            "routes pass the agent's key through",
        )

"""Start-up's constructions from a config, done without sockets or Redis commands, so that
`check-config` refuses whatever start-up would, and serving refuses it before the port opens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import aiohttp
import structlog

from policies.core.clock import SYSTEM_CLOCK
from policies.core.redislink import RedisLink
from policies.quota import DailyQuota, MemoryQuotas
from proxy.admin import Admin, admin_token
from proxy.clients import ClientGate
from proxy.config import Config, ConfigError, ConfigErrors
from proxy.metrics import Metrics
from proxy.pipeline import Deps, Route, build_route
from proxy.routing import Router
from proxy.search_api import SearchApi


async def check_startup(config: Config, *, whole: bool = True) -> None:
    """Build the Redis link, every route, the router, the search API, the client gate and the
    admin endpoints as `proxy.app` does at start-up, then drop them. A constructor's ValueError
    (its way of refusing a value) becomes a ConfigError naming the section it came from; weak
    tokens and an admin listener off loopback without a token are refused too. `whole=False`:
    `config` is what parsed of a config with mistakes (InvalidConfig.partial); the parts built
    from every route together (router, search API, admin) are left to the config once fixed."""
    errors: list[ConfigError] = []
    metrics = Metrics()
    for check in (
        lambda: admin_token(config.server),
        lambda: ClientGate(config.clients, DailyQuota({}, MemoryQuotas(SYSTEM_CLOCK)), metrics),
    ):
        try:
            check()
        except ConfigError as exc:
            errors.append(exc)
    redis: RedisLink | None = None
    if config.redis is not None:
        try:  # the client parses its URL's options here; it connects only on the first command
            redis = RedisLink(config.redis, config.redis.key_prefix, timeout=config.redis.timeout)
        except ValueError as exc:
            where = "redis" if config.redis.url is None else "redis.url"
            errors.append(ConfigError(where, f"start-up cannot use it: {exc}"))
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            deps = Deps(config, session, SYSTEM_CLOCK, metrics, redis)
            for name, route in config.routes.items():
                try:
                    deps.routes[name] = build_route(route, deps)
                except ValueError as exc:
                    errors.append(ConfigError(f"routes.{name}", f"start-up cannot build it: {exc}"))
            if whole and not errors:
                Router([(r.config.prefix, r) for r in deps.routes.values()])
                SearchApi(config.search_api, deps.routes, metrics, SYSTEM_CLOCK)
                Admin(deps.routes, config.server.admin_token)
    finally:
        if redis is not None:
            await redis.close()
    if errors:
        raise ConfigErrors(errors)


def warn_missing_keys(routes: Mapping[str, Route], providers: Sequence[str]) -> None:
    """One warning naming what to set for each provider of /v1/search and /mcp that has no key
    of its own (its key's variable unset): both skip it, and otherwise only a request refused
    for it would say so."""
    unkeyed = {
        name: route.key_variable or f"routes.{name}.headers.set.{route.missing_key}"
        for name in providers
        if (route := routes.get(name)) is not None and route.missing_key is not None
    }
    if unkeyed:
        structlog.get_logger("search_proxy").warning(
            "providers_without_key",
            providers=unkeyed,
            hint="POST /v1/search and /mcp skip these providers: export each variable before "
            "starting the proxy (a /v1/search request's credentials can stand in); their own "
            "routes pass the agent's key through",
        )

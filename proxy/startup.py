"""Start-up's constructions from a config, done without sockets or Redis commands, so that
`check-config` refuses whatever start-up would, and serving refuses it before the port opens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from policies.core.clock import SYSTEM_CLOCK
from policies.quota import DailyQuota, MemoryQuotas
from proxy.admin import Admin, admin_token
from proxy.clients import ClientGate
from proxy.config import Config, ConfigError, ConfigErrors
from proxy.metrics import Metrics
from proxy.outbound import VendorPool
from proxy.pipeline import Deps, build_route
from proxy.routing import Router
from proxy.search_api import SearchApi

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink


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
        from policies.core.redislink import RedisLink  # redis-py: loaded only when configured

        try:  # the client parses its URL's options here; it connects only on the first command
            redis = RedisLink(config.redis, config.redis.key_prefix, timeout=config.redis.timeout)
        except ValueError as exc:
            where = "redis" if config.redis.url is None else "redis.url"
            errors.append(ConfigError(where, f"start-up cannot use it: {exc}"))
    vendors = VendorPool(0, 0, 0)  # never connects: routes are built, not called
    try:
        deps = Deps(config, vendors, SYSTEM_CLOCK, metrics, redis)
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
        vendors.close()
        if redis is not None:
            await redis.close()
    if errors:
        raise ConfigErrors(errors)


async def startup_errors(partial: Config) -> tuple[ConfigError, ...]:
    """What start-up refuses in the parts of a broken config that parsed (a weak token ...)."""
    try:
        await check_startup(partial, whole=False)
    except ConfigErrors as exc:
        return exc.errors
    return ()

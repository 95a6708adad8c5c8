"""Building each route, once at start-up, into its chain of policies around the upstream call.

The order is fixed and documented (README, "How a request flows"):

    search guard -> cache -> breaker -> search recovery -> retry -> rate limit -> upstream

The cache sits outside the breaker and the limiter so that an open circuit or a refused token
can still be answered stale; the limiter sits inside the retry loop so every attempt, and only
attempts that reach the vendor, spends a token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp

from policies.clock import Clock
from policies.events import Events
from policies.flow import Handler, Policy, compose
from policies.retry import NO_RETRY, Retry
from policies.shared import RedisLink
from proxy.config import Config, RouteConfig
from proxy.forward import Upstream
from proxy.metrics import Metrics, RouteMetrics


@dataclass
class Route:
    """A route as the server runs it: its config, its composed chain and its stateful parts."""

    config: RouteConfig
    handler: Handler
    metrics: RouteMetrics
    set_headers: tuple[tuple[str, str], ...]
    remove_headers: frozenset[str]
    policies: list[Policy] = field(default_factory=list)
    breaker: Any = None
    cache: Any = None
    profile: Any = None

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


def build_route(cfg: RouteConfig, deps: Deps) -> Route:
    """Compose one route's policies, in the documented order, around its upstream."""
    events: Events = deps.metrics
    policies: list[Policy] = [
        Retry(
            cfg.name,
            cfg.retry or NO_RETRY,
            per_try=cfg.timeouts.per_try,
            clock=deps.clock,
            events=events,
        )
    ]
    metrics = deps.metrics.route(cfg.name)
    upstream = Upstream(cfg, deps.session, deps.clock, observe=metrics.upstream_duration.observe)
    return Route(
        config=cfg,
        handler=compose(policies, upstream),
        metrics=metrics,
        set_headers=tuple(cfg.headers.set.items()),
        remove_headers=frozenset(h.lower() for h in cfg.headers.remove),
        policies=policies,
    )

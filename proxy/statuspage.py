"""The admin listener's status page (`GET /`) and its data (`GET /admin/status`): routes, the
/v1/search and /mcp endpoints and providers, Redis, version and config. Nothing shown is a
secret: upstreams print redacted, errors are the proxy's own messages, redacted again."""

from __future__ import annotations

import base64
import hashlib
import math
import time
from collections.abc import Iterable
from typing import Any

import orjson
from aiohttp import web
from prometheus_client.registry import Collector

from policies.cache import MemoryStore, TieredStore
from policies.core.settings import rate_text
from policies.hedge import Hedge
from policies.ratelimit import RateLimit
from proxy import __version__
from proxy.fleet import FLEET, status_note
from proxy.pipeline import Route
from proxy.redact import redact_url
from proxy.reload import RELOADER
from proxy.state import STATE, ProxyState
from proxy.statushtml import PAGE, SCRIPT, STYLE

STARTED = time.monotonic()
# Below this share of successful answers a route shows as degraded.
DEGRADED_BELOW_PCT = 90.0


def _digest(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


# The page runs its own script and style only, and talks to this listener only.
CSP = (
    f"default-src 'none'; script-src '{_digest(SCRIPT)}'; style-src '{_digest(STYLE)}'; "
    "connect-src 'self'; img-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
BODY = PAGE.replace("{style}", STYLE).replace("{script}", SCRIPT).encode()


def _by_route(metric: Collector) -> dict[str, dict[str, float]]:
    """A counter's totals by route, then by its last label (summed over any in between)."""
    found: dict[str, dict[str, float]] = {}
    for family in metric.collect():
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            labels = list(sample.labels.values())
            per = found.setdefault(sample.labels["route"], {})
            per[labels[-1]] = per.get(labels[-1], 0.0) + sample.value
    return found


def _gauges(metric: Collector) -> dict[str, float]:
    return {s.labels["route"]: s.value for family in metric.collect() for s in family.samples}


def _first(policies: Iterable[object], kind: type[Any]) -> Any:
    return next((p for p in policies if isinstance(p, kind)), None)


def _breaker(route: Route) -> dict[str, Any] | None:
    breaker = route.breaker
    if breaker is None:
        return None
    return {
        "state": breaker.state,
        "for_s": round(breaker.seconds_in_state(), 1),
        "retry_in_s": round(breaker.seconds_until_half_open(), 1),
        "level": breaker.level,
    }


def _limiter(route: Route) -> dict[str, Any] | None:
    limit: RateLimit | None = _first(route.policies, RateLimit)
    if limit is None:
        return None
    tokens = limit.tokens()
    return {
        "rate": rate_text(limit.config.rate),
        "burst": limit.config.burst,
        "per_client": limit.config.key == "client",
        "tokens": None if tokens is None else round(max(tokens, 0.0), 1),
        # A bucket below 0 holds tokens reserved by requests waiting for them.
        "queued": None if tokens is None else max(0, math.ceil(-tokens)),
    }


def _cache(route: Route, hit_pct: float | None) -> dict[str, Any] | None:
    if route.cache is None:
        return None
    store = route.cache.store
    local = store.local if isinstance(store, TieredStore) else store
    entries = len(local) if isinstance(local, MemoryStore) else None
    return {"entries": entries, "hit_pct": hit_pct}


def _colour(status: dict[str, Any]) -> str:
    """ok, warn, bad or idle: how the route reads at a glance."""
    breaker = status.get("breaker") or {}
    if breaker.get("state") == "open":
        return "bad"
    success = status.get("success_pct")
    limiter = status.get("limiter") or {}
    if (
        breaker.get("state") == "half_open"
        or status.get("missing_key")
        or (success is not None and success < DEGRADED_BELOW_PCT)
        or (limiter.get("queued") or 0) > 0
    ):
        return "warn"
    return "ok" if status.get("requests_per_s") else "idle"


def route_status(
    state: ProxyState,
    route: Route,
    in_flight: dict[str, float],
    hedges: dict[str, dict[str, float]],
    failovers: dict[str, dict[str, float]],
) -> dict[str, Any]:
    """One route as the page shows it."""
    assert state.pulse is not None
    name = route.name
    numbers = state.pulse.numbers(name)
    hit_pct = numbers.pop("cache_hit_pct")
    status: dict[str, Any] = {
        "name": name,
        "prefix": route.config.prefix,
        "upstream": redact_url(route.config.upstream),
        "vendor": route.profile.name if route.profile is not None else None,
        **numbers,
        "in_flight": int(in_flight.get(name, 0)),
        "missing_key": route.missing_key,
        "breaker": _breaker(route),
        "limiter": _limiter(route),
        "cache": _cache(route, hit_pct),
        "hedges": hedges.get(name) if _first(route.policies, Hedge) else None,
        "failovers": failovers.get(name) if route.config.has("fallback") else None,
        "last_errors": state.pulse.recent(name),
    }
    status["colour"] = _colour(status)
    return status


def _provider(name: str, route: Route | None) -> dict[str, Any]:
    """A /v1/search provider: ready, or skipped and why (as /v1/search would skip it)."""
    if route is None:
        return {"name": name, "state": "skipped", "why": "no such route"}
    if route.missing_key is not None:
        why = f"no API key configured (its {route.missing_key} header is empty)"
        if route.key_variable is not None:
            why = f"no API key: {route.key_variable} is not set"
        return {"name": name, "state": "skipped", "why": why}
    breaker = route.breaker
    if breaker is not None and breaker.state == "open":
        why = f"circuit open (retry in {breaker.seconds_until_half_open():.0f}s)"
        return {"name": name, "state": "skipped", "why": why}
    return {"name": name, "state": "ready", "why": None}


def status_document(state: ProxyState, last_reload: dict[str, Any] | None) -> dict[str, Any]:
    """Everything `GET /admin/status` answers (and the page draws); `last_reload`: the report
    of the last reload, if any."""
    assert state.pulse is not None
    metrics = state.metrics
    in_flight = _gauges(metrics.in_flight)
    hedges = _by_route(metrics.hedges)
    failovers = _by_route(metrics.failovers)
    routes = [route_status(state, r, in_flight, hedges, failovers) for r in state.routes.values()]
    providers = [_provider(n, state.routes.get(n)) for n in state.config.search_api.providers]
    endpoints = []
    mcp = state.config.mcp_server
    for label, serving in (("/v1/search", True), (mcp.path, mcp.enabled)):
        numbers = state.pulse.numbers(label)
        numbers.pop("cache_hit_pct")
        endpoints.append(
            {
                "name": label,
                "enabled": serving,
                **numbers,
                "in_flight": int(in_flight.get(label, 0)),
                "last_errors": state.pulse.recent(label),
            }
        )
    redis = "not configured"
    if state.redis is not None:
        redis = "up" if state.redis.up else "down"
    return {
        "version": __version__,
        "uptime_s": round(time.monotonic() - STARTED),
        "config": {
            "hash": state.config_hash,
            "path": state.config_path,
            "watch": state.config.server.watch_config and state.config_path is not None,
            "last_reload": last_reload,
        },
        "redis": redis,
        "routes": routes,
        "endpoints": endpoints,
        "providers": providers,
        "errors": state.pulse.recent(),
    }


async def status_endpoint(request: web.Request) -> web.Response:
    """GET /admin/status: the status document, as JSON."""
    state = request.app[STATE]

    async def handle(request: web.Request) -> web.Response:
        last = request.app[RELOADER].last
        document = status_document(state, last.public() if last else None)
        document["worker"] = status_note(request.app.get(FLEET))
        body = orjson.dumps(document)
        return web.Response(
            body=body, content_type="application/json", headers={"Cache-Control": "no-store"}
        )

    assert state.admin is not None
    return await state.admin.answer(request, handle)


async def status_page(request: web.Request) -> web.Response:
    """GET /: the page, which holds no data of its own: its script polls /admin/status (with
    the admin token it asks for when one is configured)."""
    return web.Response(body=BODY, content_type="text/html", charset="utf-8", headers=PAGE_HEADERS)


__all__ = ["CSP", "status_document", "status_endpoint", "status_page"]

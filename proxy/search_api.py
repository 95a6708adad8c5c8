"""`POST /v1/search`: one search API over every configured vendor, with fallback in order.

Each provider is called through its own route and policies (cache, breaker, retries, rate
limit, simplification); a provider whose breaker is open is skipped without a call. Results are
normalised to {title, url, snippet}, deduplicated by URL, filtered and cut to max_results.
Credentials come from each route's `headers.set`: the agent's own headers are never forwarded to
a vendor from here, since one caller's key for one vendor must not reach another.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import orjson
from aiohttp import web
from multidict import CIMultiDict

from policies.backoff import parse_retry_after
from policies.core.clock import Clock
from policies.core.errors import BadRequest, CircuitOpen, ProxyError, seconds_text
from policies.core.flow import Flow
from policies.core.outcome import Outcome
from policies.profiles import (
    build_search_request,
    error_message,
    extract_results,
    normalize_results,
)
from policies.search import TERMINAL_STATUSES
from proxy.config import SearchApiConfig
from proxy.dialects import error_response
from proxy.errors import ProvidersExhausted, ProvidersRefused
from proxy.metrics import Metrics
from proxy.pipeline import Route

MAX_BATCH = 20


@dataclass(slots=True)
class Tried:
    """One provider's part in a search, reported back in `attempts`."""

    provider: str
    query: str
    outcome: str  # results, empty, failed, skipped
    status: int | None
    ms: float
    reason: str = ""  # the sentence used when every provider failed
    retry_after_s: float | None = None
    terminal: bool = False  # a bad key, no credits, no key configured: a retry cannot help

    def public(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "query": self.query,
            "outcome": self.outcome,
            "status": self.status,
            "ms": round(self.ms, 1),
        }


def _field_error(field: str, why: str) -> BadRequest:
    return BadRequest(f"/v1/search: {field} {why}", route="search")


def parse_request(
    body: Any, config: SearchApiConfig, routes: dict[str, Route], max_chars: int
) -> tuple[list[str], int, list[str], bool]:
    """Validate a /v1/search body: (queries, max_results, providers, is_batch)."""
    if not isinstance(body, dict):
        raise _field_error("body", 'must be a JSON object like {"query": "..."}')
    unknown = set(body) - {"query", "queries", "max_results", "providers"}
    if unknown:
        raise _field_error(sorted(unknown)[0], "is not a known field")
    if ("query" in body) == ("queries" in body):
        raise _field_error("query", 'is required (or "queries": [...] for a batch)')
    is_batch = "queries" in body
    queries = body["queries"] if is_batch else [body["query"]]
    if is_batch and (not isinstance(queries, list) or not 0 < len(queries) <= MAX_BATCH):
        raise _field_error("queries", f"must be a list of 1 to {MAX_BATCH} queries")
    for i, q in enumerate(queries):
        name = f"queries[{i}]" if is_batch else "query"
        if not isinstance(q, str):
            raise _field_error(name, "must be text")
        if not q.strip():
            raise _field_error(name, "is empty; send the words to search for")
        if len(q) > max_chars:
            raise _field_error(name, f"is {len(q)} characters, over the limit of {max_chars}")
    max_results = body.get("max_results", config.max_results)
    if (
        isinstance(max_results, bool)
        or not isinstance(max_results, int)
        or not (1 <= max_results <= 50)
    ):
        raise _field_error("max_results", "must be a whole number from 1 to 50")
    providers = body.get("providers", list(config.providers))
    if not isinstance(providers, list) or not providers:
        raise _field_error("providers", "must be a non-empty list of provider names")
    for i, p in enumerate(providers):
        route = routes.get(p) if isinstance(p, str) else None
        if route is None or route.profile is None:
            known = ", ".join(config.providers) or "none configured"
            raise _field_error(f"providers[{i}]", f"is not a search provider (known: {known})")
    return queries, max_results, providers, is_batch


class SearchApi:
    """Runs normalised searches across providers; owned by the app, built at start-up."""

    def __init__(
        self, config: SearchApiConfig, routes: dict[str, Route], metrics: Metrics, clock: Clock
    ) -> None:
        self.config = config
        self.clock = clock
        self.profiles = {n: r.profile for n, r in routes.items() if r.profile is not None}
        self.routes = routes
        self.metrics = metrics
        self.max_chars = min(
            (r.config.search.max_query_chars for r in routes.values() if r.config.search),
            default=2000,
        )

    async def handle(self, request: web.Request) -> web.Response:
        rid = request.headers.get("X-Request-Id") or ""
        try:
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError:
                raise _field_error("body", "is not valid JSON") from None
            queries, max_results, providers, is_batch = parse_request(
                body, self.config, self.routes, self.max_chars
            )
            if not is_batch:
                answer = await self.search(queries[0], max_results, providers, rid)
                return web.json_response(answer, dumps=_dumps)
            answers = await asyncio.gather(
                *(self.search(q, max_results, providers, rid) for q in queries),
                return_exceptions=True,
            )
            out = []
            for a in answers:
                if isinstance(a, ProxyError):
                    out.append(a.payload())
                elif isinstance(a, BaseException):
                    raise a
                else:
                    out.append(a)
            return web.json_response({"responses": out}, dumps=_dumps)
        except ProxyError as err:
            return error_response(err, rid)

    async def search(
        self, query: str, max_results: int, providers: list[str], request_id: str
    ) -> dict[str, Any]:
        """Try providers in order; the first with results answers."""
        tried: list[Tried] = []
        for name in providers:
            route = self.routes[name]
            outcome = await self._try(route, query, max_results, request_id)
            tried.append(outcome.tried)
            self.metrics.provider_fallbacks.labels(name, outcome.tried.outcome).inc()
            if outcome.tried.outcome == "results":
                return {
                    "query": query,
                    "query_used": outcome.query_used,
                    "provider": name,
                    "results": outcome.results,
                    "from_cache": outcome.from_cache,
                    "cache_age_s": outcome.cache_age_s,
                    "attempts": [t.public() for t in tried],
                }
        failures = [t for t in tried if t.outcome in ("failed", "skipped")]
        if len(failures) < len(tried):  # somebody answered, with nothing found
            return {
                "query": query,
                "query_used": query,
                "provider": None,
                "results": [],
                "from_cache": False,
                "cache_age_s": None,
                "attempts": [t.public() for t in tried],
            }
        raise _all_failed(tried)

    async def _try(self, route: Route, query: str, max_results: int, rid: str) -> _Outcome:
        started = self.clock.now()
        if route.missing_key is not None:
            header = route.missing_key
            why = f"has no API key configured (its {header} header is empty: set the variable"
            why += f" in routes.{route.name}.headers.set)"
            return _Outcome(Tried(route.name, query, "skipped", None, 0.0, why, terminal=True))
        breaker = route.breaker
        if breaker is not None and breaker.state == "open":
            wait = breaker.seconds_until_half_open()
            return _Outcome(
                Tried(
                    route.name,
                    query,
                    "skipped",
                    None,
                    0.0,
                    f"circuit open (retry in {seconds_text(wait)})",
                    wait,
                )
            )
        flow = self._flow(route, query, max_results, rid)
        try:
            reply = await route.handler(flow)
        except ProxyError as err:
            ms = (self.clock.now() - started) * 1000
            return _Outcome(
                Tried(
                    route.name,
                    flow.query_used or query,
                    "failed",
                    err.upstream_status or err.status,
                    ms,
                    _reason(err),
                    err.retry_after_s,
                )
            )
        ms = (self.clock.now() - started) * 1000
        used = flow.query_used or query
        outcome = route.classify(reply)
        if outcome is Outcome.OK:
            try:
                data = orjson.loads(reply.body)
            except orjson.JSONDecodeError:
                data = None
            results = normalize_results(
                extract_results(self.profiles[route.name], data),
                max_results=max_results,
                blocked_domains=self.config.blocked_domains,
                blocked_extensions=self.config.blocked_extensions,
            )
            if results:
                age = reply.headers.get("Age")
                return _Outcome(
                    Tried(route.name, used, "results", reply.status, ms),
                    results=[
                        {"title": r.title, "url": r.url, "snippet": r.snippet} for r in results
                    ],
                    query_used=used,
                    from_cache=flow.cache in ("hit", "stale"),
                    cache_age_s=int(age) if age and age.isdigit() else None,
                )
            return _Outcome(Tried(route.name, used, "empty", reply.status, ms))
        if outcome is Outcome.EMPTY:
            return _Outcome(Tried(route.name, used, "empty", reply.status, ms))
        if outcome is Outcome.TERMINAL or reply.status in TERMINAL_STATUSES:
            said = error_message(reply.body)
            reason = f"{reply.status}" + (f" ({said})" if said else "")
            return _Outcome(
                Tried(route.name, used, "failed", reply.status, ms, reason, terminal=True)
            )
        asked = parse_retry_after(reply.headers.get("Retry-After"), self.clock.wall())
        reason = f"{reply.status}" + (f" (retry after {seconds_text(asked)})" if asked else "")
        return _Outcome(Tried(route.name, used, "failed", reply.status, ms, reason, asked))

    def _flow(self, route: Route, query: str, max_results: int, rid: str) -> Flow:
        sr = build_search_request(self.profiles[route.name], query, max_results)
        headers: CIMultiDict[str] = CIMultiDict(route.set_headers)
        headers.update(sr.headers)
        body = b""
        if sr.json_body is not None:
            body = orjson.dumps(sr.json_body)
            headers["Content-Type"] = "application/json"
        if rid:
            headers["X-Request-Id"] = rid
        now = self.clock.now()
        return Flow(
            route=route.name,
            method=sr.method,
            path=sr.path,
            query_string=urlencode(sr.query_params),
            headers=headers,
            body=body,
            request_id=rid,
            client="",
            deadline=now + route.config.timeouts.total,
            started=now,
        )


@dataclass(slots=True)
class _Outcome:
    tried: Tried
    results: list[dict[str, str]] | None = None
    query_used: str | None = None
    from_cache: bool = False
    cache_age_s: int | None = None


def _all_failed(tried: list[Tried]) -> ProxyError:
    """The error when no provider answered: a retry-later one, or a do-not-retry one when every
    provider refused for good (bad key, no credits, no key configured)."""
    reasons = ", ".join(f"{t.provider} {t.reason}" for t in tried)
    status = next((t.status for t in tried if t.status is not None), None)
    refused = [t.provider for t in tried if t.terminal]
    if len(refused) == len(tried):
        return ProvidersRefused(
            f"All {len(tried)} providers refused the request: {reasons}. Retrying will not help:"
            " check each provider's API key and plan, or send providers that have one.",
            route="search",
            attempts=len(tried),
            upstream_status=status,
        )
    waits = [t.retry_after_s for t in tried if t.retry_after_s is not None]
    retry_in = min(waits) if waits else None
    advice = f"Retry in {seconds_text(retry_in)}." if retry_in is not None else "Retry shortly."
    if refused:
        advice += f" ({', '.join(refused)} will not recover on a retry: check key and plan.)"
    return ProvidersExhausted(
        f"All {len(tried)} providers failed: {reasons}. {advice}",
        route="search",
        attempts=len(tried),
        upstream_status=status,
        retry_after_s=retry_in,
    )


def _reason(err: ProxyError) -> str:
    """A provider's failure in a few words: 'timed out after 10s', 'circuit open (retry in 27s)'."""
    if err.retry_after_s is None or err.retry_after_s <= 0:
        return err.reason
    when = "in" if isinstance(err, CircuitOpen) else "after"
    return f"{err.reason} (retry {when} {seconds_text(err.retry_after_s)})"


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()

"""`POST /v1/fetch`: the pages an agent chose, read through the vendors' extract APIs (Tavily
extract, Exa contents, Firecrawl scrape, Jina reader) and the direct fetcher, in one shape."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from aiohttp import web

from policies.cache import CacheConfig, request_directives
from policies.core.clock import Clock
from policies.core.errors import BadRequest, ProxyError, seconds_text
from policies.core.flow import CallBudget
from policies.fetch import (
    PAGE_FORMATS,
    Asking,
    FetchCall,
    Fetched,
    FetchEngine,
    Miss,
    Page,
    PageCache,
    Reader,
    RouteReader,
    canonical_url,
    check_url,
)
from proxy.bodies import read_json
from proxy.config.fetch import DIRECT, FetchApiConfig, extract_vendor
from proxy.config.sections import Config
from proxy.dialects import error_response, json_answer
from proxy.errors import NotFound
from proxy.fetch_openapi import fetch_schemas, with_fetch
from proxy.metrics import Metrics
from proxy.pipeline import Route, as_provider

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

FIELDS = ("urls", "format", "max_chars", "providers")
# Names agents try that are not ours, and the field they mean.
_DID_YOU_MEAN = {
    "url": "urls",
    "links": "urls",
    "output_format": "format",
    "max_length": "max_chars",
    "max_characters": "max_chars",
    "provider": "providers",
}


@dataclass(slots=True)
class FetchTrace:
    """What one /v1/fetch request did, for its access-log line."""

    urls: int = 0
    providers: list[str] = field(default_factory=list)  # asked (not skipped), in order
    calls: int = 0  # vendor calls made, retries included, and direct fetches
    pages: int = 0  # URLs answered with a page
    cached: int = 0  # of them, from the page cache


@dataclass(frozen=True, slots=True)
class FetchRequest:
    """A validated /v1/fetch body."""

    call: FetchCall
    max_chars: int


def _field_error(name: str, why: str, endpoint: str) -> BadRequest:
    return BadRequest(f"{endpoint}: {name} {why}", route="fetch")


def parse_request(body: Any, config: FetchApiConfig, endpoint: str = "/v1/fetch") -> FetchRequest:
    """Validate a /v1/fetch body; every mistake is a 400 naming the field at fault."""
    if not isinstance(body, dict):
        raise _field_error("body", 'must be a JSON object like {"urls": ["https://..."]}', endpoint)
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        name = unknown[0]
        hint = f'; did you mean "{_DID_YOU_MEAN[name]}"?' if name in _DID_YOU_MEAN else ""
        why = f"is not a known field (known: {', '.join(FIELDS)}){hint}"
        raise _field_error(name, why, endpoint)
    urls = body.get("urls")
    if not isinstance(urls, list) or not 0 < len(urls) <= config.max_urls:
        why = f"must be a list of 1 to {config.max_urls} URLs (fetch_api.max_urls)"
        raise _field_error("urls", why, endpoint)
    seen: dict[str, int] = {}
    for i, url in enumerate(urls):
        problem = check_url(url)
        if problem is not None:
            raise _field_error(f"urls[{i}]", problem, endpoint)
        form = canonical_url(url)
        if form in seen:
            why = f"is the page of urls[{seen[form]}] again: name each page once"
            raise _field_error(f"urls[{i}]", why, endpoint)
        seen[form] = i
    fmt = body.get("format", "markdown")
    if fmt not in PAGE_FORMATS:
        raise _field_error("format", f"must be one of {', '.join(PAGE_FORMATS)}", endpoint)
    max_chars = body.get("max_chars", config.max_chars)
    if (
        isinstance(max_chars, bool)
        or not isinstance(max_chars, int)
        or not 1 <= max_chars <= config.max_page_chars
    ):
        why = f"must be a whole number from 1 to {config.max_page_chars} (fetch_api.max_page_chars)"
        raise _field_error("max_chars", why, endpoint)
    known = ", ".join(config.providers)
    providers = body.get("providers", list(config.providers))
    if not isinstance(providers, list) or not providers:
        raise _field_error(
            "providers", f"must be a non-empty list of providers ({known})", endpoint
        )
    for i, name in enumerate(providers):
        if not isinstance(name, str) or name not in config.providers:
            raise _field_error(
                f"providers[{i}]", f"is not a fetch provider (known: {known})", endpoint
            )
        if name in providers[:i]:
            raise _field_error(f"providers[{i}]", f"repeats {name!r}: name each once", endpoint)
    return FetchRequest(FetchCall(tuple(urls), fmt, tuple(providers)), max_chars)


class FetchApi:
    """Reads pages for /v1/fetch and the MCP fetch_page tool; owned by the app, built at
    start-up over the routes (and the direct fetcher, when enabled).

    Each URL goes to the providers in `fetch_api.providers` order until one reads it; a vendor
    is asked through its own route (breaker, limiter, retries, hedging, key), several URLs a
    call where it takes a batch. Pages are cached by canonical URL and format for every caller.
    The answer lists every URL asked, in `results` or in `failed`, each failure with what each
    provider said. `GET /openapi.json` describes it.
    """

    def __init__(
        self,
        config: Config,
        routes: Mapping[str, Route],
        metrics: Metrics,
        clock: Clock,
        redis: RedisLink | None,
        direct: Reader | None = None,
    ) -> None:
        self.config = cfg = config.fetch_api
        self.metrics = metrics
        self.clock = clock
        readers: dict[str, Reader] = {}
        for name in cfg.providers:
            if name == DIRECT:
                assert direct is not None  # built whenever the config lists it
                readers[name] = direct
                continue
            route = routes[name]
            profile = extract_vendor(name, route.config, cfg, config.profiles)
            assert profile is not None and profile.extract is not None  # config checked both
            readers[name] = RouteReader(as_provider(route, clock, profile), profile.extract)
        cache = None
        if cfg.cache.enabled:
            c = cfg.cache
            store = CacheConfig(
                ttl=c.ttl,
                stale_ttl=c.stale_ttl,
                max_entry_bytes=c.max_entry_bytes,
                max_entries=c.max_entries,
                max_bytes=c.max_bytes,
            )
            cache = PageCache.build(store, redis, clock, metrics)
        self.engine = FetchEngine(
            readers,
            cache,
            clock,
            max_parallel=cfg.max_parallel,
            max_page_chars=cfg.max_page_chars,
        )
        self.schemas = fetch_schemas(
            max_urls=cfg.max_urls,
            max_chars=cfg.max_chars,
            max_page_chars=cfg.max_page_chars,
            providers=cfg.providers,
        )

    @property
    def enabled(self) -> bool:
        return bool(self.config.providers)

    def describe(self, document: Mapping[str, Any]) -> dict[str, Any]:
        """The OpenAPI document `document` with /v1/fetch in it (as it is, when off)."""
        return with_fetch(document, self.schemas) if self.enabled else dict(document)

    async def handle(
        self, request: web.Request, rid: str, trace: FetchTrace, client: str = ""
    ) -> web.Response:
        """Answer one POST /v1/fetch; `trace` records what it did. `Cache-Control: no-cache`
        reads every page anew (the cache still stands in for a failure); `no-store` also
        leaves the cache as it was."""
        try:
            body = await read_json(request, "/v1/fetch", "fetch")
            directives = request_directives(request.headers)
            answer = await self.answer(
                body,
                rid,
                trace,
                client,
                fresh_ok=not (directives.no_cache or directives.no_store),
                store=not directives.no_store,
            )
            return json_answer(answer)
        except ProxyError as err:
            return error_response(err, rid)

    async def answer(
        self,
        body: Any,
        rid: str,
        trace: FetchTrace,
        client: str = "",
        *,
        fresh_ok: bool = True,
        store: bool = True,
        endpoint: str = "/v1/fetch",
    ) -> dict[str, Any]:
        """The answer to a /v1/fetch body (decoded JSON); raises the ProxyError /v1/fetch
        answers with (a bad field, fetching off). The MCP fetch_page tool reads through here
        (`endpoint` names it in its errors)."""
        if not self.enabled:
            raise NotFound(
                f"{endpoint} has no provider: add a route whose vendor has an extract API "
                "(tavily, exa, firecrawl, jina's reader) or enable fetch_api.direct",
                route="fetch",
            )
        asked = parse_request(body, self.config, endpoint)
        trace.urls = len(asked.call.urls)
        calls = CallBudget(
            self.config.max_calls_per_request,
            "fetch_api.max_calls_per_request",
            "ask for fewer URLs at a time",
        )
        now = self.clock.now()
        asking = Asking(
            request_id=rid,
            deadline=now + self.config.timeout,  # and each call by its route's timeouts.total
            calls=calls,
            client=client,
            max_chars=self.config.max_page_chars,
        )
        try:
            fetched = await self.engine.fetch(asked.call, asking, fresh_ok=fresh_ok, store=store)
        finally:
            trace.calls = calls.spent
        trace.providers = fetched.asked
        self._count(fetched)
        results = [
            _result(fetched.pages[u], asked.max_chars)
            for u in asked.call.urls
            if u in fetched.pages
        ]
        trace.pages = len(results)
        trace.cached = sum(1 for r in results if r["from_cache"])
        failed = [_failure(u, fetched.misses[u]) for u in asked.call.urls if u not in fetched.pages]
        return {"results": results, "failed": failed}

    def _count(self, fetched: Fetched) -> None:
        pages = self.metrics.fetch_pages
        for page in fetched.pages.values():
            outcome = "stale" if page.stale else "cached" if page.from_cache else "fetched"
            pages.labels(page.provider, outcome).inc()
        for misses in fetched.misses.values():
            for miss in misses:
                pages.labels(miss.provider, miss.kind).inc()


def _result(page: Page, max_chars: int) -> dict[str, Any]:
    truncated = page.cut or len(page.content) > max_chars
    return {
        "url": page.url,
        "title": page.title,
        "content": page.content[:max_chars],
        "provider": page.provider,
        "fetched_at": datetime.fromtimestamp(page.fetched_at, UTC).isoformat(timespec="seconds"),
        "format": page.format,
        "truncated": truncated,
        "from_cache": page.from_cache,
    }


def _failure(url: str, misses: list[Miss]) -> dict[str, Any]:
    """A URL no provider read: its error says what each said, and whether to retry."""
    said = "; ".join(f"{m.provider}: {m.reason}" for m in misses) or "no provider was asked"
    kinds = {m.kind for m in misses}
    waits = [m.retry_after_s for m in misses if m.retry_after_s is not None]
    retry = min(waits) if waits and kinds == {"unavailable"} else None
    if "failed" in kinds:
        kind, advice = "page_failed", "No provider could read this page"
    elif "refused" in kinds:
        kind, advice = "page_refused", "The direct fetcher refused this address"
    elif misses and all(m.terminal for m in misses):
        kind = "providers_refused"
        advice = "Every provider refused for good: check their keys and plans"
    else:
        kind = "providers_unavailable"
        when = f"retry in {seconds_text(retry)}" if retry is not None else "retry shortly"
        advice = f"Every provider was unavailable: {when}"
    return {
        "url": url,
        "error": {
            "type": kind,
            "message": f"{advice} ({said}).",
            "retry_after_s": None if retry is None else round(retry, 3),
        },
        "attempts": [
            {"provider": m.provider, "outcome": m.kind, "reason": m.reason} for m in misses
        ],
    }

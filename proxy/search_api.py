"""`POST /v1/search`: one search API over every configured vendor, with fallback in order.

Each provider is called through its own route and policies (cache, breaker, retries, rate
limit, simplification); a provider whose breaker is open is skipped without a call. Unified
options (time range, domains, topic, country, language, safe search) are written into each
vendor's own fields, and the ones a vendor cannot honour are listed in `dropped_options`.
Results are normalised (title, url, snippet, date, score, position, provider), deduplicated by
URL, filtered and cut to max_results. The answer follows LiteLLM's (Perplexity's) search shape.

Credentials: the route's configured key, unless the body's `credentials` carries the agent's own
key for that provider, which then goes to that provider only, in its own header or parameter.
The agent's headers are never forwarded from here. `GET /openapi.json` describes this API.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import orjson
from aiohttp import web
from multidict import CIMultiDict

from policies.backoff import parse_retry_after
from policies.core.clock import Clock
from policies.core.credentials import is_credential_name
from policies.core.errors import BadRequest, CircuitOpen, ProxyError, seconds_text
from policies.core.flow import CallBudget, Flow
from policies.core.options import MAX_DOMAINS, TIME_RANGES
from policies.core.outcome import Outcome
from policies.profiles import (
    OptionError,
    SearchOptions,
    build_search,
    credential_slot,
    error_message,
    extract_details,
    extract_results,
    normalize_results,
    with_credential,
)
from policies.search import SECTION as SEARCH
from policies.search import TERMINAL_STATUSES
from proxy.config import SearchApiConfig
from proxy.dialects import error_response
from proxy.errors import ProvidersExhausted, ProvidersRefused
from proxy.metrics import Metrics
from proxy.openapi import openapi_document
from proxy.pipeline import Route

MAX_RESULTS = 50
MAX_KEY_CHARS = 4096
# Set by a route's failover when a fallback answered: the unified options it dropped.
FAILOVER_DROPPED_HEADER = "X-Search-Dropped-Options"

# Request fields: our own, then LiteLLM's / Perplexity's names for the same things.
OPTION_FIELDS = (
    "time_range",
    "include_domains",
    "exclude_domains",
    "topic",
    "country",
    "language",
    "safe_search",
)
ALIASES = {"search_recency_filter": "time_range", "search_domain_filter": "include_domains"}
NOT_HONOURED = ("max_tokens_per_page",)  # accepted for LiteLLM clients, always dropped
FIELDS = (
    "query",
    "queries",
    "max_results",
    "providers",
    *OPTION_FIELDS,
    *ALIASES,
    *NOT_HONOURED,
    "credentials",
)
# Names agents try that are not ours, and the field they mean.
_DID_YOU_MEAN = {
    "q": "query",
    "num": "max_results",
    "num_results": "max_results",
    "count": "max_results",
    "limit": "max_results",
    "domains": "include_domains",
    "provider": "providers",
    "api_key": "credentials",
}


@dataclass(slots=True)
class SearchTrace:
    """What one /v1/search request did, for its access-log line."""

    queries: int = 0
    providers: list[str] = field(default_factory=list)  # tried (not skipped), in order, once
    calls: int = 0  # vendor calls made, retries, variants and failovers included


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
    dropped: tuple[str, ...] = ()  # options this provider could not honour, as the agent named them

    def public(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "query": self.query,
            "outcome": self.outcome,
            "status": self.status,
            "ms": round(self.ms, 1),
            "dropped_options": list(self.dropped),
        }


@dataclass(frozen=True, slots=True)
class SearchCall:
    """A validated /v1/search body: what every query of it is searched with."""

    queries: tuple[str, ...]
    options: SearchOptions
    providers: tuple[str, ...]
    is_batch: bool
    # Unified option -> the field name the agent used (an alias), for dropped_options.
    sent_as: Mapping[str, str] = field(default_factory=dict)
    unsupported: tuple[str, ...] = ()  # accepted fields no provider honours
    # provider -> the agent's own API key for it. Never logged, never sent to another provider.
    credentials: Mapping[str, str] = field(default_factory=dict, repr=False)

    def dropped(self, options: tuple[str, ...]) -> tuple[str, ...]:
        """A provider's dropped options as the agent named them, then the unsupported fields."""
        names = dict.fromkeys(self.sent_as.get(o, o) for o in options)
        return (*names, *self.unsupported)


def _field_error(field: str, why: str) -> BadRequest:
    return BadRequest(f"/v1/search: {field} {why}", route="search")


def parse_request(
    body: Any, config: SearchApiConfig, routes: dict[str, Route], max_chars: int
) -> SearchCall:
    """Validate a /v1/search body; every mistake is a 400 naming the field at fault."""
    if not isinstance(body, dict):
        raise _field_error("body", 'must be a JSON object like {"query": "..."}')
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        name = unknown[0]
        hint = f'; did you mean "{_DID_YOU_MEAN[name]}"?' if name in _DID_YOU_MEAN else ""
        raise _field_error(name, f"is not a known field (see GET /openapi.json){hint}")
    if ("query" in body) == ("queries" in body):
        raise _field_error("query", 'is required (or "queries": [...] for a batch)')
    is_batch = "queries" in body
    queries = body["queries"] if is_batch else [body["query"]]
    if is_batch and (not isinstance(queries, list) or not 0 < len(queries) <= config.max_batch):
        raise _field_error(
            "queries", f"must be a list of 1 to {config.max_batch} queries (search_api.max_batch)"
        )
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
        or not (1 <= max_results <= MAX_RESULTS)
    ):
        raise _field_error("max_results", f"must be a whole number from 1 to {MAX_RESULTS}")
    cap = provider_cap(config, routes)
    providers = body.get("providers", list(config.providers[:cap]))
    if not isinstance(providers, list) or not providers:
        raise _field_error("providers", "must be a non-empty list of provider names")
    if len(providers) > cap:
        raise _field_error(
            "providers",
            f"names {len(providers)} providers; at most {cap} may be named, each once "
            f"({_known(config)})",
        )
    for i, p in enumerate(providers):
        if not _is_provider(p, routes):
            raise _field_error(f"providers[{i}]", f"is not a search provider ({_known(config)})")
        if p in providers[:i]:
            raise _field_error(f"providers[{i}]", f"repeats {p!r}: name each provider once")
    options, sent_as = _options(body, max_results)
    unsupported = []
    for name in NOT_HONOURED:
        if name in body:
            value = body[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _field_error(name, "must be a whole number of at least 1")
            unsupported.append(name)
    return SearchCall(
        queries=tuple(queries),
        options=options,
        providers=tuple(providers),
        is_batch=is_batch,
        sent_as=sent_as,
        unsupported=tuple(unsupported),
        credentials=_credentials(body.get("credentials", {}), config, routes),
    )


def provider_cap(config: SearchApiConfig, routes: dict[str, Route]) -> int:
    """How many providers one request may name, each once: as many as there are routes with a
    search section, or fewer if search_api.max_providers says so."""
    configured = sum(1 for route in routes.values() if route.profile is not None)
    return configured if config.max_providers is None else min(config.max_providers, configured)


def _is_provider(name: Any, routes: dict[str, Route]) -> bool:
    route = routes.get(name) if isinstance(name, str) else None
    return route is not None and route.profile is not None


def _known(config: SearchApiConfig) -> str:
    return "known: " + (", ".join(config.providers) or "none configured")


def _options(body: dict[str, Any], max_results: int) -> tuple[SearchOptions, dict[str, str]]:
    """The unified options of a body, with LiteLLM's / Perplexity's aliases resolved."""
    values: dict[str, Any] = {k: body[k] for k in OPTION_FIELDS if k in body}
    sent_as: dict[str, str] = {}
    for alias, target in ALIASES.items():
        if alias not in body:
            continue
        rivals = (
            ("include_domains", "exclude_domains") if target == "include_domains" else (target,)
        )
        clash = next((k for k in rivals if k in body), None)
        if clash is not None:
            raise _field_error(alias, f'and "{clash}" say the same thing: send one of them')
        if alias == "search_domain_filter":
            values.update(_domain_filter(body[alias]))
            sent_as.update(include_domains=alias, exclude_domains=alias)
        else:
            if body[alias] not in TIME_RANGES:
                raise _field_error(alias, f"must be one of {', '.join(TIME_RANGES)}")
            values[target] = body[alias]
            sent_as[target] = alias
    for name in ("include_domains", "exclude_domains"):
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    try:
        return SearchOptions(max_results=max_results, **values), sent_as
    except OptionError as err:
        raise _field_error(sent_as.get(err.option, err.option), err.reason) from None


def _domain_filter(value: Any) -> dict[str, tuple[str, ...]]:
    """Perplexity's search_domain_filter: domains to include, '-domain' to exclude."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _field_error(
            "search_domain_filter", 'must be a list of domains, like ["example.com", "-spam.com"]'
        )
    include = tuple(v for v in value if not v.strip().startswith("-"))
    exclude = tuple(v.strip()[1:] for v in value if v.strip().startswith("-"))
    return {"include_domains": include, "exclude_domains": exclude}


def _credentials(value: Any, config: SearchApiConfig, routes: dict[str, Route]) -> dict[str, str]:
    """The agent's own keys by provider. Messages name the provider, never the key."""
    if not isinstance(value, dict):
        raise _field_error("credentials", 'must be an object like {"tavily": "<your key>"}')
    out: dict[str, str] = {}
    for name, key in value.items():
        where = f"credentials.{name}"
        if not _is_provider(name, routes):
            raise _field_error(where, f"is not a search provider ({_known(config)})")
        profile = routes[name].profile
        assert profile is not None  # checked by _is_provider
        if credential_slot(profile) is None:
            raise _field_error(where, f"is not needed: {name} takes no API key")
        if not isinstance(key, str) or not key.strip():
            raise _field_error(where, "must be the API key, as text")
        if len(key) > MAX_KEY_CHARS or any(c in key for c in "\r\n\0"):
            raise _field_error(where, "is not a usable API key (one line, at most 4096 chars)")
        out[name] = key.strip()
    return out


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
            (s.max_query_chars for r in routes.values() if (s := r.config.get(SEARCH))),
            default=2000,
        )
        # The OpenAPI document of /v1/search; the MCP server's tool schemas come from it too.
        self.document = openapi_document(
            max_batch=config.max_batch,
            max_results=MAX_RESULTS,
            max_domains=MAX_DOMAINS,
            max_providers=provider_cap(config, routes),
        )
        self.openapi_json = orjson.dumps(self.document, option=orjson.OPT_INDENT_2)

    async def openapi(self, request: web.Request) -> web.Response:
        """GET /openapi.json: the OpenAPI 3.1 document of /v1/search (built at start-up)."""
        return web.Response(body=self.openapi_json, content_type="application/json")

    async def handle(
        self, request: web.Request, rid: str, trace: SearchTrace, client: str = ""
    ) -> web.Response:
        """Answer one request; `trace` records what it did. Its vendor calls, retries,
        simplified variants and failovers included, are at most max_calls_per_request.
        `client`: the caller's name when `clients:` is configured (its per-client limits)."""
        try:
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError:
                raise _field_error("body", "is not valid JSON") from None
            answer = await self.answer(body, rid, trace, client)
            return web.json_response(answer, dumps=_dumps)
        except ProxyError as err:
            return error_response(err, rid)

    async def answer(
        self, body: Any, rid: str, trace: SearchTrace, client: str = ""
    ) -> dict[str, Any]:
        """The answer to a /v1/search body (already decoded JSON): one query's normalised
        results, or `{"responses": [...]}` for a batch. Raises the ProxyError /v1/search
        answers with (a bad field, every provider failed). The /v1/search handler and the MCP
        server's web_search tool (proxy/mcp_server.py) both run searches through here."""
        calls = CallBudget(self.config.max_calls_per_request)
        try:
            call = parse_request(body, self.config, self.routes, self.max_chars)
            trace.queries = len(call.queries)
            run = _Run(call, rid, calls, trace, client)
            if not call.is_batch:
                return await self.search(call.queries[0], run)
            answers = await asyncio.gather(
                *(self.search(q, run) for q in call.queries),
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
            return {"responses": out}
        finally:
            trace.calls = calls.spent

    async def search(self, query: str, run: _Run) -> dict[str, Any]:
        """Try providers in order; the first with results answers."""
        call = run.call
        tried: list[Tried] = []
        for name in call.providers:
            route = self.routes[name]
            outcome = await self._try(route, query, run)
            tried.append(outcome.tried)
            if outcome.tried.outcome != "skipped" and name not in run.trace.providers:
                run.trace.providers.append(name)
            self.metrics.provider_fallbacks.labels(name, outcome.tried.outcome).inc()
            if outcome.tried.outcome == "results":
                return _answer(
                    query,
                    outcome.query_used or query,
                    outcome.answered_by or name,
                    outcome.results or [],
                    outcome.tried.dropped,
                    outcome.from_cache,
                    outcome.cache_age_s,
                    tried,
                )
        failures = [t for t in tried if t.outcome in ("failed", "skipped")]
        if len(failures) < len(tried):  # somebody answered, with nothing found
            return _answer(query, query, None, [], (), False, None, tried)
        raise _all_failed(tried)

    async def _try(self, route: Route, query: str, run: _Run) -> _Outcome:
        started = self.clock.now()
        call = run.call
        if route.missing_key is not None and route.name not in call.credentials:
            header = route.missing_key
            why = f"has no API key configured (its {header} header is empty: set the variable"
            why += f" in routes.{route.name}.headers.set, or send credentials.{route.name})"
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
        now = datetime.fromtimestamp(self.clock.wall(), UTC)
        flow, dropped = self._flow(route, query, run, now)
        dropped = call.dropped(dropped)
        try:
            reply = await route.handler(flow)
        except ProxyError as err:
            ms = (self.clock.now() - started) * 1000
            return _Outcome(
                Tried(
                    route.name,
                    flow.trace.query_used or query,
                    "failed",
                    err.upstream_status or err.status,
                    ms,
                    _reason(err),
                    err.retry_after_s,
                    dropped=dropped,
                )
            )
        ms = (self.clock.now() - started) * 1000
        used = flow.trace.query_used or query
        outcome = route.classify(reply)
        if outcome is Outcome.OK:
            # A fallback of the route's own failover may have answered, in this vendor's shape.
            answered_by = reply.provider or flow.trace.provider or route.name
            if answered_by != route.name:
                dropped = _failover_dropped(call, flow)
            results = self._results(
                route, reply.body, call.options.max_results or 1, now, answered_by
            )
            if results:
                age = reply.headers.get("Age")
                return _Outcome(
                    Tried(route.name, used, "results", reply.status, ms, dropped=dropped),
                    answered_by=answered_by,
                    results=results,
                    query_used=used,
                    from_cache=flow.trace.cache in ("hit", "stale"),
                    cache_age_s=int(age) if age and age.isdigit() else None,
                )
            return _Outcome(Tried(route.name, used, "empty", reply.status, ms, dropped=dropped))
        if outcome is Outcome.EMPTY:
            return _Outcome(Tried(route.name, used, "empty", reply.status, ms, dropped=dropped))
        if outcome is Outcome.TERMINAL or reply.status in TERMINAL_STATUSES:
            said = error_message(reply.body)
            reason = f"{reply.status}" + (f" ({said})" if said else "")
            return _Outcome(
                Tried(
                    route.name,
                    used,
                    "failed",
                    reply.status,
                    ms,
                    reason,
                    terminal=True,
                    dropped=dropped,
                )
            )
        asked = parse_retry_after(reply.headers.get("Retry-After"), self.clock.wall())
        reason = f"{reply.status}" + (f" (retry after {seconds_text(asked)})" if asked else "")
        return _Outcome(
            Tried(route.name, used, "failed", reply.status, ms, reason, asked, dropped=dropped)
        )

    def _results(
        self, route: Route, body: bytes, max_results: int, now: datetime, provider: str
    ) -> list[dict[str, Any]]:
        """The vendor's answer as normalised results with their details."""
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        profile = self.profiles[route.name]
        results = normalize_results(
            extract_results(profile, data),
            max_results=max_results,
            blocked_domains=self.config.blocked_domains,
            blocked_extensions=self.config.blocked_extensions,
        )
        details = extract_details(profile, data, now=now)
        out = []
        for place, r in enumerate(results, start=1):
            d = details.get(r.url)
            out.append(
                {
                    "title": r.title,
                    "url": r.url,
                    "snippet": r.snippet,
                    "date": d.date if d else None,
                    "last_updated": d.last_updated if d else None,
                    "score": d.score if d else None,
                    "published_date": d.published_date if d else None,
                    "position": d.position if d else place,
                    "provider": provider,
                }
            )
        return out

    def _flow(
        self, route: Route, query: str, run: _Run, now: datetime
    ) -> tuple[Flow, tuple[str, ...]]:
        """The vendor request for one provider, and the options it had to drop."""
        call, rid = run.call, run.request_id
        profile = self.profiles[route.name]
        sr, dropped = build_search(profile, query, call.options, now=now)
        set_headers = route.set_headers
        client = run.client
        key = call.credentials.get(route.name)
        if key is not None:
            sr = with_credential(profile, sr, key)
            slot = credential_slot(profile)
            slot_name = slot.name.lower() if slot else ""
            # The agent's key replaces the configured one; only a digest of it identifies the
            # caller to the cache, the limiter and the loop guard.
            set_headers = tuple(
                (k, v)
                for k, v in set_headers
                if k.lower() != slot_name and not is_credential_name(k)
            )
            client = client or hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
        headers: CIMultiDict[str] = CIMultiDict(set_headers)
        headers.update(sr.headers)
        body = b""
        if sr.json_body is not None:
            body = orjson.dumps(sr.json_body)
            headers["Content-Type"] = "application/json"
        if rid:
            headers["X-Request-Id"] = rid
        now_s = self.clock.now()
        flow = Flow.new(
            route=route.name,
            method=sr.method,
            path=sr.path,
            query_string=urlencode(sr.query_params),
            headers=headers,
            body=body,
            request_id=rid,
            client=client,
            deadline=now_s + route.config.timeouts.total,
            started=now_s,
            calls=run.calls,
        )
        return flow, dropped


def _answer(
    query: str,
    query_used: str,
    provider: str | None,
    results: list[dict[str, Any]],
    dropped: tuple[str, ...],
    from_cache: bool,
    cache_age_s: int | None,
    tried: list[Tried],
) -> dict[str, Any]:
    """One query's answer: LiteLLM's search shape (`object`, `results`) plus our fields."""
    return {
        "object": "search",
        "query": query,
        "query_used": query_used,
        "provider": provider,
        "results": results,
        "dropped_options": list(dropped),
        "from_cache": from_cache,
        "cache_age_s": cache_age_s,
        "attempts": [t.public() for t in tried],
    }


@dataclass(frozen=True, slots=True)
class _Run:
    """One /v1/search request, as each of its searches shares it."""

    call: SearchCall
    request_id: str
    calls: CallBudget  # vendor calls left to the whole request
    trace: SearchTrace
    client: str = ""  # the known client calling (clients:), else ""


@dataclass(slots=True)
class _Outcome:
    tried: Tried
    results: list[dict[str, Any]] | None = None
    query_used: str | None = None
    from_cache: bool = False
    cache_age_s: int | None = None
    answered_by: str | None = None  # the route whose results these are


def _failover_dropped(call: SearchCall, flow: Flow) -> tuple[str, ...]:
    """The dropped options when the route's failover answered: as its header lists them, else
    every option sent (none is known to have reached the fallback vendor)."""
    listed = flow.trace.reply_headers.get(FAILOVER_DROPPED_HEADER)
    if listed is None:
        return call.dropped(call.options.requested())
    return call.dropped(tuple(n.strip() for n in listed.split(",") if n.strip()))


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

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
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from policies.core.clock import Clock
from policies.core.errors import BadRequest, ProxyError
from policies.core.flow import CallBudget
from policies.core.options import MAX_DOMAINS, TIME_RANGES
from policies.profiles import (
    OptionError,
    SearchOptions,
    extract_details,
    normalize_results,
)
from policies.providers import Answer, Search, all_failed, ask, skipped
from policies.search import SECTION as SEARCH
from proxy.bodies import read_json
from proxy.config import SearchApiConfig
from proxy.dialects import error_response, json_answer
from proxy.errors import ProvidersExhausted, ProvidersRefused
from proxy.metrics import Metrics
from proxy.openapi import openapi_document
from proxy.pipeline import Route, as_provider
from proxy.search_modes import MODES, Mode, Part, merge, merged_results, race

MAX_RESULTS = 50
MAX_KEY_CHARS = 4096
# A key goes into a header or a query parameter: a control character would break either.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

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
    "mode",
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

    @classmethod
    def of(cls, answer: Answer, outcome: str, call: SearchCall) -> Tried:
        """A provider's answer as this request reports it: the options it dropped as the
        agent named them."""
        return cls(
            answer.provider,
            answer.query,
            outcome,
            answer.status,
            answer.ms,
            answer.reason,
            answer.retry_after_s,
            answer.terminal,
            call.dropped(answer.dropped) if outcome != "skipped" else (),
        )

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
    mode: Mode = "first"  # first: in order; merge, race: several at once (proxy/search_modes.py)
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
    mode = body.get("mode", "first")
    if mode not in MODES:
        raise _field_error("mode", f"must be one of {', '.join(MODES)}")
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
        mode=mode,
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
        if profile.key_slot is None:
            raise _field_error(where, f"is not needed: {name} takes no API key")
        if not isinstance(key, str) or not key.strip():
            raise _field_error(where, "must be the API key, as text")
        if len(key) > MAX_KEY_CHARS or _CONTROL.search(key):
            raise _field_error(
                where, "is not a usable API key (no control characters, at most 4096 chars)"
            )
        out[name] = key.strip()
    return out


class SearchApi:
    """Runs normalised searches across providers; owned by the app, built at start-up."""

    def __init__(
        self, config: SearchApiConfig, routes: dict[str, Route], metrics: Metrics, clock: Clock
    ) -> None:
        self.config = config
        self.clock = clock
        self.providers = {
            n: as_provider(r, clock) for n, r in routes.items() if r.profile is not None
        }
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

    async def handle(
        self, request: web.Request, rid: str, trace: SearchTrace, client: str = ""
    ) -> web.Response:
        """Answer one request; `trace` records what it did. Its vendor calls, retries,
        simplified variants and failovers included, are at most max_calls_per_request.
        `client`: the caller's name when `clients:` is configured (its per-client limits)."""
        try:
            body = await read_json(request, "/v1/search", "search")
            answer = await self.answer(body, rid, trace, client)
            return json_answer(answer)
        except ProxyError as err:
            return error_response(err, rid)

    async def answer(
        self,
        body: Any,
        rid: str,
        trace: SearchTrace,
        client: str = "",
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """The answer to a /v1/search body (already decoded JSON): one query's normalised
        results, or `{"responses": [...]}` for a batch. Raises the ProxyError /v1/search
        answers with (a bad field, every provider failed). The /v1/search handler and the MCP
        server's web_search tool (proxy/mcp_server.py) both run searches through here; a
        `deadline` (clock time) bounds every provider's attempts (None: each route's own)."""
        calls = CallBudget(self.config.max_calls_per_request)
        try:
            call = parse_request(body, self.config, self.routes, self.max_chars)
            trace.queries = len(call.queries)
            run = _Run(call, rid, calls, trace, client, deadline)
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
        """The first provider with results answers: in order (`mode: first`), the faster of
        the first two (`race`, then the rest in order); or every provider's results merged."""
        call, search = run.call, Search(query, run.call.options)
        tried: list[Tried] = []
        pending = list(call.providers)

        async def ask(name: str) -> Part[Tried]:
            return await self._ask(name, search, run)

        def skip(name: str) -> Part[Tried] | None:
            return self._skip(name, search, run)

        if call.mode == "merge":
            parts = await merge(pending, ask, skip, self.config.merge_providers)
            tried = [p.report for p in parts]
            results = merged_results(parts, search.count)
            if results:
                found = [p for p in parts if p.results]
                answer = self._answered(query, found[0], tried, results)
                answer["dropped_options"] = list(
                    dict.fromkeys(d for p in found for d in p.report.dropped)
                )
                return {**answer, "providers": [p.answer.provider for p in found]}
            pending = []
        elif call.mode == "race":
            winner, parts = await race(pending, ask, skip, lambda n: self._cancelled(n, search))
            tried = [p.report for p in parts]
            if winner is not None:
                return self._answered(query, winner, tried, winner.results)
        for name in pending:
            part = skip(name) or await ask(name)
            tried.append(part.report)
            if part.results:
                return self._answered(query, part, tried, part.results)
        failures = [t for t in tried if t.outcome in ("failed", "skipped", "cancelled")]
        if len(failures) < len(tried):  # somebody answered, with nothing found
            return _answer(query, query, None, [], (), False, None, tried)
        raise _all_failed(tried)

    def _skip(self, name: str, search: Search, run: _Run) -> Part[Tried] | None:
        """The part of a provider that is not asked now (no key, circuit open), or None."""
        own_key = name in run.call.credentials
        answer = skipped(self.providers[name], search, own_key=own_key)
        return None if answer is None else self._part(answer, [], run)

    async def _ask(self, name: str, search: Search, run: _Run) -> Part[Tried]:
        """Ask one provider through its route; its part, results normalised."""
        wall = datetime.fromtimestamp(self.clock.wall(), UTC)
        answer = await ask(
            self.providers[name],
            search,
            request_id=run.request_id,
            now=self.clock.now(),
            wall=wall,
            calls=run.calls,
            key=run.call.credentials.get(name),
            client=run.client,
            deadline=run.deadline,
        )
        results = self._results(answer, search.count, wall)
        # The part lives until the slowest provider of a merge or the last query of a batch has
        # answered, and the reply's memory charge went with it: it keeps only what it reports,
        # not the vendor's whole answer (its parse, every result it listed).
        return self._part(replace(answer, data=None, results=()), results, run)

    def _part(self, answer: Answer, results: list[dict[str, Any]], run: _Run) -> Part[Tried]:
        part = "empty" if answer.part == "results" and not results else answer.part
        if part != "skipped" and answer.provider not in run.trace.providers:
            run.trace.providers.append(answer.provider)
        self.metrics.provider_fallbacks.labels(answer.provider, part).inc()
        return Part(answer, results, Tried.of(answer, part, run.call))

    def _cancelled(self, name: str, search: Search) -> Part[Tried]:
        """A raced provider that lost: its call was cancelled."""
        self.metrics.provider_fallbacks.labels(name, "cancelled").inc()
        answer = Answer(name, "failed", search.query, reason="cancelled: another answered first")
        return Part(answer, [], Tried(name, search.query, "cancelled", None, 0.0, answer.reason))

    def _answered(
        self, query: str, part: Part[Tried], tried: list[Tried], results: list[dict[str, Any]]
    ) -> dict[str, Any]:
        answer = part.answer
        age = dict(answer.cache_headers).get("Age")
        return _answer(
            query,
            answer.query,
            answer.answered_by,
            results,
            part.report.dropped,
            answer.from_cache,
            int(age) if age and age.isdigit() else None,
            tried,
        )

    def _results(self, answer: Answer, count: int, now: datetime) -> list[dict[str, Any]]:
        """A provider's results, normalised (deduplicated, blocked domains and file types left
        out, cut to `count`), with the details its vendor gives."""
        if answer.part != "results":
            return []
        profile = self.providers[answer.provider].profile  # the shape the answer is in
        results = normalize_results(
            list(answer.results),
            max_results=count,
            blocked_domains=self.config.blocked_domains,
            blocked_extensions=self.config.blocked_extensions,
        )
        details = extract_details(profile, answer.data, now=now)
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
                    "provider": answer.answered_by,
                }
            )
        return out


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
    deadline: float | None = None  # when every attempt must be done (None: each route's own)


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
    message, retry_in = all_failed(tried)
    return ProvidersExhausted(
        message,
        route="search",
        attempts=len(tried),
        upstream_status=status,
        retry_after_s=retry_in,
    )

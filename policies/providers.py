"""One engine for asking other vendors' routes for a search, shared by failover, hedging to a
fallback, `/v1/search` and `/mcp`: why a provider is skipped, the search rebuilt in that
vendor's own request shape and sent through its route (its cache, breaker, retries, rate limit
and key), what its answer was, and that answer rendered in another vendor's shape.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal, Protocol
from urllib.parse import parse_qsl, urlencode

import orjson
from multidict import CIMultiDict

from policies.backoff import parse_retry_after
from policies.core.credentials import is_credential_name
from policies.core.errors import MIN_RETRY_S, CircuitOpen, ProxyError, seconds_text
from policies.core.flow import CallBudget, Flow, Reply
from policies.core.outcome import TERMINAL_STATUSES, Outcome
from policies.core.section import Provider
from policies.profiles import (
    QueryRef,
    SearchOptions,
    SearchResult,
    VendorProfile,
    build_search,
    error_message,
    extract_results,
    normalize_results,
    read_options,
    render_answer,
    with_credential,
)
from policies.profiles.reading import NOT_JSON, load_json

DEFAULT_RESULTS = 5
# Set by a route's failover when a fallback answered: the unified options it dropped.
DROPPED_HEADER = "X-Search-Dropped-Options"
# The field of a translated answer's body naming the vendor that answered.
NOTE = "search_proxy"
# What a translated answer keeps of the provider's own answer: how its cache answered.
_CACHE_HEADERS = ("Age", "X-Cache", "Cache-Status")

Part = Literal["results", "empty", "failed", "skipped"]


@dataclass(frozen=True, slots=True)
class Search:
    """A search as any vendor can be asked it: the query text and the unified options."""

    query: str
    options: SearchOptions  # max_results always set

    @property
    def count(self) -> int:
        return self.options.max_results or DEFAULT_RESULTS


@dataclass(frozen=True, slots=True)
class Answer:
    """One provider's part in a search: what it answered, or why it did not."""

    provider: str
    part: Part
    query: str  # the query it answered (a simpler one when its search recovery found one)
    status: int | None = None
    ms: float = 0.0
    reason: str = ""  # in a few words, why it failed or was skipped
    retry_after_s: float | None = None
    terminal: bool = False  # a bad key, no credits, no key configured: a retry cannot help
    dropped: tuple[str, ...] = ()  # unified options it could not honour
    answered_by: str = ""  # the route whose results these are (its own failover may have)
    results: tuple[SearchResult, ...] = ()  # as the answering vendor listed them
    data: Any = None  # the answer's JSON, for details beside the results
    cache_headers: tuple[tuple[str, str], ...] = ()  # how the provider's cache answered
    from_cache: bool = False  # its cache answered (fresh, or stale while the vendor failed)

    @property
    def usable(self) -> bool:
        """Results, or an answer that found nothing: what a caller may take."""
        return self.part in ("results", "empty")


def read_search(profile: VendorProfile, flow: Flow, ref: QueryRef, now: datetime) -> Search:
    """The search `flow` asks for, `ref` being its query as its vendor's profile found it."""
    request = flow.request
    params = dict(parse_qsl(request.query_string, keep_blank_values=True))
    asked = read_options(profile, request.method, request.path, params, request.body, now=now)
    return Search(ref.text, replace(asked, max_results=asked.max_results or DEFAULT_RESULTS))


def answered_by(flow: Flow, provider: str, dropped: Sequence[str]) -> None:
    """Note on `flow` which provider answered it, and the options that provider could not
    honour (its results ignore them): the agent's X-Search-Provider and DROPPED_HEADER."""
    flow.trace.provider = provider
    flow.trace.reply_headers["X-Search-Provider"] = provider
    if dropped:
        flow.trace.reply_headers[DROPPED_HEADER] = ",".join(dropped)
    else:
        flow.trace.reply_headers.pop(DROPPED_HEADER, None)


def skipped(provider: Provider, search: Search, *, own_key: bool = False) -> Answer | None:
    """Why `provider` is not asked now (no key configured and none sent, its circuit open), or
    None when it may be."""
    if provider.missing_key is not None and not own_key:
        return Answer(
            provider.name, "skipped", search.query, reason=_no_key(provider), terminal=True
        )
    wait = open_for(provider)
    if wait is not None:
        return Answer(
            provider.name, "skipped", search.query, reason=open_reason(wait), retry_after_s=wait
        )
    return None


def open_for(provider: Provider) -> float | None:
    """Seconds until `provider`'s open circuit lets a call through (at least MIN_RETRY_S, the
    least any retry advice says), or None while it is not open."""
    wait = provider.circuit_open()
    return None if wait is None else max(wait, MIN_RETRY_S)


def open_reason(wait: float) -> str:
    return f"circuit open (retry in {seconds_text(wait)})"


def _no_key(provider: Provider) -> str:
    """Why a provider without a key of its own is skipped, and what to set or send."""
    return f"{missing_key(provider)} (or, on /v1/search, send credentials.{provider.name})"


def missing_key(provider: Provider) -> str:
    """Why a provider has no key of its own, and what to set: the variable its key reads, or
    else the header configured empty."""
    name, header, variable = provider.name, provider.missing_key, provider.key_variable
    where = f"routes.{name}.headers.set.{header}"
    if variable is not None:
        return (
            f"has no API key: {variable} is not set ({where} reads it); export {variable} "
            "before starting the proxy"
        )
    return f"has no API key configured ({where} is empty): set it"


def askable(provider: Provider) -> bool:
    """Whether `provider` may be asked now with its own configured key (`skipped` would not
    skip it): what lets a route fail over at once rather than wait for its own vendor."""
    return provider.missing_key is None and provider.circuit_open() is None


async def ask(
    provider: Provider,
    search: Search,
    *,
    request_id: str,
    now: float,
    wall: datetime,
    deadline: float | None = None,
    calls: CallBudget | None = None,
    key: str | None = None,
    client: str = "",
    as_fallback: bool = False,
) -> Answer:
    """`provider`'s answer to `search`, through its route. `deadline` defaults to the route's
    own `timeouts.total` from `now`; `calls` is the agent request's bound on vendor calls;
    `key` is the agent's own key for this provider, sent where its vendor reads one instead of
    the route's; `client` names the caller to the route's cache and limiter (never the agent's
    key for another vendor); `as_fallback`: the provider stands in for another route, and its
    own fallbacks are not followed."""
    started = now
    flow, dropped = _flow(provider, search, request_id, now, wall, deadline, calls, key, client)
    if as_fallback:
        flow.context.fallback = True
    clock_now = provider.clock.now
    try:
        reply = await provider.handler(flow)
    except ProxyError as err:
        return Answer(
            provider.name,
            "failed",
            flow.trace.query_used or search.query,
            err.upstream_status or err.status,
            (clock_now() - started) * 1000,
            reason_of(err),
            err.retry_after_s,
            dropped=dropped,
        )
    ms = (clock_now() - started) * 1000
    used = flow.trace.query_used or search.query
    try:
        return _answer(provider, search, reply, flow, used, ms, dropped, wall)
    finally:
        reply.discard()


async def first_answer(
    providers: Sequence[Provider],
    search: Search,
    on_part: Callable[[Answer], None] = lambda answer: None,
    **asking: Any,
) -> Answer | None:
    """Ask providers in order (each one's part goes to `on_part` as it is known) until one has
    results; that one, else the first that found nothing, else None. `asking` is `ask`'s."""
    empty: Answer | None = None
    for provider in providers:
        answer = skipped(provider, search) or await ask(provider, search, **asking)
        on_part(answer)
        if answer.part == "results":
            return answer
        if answer.part == "empty" and empty is None:
            empty = answer
    return empty


def translated(primary: VendorProfile, answer: Answer, count: int, why: str = "") -> Reply:
    """`answer` as a reply in `primary`'s vendor shape, so the agent's SDK parses results
    another vendor found as it parses its own (`reply.provider` names who answered). Where the
    shape is an object, it carries a `search_proxy` note saying so (and `why`, when given), for
    an agent that logs or reads its tool's output."""
    results = normalize_results(list(answer.results), max_results=count)
    data = render_answer(primary, results, answer.query)
    if isinstance(data, dict):
        data[NOTE] = {"provider": answer.provider, **({"why": why} if why else {})}
    body = orjson.dumps(data)
    headers: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json"})
    headers.extend(answer.cache_headers)
    outcome = Outcome.OK if results else Outcome.EMPTY
    return Reply(200, headers, body, outcome=outcome, provider=answer.provider)


class VendorCall(Protocol):
    """A call in a vendor's shape (a search, an extract), as its module builds it."""

    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def query_params(self) -> Mapping[str, str]: ...
    @property
    def json_body(self) -> Mapping[str, Any] | None: ...
    @property
    def headers(self) -> Mapping[str, str]: ...


def call_flow(
    provider: Provider,
    call: VendorCall,
    set_headers: Iterable[tuple[str, str]],
    request_id: str,
    client: str,
    now: float,
    deadline: float | None,
    calls: CallBudget | None,
) -> Flow:
    """`call` down the provider's route: its headers over `set_headers` (the route's own), a
    JSON body, the request id, and a deadline within the route's total."""
    headers: CIMultiDict[str] = CIMultiDict(set_headers)
    headers.update(call.headers)
    body = b""
    if call.json_body is not None:
        body = orjson.dumps(call.json_body)
        headers["Content-Type"] = "application/json"
    if request_id:
        headers["X-Request-Id"] = request_id
    until = now + provider.total if deadline is None else min(deadline, now + provider.total)
    return Flow.new(
        route=provider.name,
        method=call.method,
        path=call.path,
        query_string=urlencode(dict(call.query_params)),
        headers=headers,
        body=body,
        request_id=request_id,
        client=client,
        deadline=until,
        started=now,
        calls=calls,
    )


def _flow(
    provider: Provider,
    search: Search,
    request_id: str,
    now: float,
    wall: datetime,
    deadline: float | None,
    calls: CallBudget | None,
    key: str | None,
    client: str,
) -> tuple[Flow, tuple[str, ...]]:
    """The request for `search` down the provider's route, and the options it had to drop."""
    profile = provider.profile
    request, dropped = build_search(profile, search.query, search.options, now=wall)
    set_headers = provider.headers
    if key is not None:
        request = with_credential(profile, request, key)
        slot = profile.key_slot
        slot_name = slot.name.lower() if slot else ""
        # The agent's key replaces the configured one; only a digest of it identifies the
        # caller to the cache, the limiter and the loop guard.
        set_headers = tuple(
            (k, v) for k, v in set_headers if k.lower() != slot_name and not is_credential_name(k)
        )
        client = client or hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    flow = call_flow(provider, request, set_headers, request_id, client, now, deadline, calls)
    if key is not None:  # the agent's own key: the route's key pool leaves it in place
        flow = flow.with_request(replace(flow.request, own_key=True))
    return flow, dropped


def _answer(
    provider: Provider,
    search: Search,
    reply: Reply,
    flow: Flow,
    used: str,
    ms: float,
    dropped: tuple[str, ...],
    wall: datetime,
) -> Answer:
    """What the provider's reply says: results, nothing found, or a failure and whether a
    retry can help."""
    status = reply.status
    outcome = provider.classify(reply)
    if outcome is Outcome.OK or outcome is Outcome.EMPTY:
        data = answer_json(reply.body)
        # The provider's own failover may have answered, in its vendor's shape.
        answered_by = reply.provider or flow.trace.provider or provider.name
        if answered_by != provider.name:
            # As the failover listed them; else every option sent (none is known to have
            # reached the fallback vendor).
            listed = flow.trace.reply_headers.get(DROPPED_HEADER)
            if listed is None:
                dropped = search.options.requested()
            else:
                dropped = tuple(n.strip() for n in listed.split(",") if n.strip())
        results = tuple(extract_results(provider.profile, data)) if outcome is Outcome.OK else ()
        part: Part = "results" if results else "empty"
        cache = tuple((n, reply.headers[n]) for n in _CACHE_HEADERS if n in reply.headers)
        return Answer(
            provider.name,
            part,
            used,
            status,
            ms,
            dropped=dropped,
            answered_by=answered_by,
            results=results,
            data=data,
            cache_headers=cache,
            from_cache=flow.trace.cache in ("hit", "stale"),
        )
    if outcome is Outcome.TERMINAL or status in TERMINAL_STATUSES:
        said = error_message(reply.body)
        reason = f"{status}" + (f" ({said})" if said else "")
        return Answer(
            provider.name, "failed", used, status, ms, reason, terminal=True, dropped=dropped
        )
    asked = parse_retry_after(reply.headers.get("Retry-After"), wall.timestamp())
    reason = f"{status}" + (f" (retry after {seconds_text(asked)})" if asked else "")
    return Answer(provider.name, "failed", used, status, ms, reason, asked, dropped=dropped)


class Failed(Protocol):
    """A provider's failed part in a search, as a summary of all of them reads it."""

    @property
    def provider(self) -> str: ...

    @property
    def reason(self) -> str: ...

    @property
    def retry_after_s(self) -> float | None: ...

    @property
    def terminal(self) -> bool: ...


def all_failed(parts: Sequence[Failed]) -> tuple[str, float | None]:
    """What an agent reads when every provider failed, each named in the order tried with what
    it answered, and the shortest wait any asked for (at least MIN_RETRY_S): 'All 3 providers
    failed: tavily unreachable, exa 503 (retry after 30s), brave circuit open (retry in 27s).
    Retry in 27s.'"""
    reasons = ", ".join(f"{p.provider} {p.reason}" for p in parts)
    waits = [p.retry_after_s for p in parts if p.retry_after_s is not None]
    retry_in = max(min(waits), MIN_RETRY_S) if waits else None
    advice = f"Retry in {seconds_text(retry_in)}." if retry_in is not None else "Retry shortly."
    refused = [p.provider for p in parts if p.terminal]
    if refused:
        advice += f" ({', '.join(refused)} will not recover on a retry: check key and plan.)"
    return f"All {len(parts)} providers failed: {reasons}. {advice}", retry_in


def reason_of(err: ProxyError) -> str:
    """A provider's failure in a few words: 'timed out after 10s', 'circuit open (retry in 27s)'."""
    if err.retry_after_s is None or err.retry_after_s <= 0:
        return err.reason
    when = "in" if isinstance(err, CircuitOpen) else "after"
    return f"{err.reason} (retry {when} {seconds_text(err.retry_after_s)})"


def answer_json(body: bytes) -> object:
    """A reply's body as JSON, or None: parsed once, as classifying the reply parsed it."""
    data = load_json(body)
    return None if data is NOT_JSON else data

"""Asking another vendor's route for a search, and answering in this route's vendor's shape: what
cross-vendor failover and hedging to a fallback share.

The search (query text and unified options) is read from the agent's request by the primary's
profile, rebuilt in the other vendor's own request shape, sent through that vendor's route (its
cache, breaker, retries and rate limit, its own key) and its results rendered back in the shape
the agent's SDK parses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from urllib.parse import parse_qsl, urlencode

import orjson
from multidict import CIMultiDict

from policies.core.errors import ProxyError
from policies.core.flow import Flow, Reply
from policies.core.outcome import Outcome
from policies.core.section import Provider
from policies.profiles import (
    QueryRef,
    SearchOptions,
    SearchRequest,
    VendorProfile,
    build_search,
    extract_results,
    normalize_results,
    read_options,
    render_answer,
)

DEFAULT_RESULTS = 5


@dataclass(frozen=True, slots=True)
class Search:
    """A search as any vendor can be asked it: the query text and the unified options."""

    query: str
    options: SearchOptions  # max_results always set

    @property
    def count(self) -> int:
        return self.options.max_results or DEFAULT_RESULTS


@dataclass(frozen=True, slots=True)
class Translated:
    """A provider's answer rendered in the primary's shape (`reply.provider` names it)."""

    reply: Reply  # 200, outcome OK (results) or EMPTY
    provider: str
    dropped: tuple[str, ...]  # options the provider could not honour

    @property
    def has_results(self) -> bool:
        return self.reply.outcome is Outcome.OK


def read_search(profile: VendorProfile, flow: Flow, ref: QueryRef, now: datetime) -> Search:
    """The search `flow` asks for, `ref` being its query as the primary's profile found it."""
    params = dict(parse_qsl(flow.request.query_string, keep_blank_values=True))
    asked = read_options(
        profile, flow.request.method, flow.request.path, params, flow.request.body, now=now
    )
    return Search(ref.text, replace(asked, max_results=asked.max_results or DEFAULT_RESULTS))


def provider_flow(
    provider: Provider, request: SearchRequest, origin: Flow, now: float, deadline: float
) -> Flow:
    """The flow sending `request` down the provider's route on behalf of `origin`."""
    headers: CIMultiDict[str] = CIMultiDict(provider.headers)
    headers.update(request.headers)
    body = b""
    if request.json_body is not None:
        body = orjson.dumps(request.json_body)
        headers["Content-Type"] = "application/json"
    headers["X-Request-Id"] = origin.request.request_id
    return Flow.new(
        route=provider.name,
        method=request.method,
        path=request.path,
        query_string=urlencode(request.query_params),
        headers=headers,
        body=body,
        request_id=origin.request.request_id,
        client="",  # the agent's key for the primary never reaches another vendor
        deadline=deadline,
        started=now,
        calls=origin.context.calls,  # a fallback's calls count against the agent request's bound
    )


async def ask(
    primary: VendorProfile,
    provider: Provider,
    search: Search,
    origin: Flow,
    *,
    now: float,
    wall: datetime,
    deadline: float | None = None,
) -> Translated | None:
    """The provider's answer to `search` in the primary's shape; None when it failed (an error,
    or an answer its own classifier does not read as results or as empty).

    `deadline` defaults to the provider route's own `timeouts.total` from `now`.
    """
    request, dropped = build_search(provider.profile, search.query, search.options, now=wall)
    until = now + provider.total if deadline is None else min(deadline, now + provider.total)
    try:
        reply = await provider.handler(provider_flow(provider, request, origin, now, until))
    except ProxyError:
        return None
    if provider.classify(reply) not in (Outcome.OK, Outcome.EMPTY):
        reply.discard()
        return None
    results = normalize_results(
        extract_results(provider.profile, _json(reply.body)), max_results=search.count
    )
    body = orjson.dumps(render_answer(primary, results, search.query))
    headers: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json"})
    # The provider route's own cache may have answered: say so, as it said it.
    for name in ("Age", "X-Cache", "Cache-Status"):
        if name in reply.headers:
            headers[name] = reply.headers[name]
    reply.discard()
    outcome = Outcome.OK if results else Outcome.EMPTY
    answer = Reply(200, headers, body, outcome=outcome, provider=provider.name)
    return Translated(answer, provider.name, dropped)


def _json(body: bytes) -> object:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None

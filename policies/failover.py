"""Cross-vendor failover on a vendor's own route: when the route's chain ends in a vendor
failure (retries spent, circuit open, a pause longer than the request can wait, an exhausted
plan), the search is sent to the route's fallback providers through their own routes, and the
results come back in the primary vendor's answer shape, so the agent's SDK parses them as usual.

An exhausted plan (the profile's terminal answer: 432, 402, INSUFFICIENT_FUNDS_CREDITS ...)
benches the vendor fleet-wide (Redis) for `exhausted_for`, so later requests go straight to a
fallback instead of paying one failing call each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Literal
from urllib.parse import parse_qsl, urlencode

import orjson
from multidict import CIMultiDict

from policies.backoff import parse_retry_after
from policies.core.clock import Clock
from policies.core.errors import ClientFault, ProxyError
from policies.core.events import Events
from policies.core.flow import Flow, Handler, Reply
from policies.core.outcome import Classifier, Outcome
from policies.core.redislink import UNAVAILABLE, RedisLink
from policies.profiles import (
    QueryRef,
    SearchRequest,
    SearchResult,
    VendorProfile,
    build_search,
    extract_query,
    extract_results,
    normalize_results,
    read_options,
    render_answer,
)

DEFAULT_RESULTS = 5
# How often a replica asks Redis whether another replica benched a vendor.
_EXHAUSTED_REFRESH = 1.0


@dataclass(frozen=True)
class FallbackConfig:
    """A search route's `fallback:` section."""

    providers: tuple[str, ...]  # other search routes, tried in order
    # stale: a stale entry of this vendor first, then a fallback; fresh: a fallback's fresh
    # answer first, then stale.
    prefer: Literal["stale", "fresh"] = "stale"
    exhausted_for: float = 600.0  # benched after an exhausted-plan answer without a reset hint


@dataclass(frozen=True)
class Provider:
    """A fallback as this policy sees it: another route's chain and what it needs to call it."""

    name: str
    profile: VendorProfile
    handler: Handler
    classify: Classifier
    headers: tuple[tuple[str, str], ...]  # that route's configured headers (its own key)
    total: float  # that route's timeouts.total
    available: Callable[[], bool]  # false while its breaker is open or its key is missing


class Exhausted:
    """Which vendors' plans are spent, until when (wall seconds): here, and with Redis for
    every replica. The hot path reads memory; Redis is asked at most once a second per key."""

    def __init__(self, clock: Clock, link: RedisLink | None = None) -> None:
        self.clock = clock
        self.link = link
        self._until: dict[str, float] = {}
        self._asked: dict[str, float] = {}  # key -> clock.now() of the last Redis read

    def _redis_key(self, key: str) -> str:
        assert self.link is not None
        return self.link.key("exhausted", key)

    async def mark(self, key: str, seconds: float) -> None:
        """Bench `key` for `seconds`."""
        until = self.clock.wall() + seconds
        self._until[key] = max(self._until.get(key, 0.0), until)
        if self.link is not None:
            # The value is the end (wall seconds), so every replica reads one deadline; the
            # key's own expiry only clears it away afterwards.
            name, px = self._redis_key(key), max(1, math.ceil(seconds * 1000))
            await self.link.run(lambda r: r.set(name, f"{until:.3f}", px=px))

    async def remaining(self, key: str) -> float:
        """Seconds `key` stays benched (0 when it is not)."""
        now = self.clock.wall()
        left = self._until.get(key, 0.0) - now
        if left > 0:
            return left
        if self.link is None or self.clock.now() - self._asked.get(key, -math.inf) < (
            _EXHAUSTED_REFRESH
        ):
            return 0.0
        self._asked[key] = self.clock.now()
        name = self._redis_key(key)
        raw = await self.link.run(lambda r: r.get(name))
        if raw is UNAVAILABLE or raw is None:
            return 0.0
        try:
            until = float(raw)
        except (TypeError, ValueError):
            return 0.0
        self._until[key] = until
        return max(0.0, until - now)


class Failover:
    """Sends a failed search to the fallback providers and answers in the primary's shape."""

    def __init__(
        self,
        route: str,
        profile: VendorProfile,
        classify: Classifier,
        config: FallbackConfig,
        providers: Callable[[], Sequence[Provider]],
        exhausted: Exhausted,
        clock: Clock,
        events: Events,
        *,
        shared_key: bool = True,
    ) -> None:
        self.route = route
        self.profile = profile
        self.classify = classify
        self.config = config
        self.providers = providers
        self.exhausted = exhausted
        self.clock = clock
        self.events = events
        # True when the route injects its own key: a spent plan is the fleet's, not a caller's.
        self.shared_key = shared_key

    def _bench_key(self, flow: Flow) -> str:
        return self.route if self.shared_key else f"{self.route}|{flow.client}"

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        query = dict(parse_qsl(flow.query_string, keep_blank_values=True))
        ref = extract_query(self.profile, path=flow.path, query=query, body=flow.body)
        if ref is None or not ref.is_text:
            return await call_next(flow)  # not a search this route can translate
        benched = await self.exhausted.remaining(self._bench_key(flow))
        if benched > 0:
            answer = await self._fall_back(flow, ref, f"plan exhausted ({math.ceil(benched)}s)")
            if answer is not None:
                return answer
        try:
            reply = await call_next(flow)
        except ClientFault:
            raise
        except ProxyError as failure:
            answer = await self._fall_back(flow, ref, failure.type)
            if answer is None:
                raise
            return answer
        outcome = self.classify(reply)
        if outcome is Outcome.TERMINAL:
            await self.exhausted.mark(self._bench_key(flow), self._bench_for(reply))
        elif not outcome.is_vendor_failure:
            return reply
        answer = await self._fall_back(flow, ref, f"upstream {reply.status}")
        if answer is None:
            return reply
        reply.discard()
        return answer

    def _bench_for(self, reply: Reply) -> float:
        """How long a spent plan stays benched: the vendor's reset hint, else the config's."""
        hinted = parse_retry_after(reply.headers.get("Retry-After"), self.clock.wall())
        return hinted if hinted is not None and hinted > 0 else self.config.exhausted_for

    async def _fall_back(self, flow: Flow, ref: QueryRef, why: str) -> Reply | None:
        """The first fallback's answer (results, or else an empty one), or None."""
        now = datetime.fromtimestamp(self.clock.wall(), UTC)
        params = dict(parse_qsl(flow.query_string, keep_blank_values=True))
        asked = read_options(self.profile, flow.method, flow.path, params, flow.body, now=now)
        count = asked.max_results or DEFAULT_RESULTS
        options = replace(asked, max_results=count)
        empty: Reply | None = None
        for provider in self.providers():
            if not provider.available():
                self.events.failover(self.route, provider.name, "skipped")
                continue
            request, dropped = build_search(provider.profile, ref.text, options, now=now)
            try:
                reply = await provider.handler(self._flow(provider, request, flow))
            except ProxyError:
                self.events.failover(self.route, provider.name, "failed")
                continue
            outcome = provider.classify(reply)
            if outcome not in (Outcome.OK, Outcome.EMPTY):
                reply.discard()
                self.events.failover(self.route, provider.name, "failed")
                continue
            results = normalize_results(
                extract_results(provider.profile, _json(reply.body)), max_results=count
            )
            answer = self._answer(provider, results, ref.text, reply, flow, why, dropped)
            if results:
                self.events.failover(self.route, provider.name, "answered")
                return answer
            self.events.failover(self.route, provider.name, "empty")
            empty = empty or answer
        return empty

    def _flow(self, provider: Provider, request: SearchRequest, origin: Flow) -> Flow:
        headers: CIMultiDict[str] = CIMultiDict(provider.headers)
        headers.update(request.headers)
        body = b""
        if request.json_body is not None:
            body = orjson.dumps(request.json_body)
            headers["Content-Type"] = "application/json"
        headers["X-Request-Id"] = origin.request_id
        now = self.clock.now()
        return Flow(
            route=provider.name,
            method=request.method,
            path=request.path,
            query_string=urlencode(request.query_params),
            headers=headers,
            body=body,
            request_id=origin.request_id,
            client="",  # the agent's key for the primary never reaches another vendor
            deadline=now + provider.total,
            started=now,
        )

    def _answer(
        self,
        provider: Provider,
        results: list[SearchResult],
        query: str,
        reply: Reply,
        flow: Flow,
        why: str,
        dropped: tuple[str, ...],
    ) -> Reply:
        body = orjson.dumps(render_answer(self.profile, results, query))
        headers: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json"})
        flow.provider = provider.name
        flow.reply_headers["X-Search-Provider"] = provider.name
        flow.reply_headers["X-Search-Failover"] = f"{self.route} failed: {why}"
        if dropped:  # options the fallback vendor cannot honour: its results ignore them
            flow.reply_headers["X-Search-Dropped-Options"] = ",".join(dropped)
        else:
            flow.reply_headers.pop("X-Search-Dropped-Options", None)
        # The fallback route's own cache may have answered: say so, as it said it.
        for name in ("Age", "X-Cache", "Cache-Status"):
            if name in reply.headers:
                headers[name] = reply.headers[name]
        headers.setdefault(
            "Cache-Status", f"search-proxy; fwd=uri-miss; detail=failover-{provider.name}"
        )
        reply.discard()
        return Reply(200, headers, body, provider=provider.name)


def _json(body: bytes) -> object:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None

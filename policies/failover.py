"""Cross-vendor failover on a vendor's own route: when the route's chain ends in a vendor
failure (retries spent, circuit open, a pause longer than the request can wait, an exhausted
plan), the search is sent to the route's fallback providers through their own routes, and the
results come back in the primary vendor's answer shape, so the agent's SDK parses them as usual.

An exhausted plan (the profile's terminal answer: 432, 402, INSUFFICIENT_FUNDS_CREDITS ...)
benches the vendor fleet-wide (Redis) for `exhausted_for`, and a pause the vendor imposed (a
429 or 5xx with Retry-After) for that long, so later requests go straight to a fallback instead
of paying one failing call (or one wait) each. While a fallback can be asked, no policy of the
route holds a request longer than `wait_at_most` (Context.wait_at_most): it fails, and the
fallbacks answer at once.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from policies.backoff import parse_retry_after
from policies.core.benched import EXHAUSTED_FOR_S, Benched, bench_seconds
from policies.core.clock import Clock
from policies.core.credentials import injects_key
from policies.core.errors import ClientFault, LocalRefusal, ProxyError, VendorFailure
from policies.core.events import Events
from policies.core.flow import CallBudget, Classifier, Flow, Handler, Reply
from policies.core.outcome import Outcome
from policies.core.route import RouteConfig
from policies.core.section import Build, Link, Provider, Section
from policies.core.settings import ConfigError, join, one_of, parse_duration, section, texts
from policies.profiles import QueryRef, VendorProfile, request_query
from policies.providers import (
    Answer,
    Search,
    all_failed,
    answered_by,
    askable,
    first_answer,
    read_search,
    reason_of,
    translated,
)

# What `wait_at_most` defaults to: a wait the agent barely notices.
WAIT_AT_MOST_S = 0.25
# Why a route is benched, as Benched records it.
_SPENT, _PAUSED = "plan exhausted", "paused by the vendor"


@dataclass(frozen=True)
class FallbackConfig:
    """A search route's `fallback:` section."""

    providers: tuple[str, ...]  # other search routes, tried in order
    # stale: a stale entry of this vendor first, then a fallback; fresh: a fallback's fresh
    # answer first, then stale.
    prefer: Literal["stale", "fresh"] = "stale"
    # Benched after an exhausted-plan answer without a reset hint.
    exhausted_for: float = EXHAUSTED_FOR_S
    # The longest the primary may hold a request in all (failed attempts, Retry-After or
    # backoff, its limiter's queue, its breaker's wait or slow start) before the fallbacks are
    # asked instead.
    wait_at_most: float = WAIT_AT_MOST_S


class Failover:
    """Sends a failed search to the fallback providers and answers in the primary's shape."""

    def __init__(
        self,
        route: str,
        profile: VendorProfile,
        classify: Classifier,
        config: FallbackConfig,
        providers: Callable[[], Sequence[Provider]],
        benched: Benched,
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
        self.benched = benched
        self.clock = clock
        self.events = events
        # True when the route injects its own key: a spent plan is the fleet's, not a caller's.
        self.shared_key = shared_key

    def _bench_key(self, flow: Flow) -> str | None:
        """Whose plan a terminal answer spends: the route's own key (the fleet's), or the
        caller's key; None when the caller sent none we can tell apart (never bench them all)."""
        if self.shared_key:
            return self.route
        return f"{self.route}|{flow.request.client}" if flow.request.client else None

    def _is_search(self, flow: Flow) -> QueryRef | None:
        """The query of a search call this route can translate; None for other endpoints."""
        path = self.profile.search_path
        if path is not None and flow.request.path.rstrip("/") != path.rstrip("/"):
            return None  # /answer, /extract, news ... are not searches another vendor can answer
        ref = request_query(self.profile, flow.request)
        return ref if ref is not None and ref.is_text else None

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        ref = self._is_search(flow) if not flow.context.fallback else None
        if ref is None:  # not a search, or this route stands in for another: no failover
            return await call_next(flow)
        key = self._bench_key(flow)
        parts: list[Answer] = []  # each fallback's part, in the order asked
        tried = False  # the fallbacks were asked already (while the vendor is benched)
        caller = not self.shared_key
        benched = await self.benched.remaining(key, caller=caller) if key is not None else 0.0
        if benched > 0:
            if self.config.prefer == "stale":  # outside the cache: its entries answer first
                cached = await self._from_cache(flow, call_next)
                if cached is not None:
                    return cached
            why = f"{self.benched.why(key or '') or _SPENT} ({math.ceil(benched)}s)"
            answer = await self._fall_back(flow, ref, why, parts)
            if answer is not None:
                return answer
            tried = True
        elif any(askable(p) for p in self.providers()):
            # A fallback answers sooner than a long wait for this vendor: the policies that
            # would hold the request give up past this allowance instead.
            context = flow.context
            context.wait_at_most = min(context.wait_at_most, self.config.wait_at_most)
        try:
            reply = await call_next(flow)
        except ClientFault:
            raise
        except ProxyError as failure:
            if isinstance(failure, VendorFailure) and failure.retry_after_s:
                await self._bench(flow, key, failure.retry_after_s, _PAUSED)
            answer = None if tried else await self._fall_back(flow, ref, failure.type, parts)
            if answer is None:
                if not parts:
                    raise
                raise self._all_failed(failure, parts, benched=tried) from None
            return answer
        try:
            outcome = self.classify(reply)
            if outcome is Outcome.TERMINAL:
                await self._bench(flow, key, self._bench_for(reply), _SPENT)
            elif not outcome.is_vendor_failure:
                return reply
            else:
                paused = parse_retry_after(reply.headers.get("Retry-After"), self.clock.wall())
                if paused:  # the vendor paused this route: ask the fallbacks meanwhile
                    await self._bench(flow, key, paused, _PAUSED)
            why = f"upstream {reply.status}"
            answer = None if tried else await self._fall_back(flow, ref, why, parts)
        except BaseException:
            reply.discard()  # a failed stream's connection goes back, whatever happened
            raise
        if answer is None:
            if parts:  # the vendor's own answer goes on; a header says the fallbacks failed too
                tried_too = ", ".join(f"{p.provider} {p.reason}" for p in parts)
                failed = f"{self.route} failed: {why}; its fallbacks too: {tried_too}"
                flow.trace.reply_headers["X-Search-Failover"] = _header_text(failed)
            return reply
        reply.discard()
        return answer

    async def _from_cache(self, flow: Flow, call_next: Handler) -> Reply | None:
        """The cache's answer (fresh, or stale) while the vendor is benched, or None: the chain
        runs with a call budget of zero and no time to wait, so nothing in it calls the vendor
        or waits for it."""
        context = flow.context
        budget, allowance = context.calls, context.wait_at_most
        context.calls, context.wait_at_most = CallBudget(0), 0.0
        try:
            return await call_next(flow)
        except LocalRefusal:
            return None
        finally:
            context.calls, context.wait_at_most = budget, allowance

    async def _bench(self, flow: Flow, key: str | None, seconds: float, why: str) -> None:
        """Send this route's searches straight to the fallbacks for `seconds`; a request that
        asked for injected faults benches nothing."""
        if key is not None and seconds > 0 and not flow.context.fault_test:
            await self.benched.mark(key, seconds, why, caller=not self.shared_key)

    def _bench_for(self, reply: Reply) -> float:
        """How long a spent plan stays benched: the vendor's reset hint, else the config's."""
        hinted = parse_retry_after(reply.headers.get("Retry-After"), self.clock.wall())
        return bench_seconds(hinted, self.config.exhausted_for)

    def _all_failed(self, failure: ProxyError, parts: list[Answer], *, benched: bool) -> ProxyError:
        """The route's own failure (its type, status and category kept), its message naming
        every provider tried in order with what it answered, without addresses: the agent
        learns the others were tried, and when to retry. `benched`: the fallbacks were asked
        first, the vendor's plan being spent."""
        reason = reason_of(failure) + _after(failure.attempts)
        own = Answer(self.route, "failed", "", reason=reason, retry_after_s=failure.retry_after_s)
        message, retry_in = all_failed([*parts, own] if benched else [own, *parts])
        told = copy.copy(failure)  # a failure may be kept (the loop guard replays terminal ones)
        told.message, told.args, told.retry_after_s = message, (message,), retry_in
        return told

    async def _fall_back(
        self, flow: Flow, ref: QueryRef, why: str, parts: list[Answer]
    ) -> Reply | None:
        """The first fallback's answer (results, or else an empty one), or None; each
        fallback's part is added to `parts`."""
        wall = datetime.fromtimestamp(self.clock.wall(), UTC)
        search = read_search(self.profile, flow, ref, wall)

        def on_part(part: Answer) -> None:
            parts.append(part)
            self.events.failover(self.route, part.provider, _EVENT[part.part])

        answer = await first_answer(
            self.providers(),
            search,
            on_part=on_part,
            request_id=flow.request.request_id,
            now=self.clock.now(),
            wall=wall,
            calls=flow.context.calls,  # a fallback's calls count against the agent request's
            as_fallback=True,
        )
        return None if answer is None else self._answer(answer, flow, search, why)

    def _answer(self, answer: Answer, flow: Flow, search: Search, why: str) -> Reply:
        """`answer` as the agent gets it, the flow annotated with where it came from."""
        answered_by(flow, answer.provider, answer.dropped)
        flow.trace.reply_headers["X-Search-Failover"] = f"{self.route} failed: {why}"
        reply = translated(self.profile, answer, search.count, f"{self.route} failed: {why}")
        reply.headers.setdefault(
            "Cache-Status", f"search-proxy; fwd=uri-miss; detail=failover-{answer.provider}"
        )
        return reply


def _header_text(text: str) -> str:
    """`text` as a header value: a vendor's words quoted in a reason may hold anything."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:_HEADER_CHARS]


_HEADER_CHARS = 500


def _after(attempts: int) -> str:
    return f" after {attempts} attempts" if attempts > 1 else ""


# The failover event of each provider's part.
_EVENT = {"results": "answered", "empty": "empty", "failed": "failed", "skipped": "skipped"}


# ---------------------------------------------------------------------------------------------
# The `fallback:` section


def parse(raw: Any, path: str) -> FallbackConfig:
    cfg = section(
        raw,
        path,
        FallbackConfig,
        {
            "providers": texts,
            "prefer": one_of("stale", "fresh"),
            "exhausted_for": parse_duration,
            "wait_at_most": parse_duration,
        },
        required=("providers",),
    )
    if not cfg.providers:
        raise ConfigError(join(path, "providers"), "expected at least one route name")
    return cfg


def check(cfg: FallbackConfig, route: RouteConfig, path: str) -> list[ConfigError]:
    if not route.has("search"):
        return [ConfigError(path, "needs the route's search section")]
    return []


def providers_named(cfg: FallbackConfig) -> list[tuple[str, str]]:
    """The routes this section names, each with its path under the section."""
    return [(f"providers[{i}]", name) for i, name in enumerate(cfg.providers)]


SECTION = Section("fallback", parse, check, refers=providers_named)


def build(cfg: FallbackConfig, route: Build) -> Failover | None:
    if route.profile is None:
        return None
    clock, redis = route.clock, route.redis
    return Failover(
        route.route.name,
        route.profile,
        route.classify,
        cfg,
        route.providers(cfg.providers),
        route.once("benched", lambda: Benched(clock, redis)),
        clock,
        route.events,
        # A key pool is the route's own key too (it benches its keys itself).
        shared_key=injects_key(route.route.headers.set) or bool(route.route.section("keys")),
    )


def _build_before_cache(cfg: FallbackConfig, route: Build) -> Failover | None:
    """prefer: stale: outside the cache, so a stale entry of this vendor answers first."""
    return build(cfg, route) if cfg.prefer == "stale" else None


def _build_after_cache(cfg: FallbackConfig, route: Build) -> Failover | None:
    """prefer: fresh: inside the cache, stale only when the fallbacks fail too."""
    return build(cfg, route) if cfg.prefer == "fresh" else None


BEFORE_CACHE = Link("failover", SECTION, _build_before_cache)
AFTER_CACHE = Link("failover", SECTION, _build_after_cache)

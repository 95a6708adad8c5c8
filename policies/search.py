"""Search-aware policies: classify answers by vendor profile, guard the vendor from malformed or
looping requests, and recover from empty results by retrying simpler queries.

Queries are found and rewritten by the route's `VendorProfile` (policies/profiles/) and made
simpler by `simplify_query` (policies/simplify.py); the vendor's body is never changed, so SDKs
parse it as before. The query that produced the results is in `X-Search-Query-Used`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Literal
from urllib.parse import quote

from multidict import CIMultiDict

from policies.core.clock import Clock
from policies.core.errors import BadRequest, ProxyError
from policies.core.events import Events
from policies.core.flow import Classifier, Flow, Handler, Reply
from policies.core.outcome import TERMINAL_STATUSES, Outcome
from policies.core.section import Build, Link, Section
from policies.core.settings import one_of, parse_duration, section, text, whole_in
from policies.profiles import QueryRef, VendorProfile, Verdict, assess, replace_query, request_query
from policies.simplify import simplify_query

LOOP_GUARD_ENTRIES = 10_000
# What one route's guard holds of the failures it replays, bodies and headers; the oldest go
# first. A vendor may answer a bad query with a large body (echoing the input, say): without
# this, 10,000 of them outside the memory budget.
LOOP_GUARD_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class SearchConfig:
    """A route's `search:` section."""

    vendor: str  # the profile that reads this route's requests and answers
    on_empty: Literal["simplify", "pass"] = "simplify"
    max_variants: int = 3
    max_query_chars: int = 2000
    loop_guard: float = 30.0  # seconds a terminal failure is remembered per client; 0 = off


def search_classifier(profile: VendorProfile) -> Classifier:
    """A classifier reading the body by the vendor's profile; streams go by status alone."""
    verdicts = {
        Verdict.OK: Outcome.OK,
        Verdict.EMPTY: Outcome.EMPTY,
        Verdict.MALFORMED: Outcome.MALFORMED,
        Verdict.TERMINAL: Outcome.TERMINAL,
    }

    def classify(reply: Reply) -> Outcome:
        if reply.outcome is None:
            if reply.stream is not None:
                reply.outcome = Outcome.of_status(reply.status)
            else:
                verdict = assess(profile, reply.status, reply.body).verdict
                reply.outcome = verdicts.get(verdict) or Outcome.of_status(reply.status)
        return reply.outcome

    return classify


class _SearchPolicy:
    """What both search policies are built from."""

    def __init__(
        self,
        route: str,
        profile: VendorProfile,
        config: SearchConfig,
        classify: Classifier,
        clock: Clock,
        events: Events,
    ) -> None:
        self.route = route
        self.profile = profile
        self.config = config
        self.classify = classify
        self.clock = clock
        self.events = events


class SearchGuard(_SearchPolicy):
    """Refuses queries that would waste quota, and replays a terminal failure to a client that
    repeats the identical request within `loop_guard` seconds (a header marks the replay)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # key -> (until, the failure replayed, its size), oldest first (all live as long).
        self._failures: OrderedDict[str, tuple[float, Reply, int]] = OrderedDict()
        self._bytes = 0
        # The statuses a terminal failure can come with: any other answer (every success, a
        # cache hit) is passed on without its body being read again.
        self._terminal_statuses = (
            TERMINAL_STATUSES
            | self.profile.terminal_statuses
            | frozenset(self.profile.terminal_body_codes)
        )

    @property
    def remembers_failures(self) -> bool:
        """Whether a terminal failure is being replayed to some request now (those remembered
        past their time are forgotten here: the oldest come first)."""
        if self._failures:
            self._forget_expired()
        return bool(self._failures)

    def _forget_expired(self) -> None:
        failures, now = self._failures, self.clock.now()
        while failures and next(iter(failures.values()))[0] <= now:
            self._bytes -= failures.popitem(last=False)[1][2]

    def _remember(self, key: str, reply: Reply) -> None:
        """Replay `reply` to `key` for `loop_guard` from now, within LOOP_GUARD_ENTRIES and
        LOOP_GUARD_BYTES; the vendor answers one larger than the whole of those again."""
        size = len(reply.body) + sum(len(k) + len(v) for k, v in reply.headers.items())
        if size > LOOP_GUARD_BYTES:
            return
        failures = self._failures
        known = failures.pop(key, None)  # to the end: the order stays the order of `until`
        if known is not None:
            self._bytes -= known[2]
        self._forget_expired()
        failures[key] = (self.clock.now() + self.config.loop_guard, reply, size)
        self._bytes += size
        while len(failures) > LOOP_GUARD_ENTRIES or self._bytes > LOOP_GUARD_BYTES:
            self._bytes -= failures.popitem(last=False)[1][2]

    def validate(self, ref: QueryRef | None) -> None:
        """Raise BadRequest, naming the field, for a query no vendor should be asked."""
        if ref is None:
            return
        field = ref.location.field or "query"
        if not ref.is_text:
            raise BadRequest(f"{self.route}: the search query ({field}) must be text")
        if not ref.text.strip():
            raise BadRequest(
                f"{self.route}: the search query ({field}) is empty; send the words to search for"
            )
        if len(ref.text) > self.config.max_query_chars:
            raise BadRequest(
                f"{self.route}: the search query ({field}) is {len(ref.text)} characters, over "
                f"the limit of {self.config.max_query_chars}; shorten it to its key terms"
            )

    def _key(self, flow: Flow) -> str:
        digest = hashlib.blake2b(digest_size=16)
        for part in (
            flow.request.client,
            flow.request.method,
            flow.request.path,
            flow.request.query_string,
        ):
            digest.update(part.encode())
            digest.update(b"\0")
        digest.update(flow.request.body)
        return digest.hexdigest()

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        self.validate(request_query(self.profile, flow.request))
        if self.config.loop_guard <= 0:
            return await call_next(flow)
        now = self.clock.now()
        if self._failures:  # the key hashes the body: only when there is something to find
            key = self._key(flow)
            remembered = self._failures.get(key)
            if remembered is not None:
                until, reply, size = remembered
                if now < until:
                    headers = CIMultiDict(reply.headers)
                    headers["X-Loop-Guard"] = "replayed"
                    return Reply(reply.status, headers, reply.body)
                del self._failures[key]
                self._bytes -= size
        reply = await call_next(flow)
        if reply.stream is not None or reply.status not in self._terminal_statuses:
            return reply
        outcome = self.classify(reply)
        terminal = outcome is Outcome.TERMINAL or (
            outcome is not Outcome.EMPTY and reply.status in TERMINAL_STATUSES
        )
        if terminal:
            self._remember(self._key(flow), reply)
        return reply


class SearchRecovery(_SearchPolicy):
    """On an empty answer, tries progressively simpler variants of the query, each a normal
    attempt inside the same deadline and retry budget, and answers with the first that finds
    something (or with the original empty answer)."""

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        ref = request_query(self.profile, flow.request)
        reply = await call_next(flow)
        if ref is None or not ref.is_text or self.classify(reply) is not Outcome.EMPTY:
            return reply
        request = flow.request
        for variant in simplify_query(ref.text, self.config.max_variants):
            if self.clock.now() >= flow.context.deadline:
                break
            path, query_string, body = replace_query(
                self.profile,
                ref,
                variant,
                path=request.path,
                query_string=request.query_string,
                body=request.body,
            )
            asked = replace(request, path=path, query_string=query_string, body=body)
            try:
                candidate = await call_next(flow.with_request(asked))
            except ProxyError:
                self.events.search_variant(self.route, "failed")
                break
            outcome = self.classify(candidate)
            if outcome is Outcome.OK:
                self.events.search_variant(self.route, "results")
                reply.discard()
                flow.trace.query_used = variant
                flow.trace.reply_headers["X-Search-Query-Used"] = quote(variant, safe="")
                return candidate
            empty = outcome is Outcome.EMPTY
            self.events.search_variant(self.route, "empty" if empty else "failed")
            candidate.discard()
            if not empty:
                break
        return reply


# ---------------------------------------------------------------------------------------------
# The `search:` section


def parse(raw: Any, path: str) -> SearchConfig:
    return section(
        raw,
        path,
        SearchConfig,
        {
            "vendor": text,
            "on_empty": one_of("simplify", "pass"),
            "max_variants": whole_in(0),
            "max_query_chars": whole_in(1),
            "loop_guard": parse_duration,
        },
        required=("vendor",),
    )


SECTION = Section("search", parse)


def build_guard(cfg: SearchConfig, route: Build) -> SearchGuard | None:
    # An MCP route's queries are tool arguments inside JSON-RPC: its tool calls are not guarded.
    if route.profile is None or route.route.has("mcp"):
        return None
    return SearchGuard(
        route.route.name, route.profile, cfg, route.classify, route.clock, route.events
    )


def build_recovery(cfg: SearchConfig, route: Build) -> SearchRecovery | None:
    if route.profile is None or cfg.on_empty != "simplify":
        return None
    name = route.route.name
    return SearchRecovery(name, route.profile, cfg, route.classify, route.clock, route.events)


GUARD = Link("search guard", SECTION, build_guard)
RECOVERY = Link("search recovery", SECTION, build_recovery)

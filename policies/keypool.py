"""Key pools: a route holding several keys of its vendor (`keys:`) sends each call with one of
the keys not benched, in turn, where the vendor's profile takes its key. A key the vendor paused
(429 with Retry-After) is benched for that long, a key out of credits (the profile's terminal
answer, or a 401/402) until its reset hint or `fallback.exhausted_for`; with Redis on every
replica. The call is re-sent at once with another free key, in the same attempt; only when
every key is benched does the request fail (`KeysBenched`), so failover takes over.

It sits last in the chain, under the rate limiter: one attempt, as the limiter and the retry
loop see it, may be one call per key. Metrics and logs name a key by `key_id`, never the key.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
from multidict import CIMultiDict

from policies.backoff import parse_retry_after
from policies.core.benched import EXHAUSTED_FOR_S, Benched, bench_seconds
from policies.core.clock import Clock
from policies.core.errors import KeysBenched, seconds_text
from policies.core.events import Events
from policies.core.flow import Classifier, Flow, Handler, Reply, Request
from policies.core.outcome import Outcome
from policies.core.profile import CredentialSlot
from policies.core.route import RouteConfig
from policies.core.section import Build, Link, Section
from policies.core.settings import FIELD_CONTROL, ConfigError
from policies.profiles import set_param, with_body_key

log = structlog.get_logger("search_proxy.keypool")

# Why a key is benched, as metrics label it and Benched records it.
RATE_LIMITED, EXHAUSTED = "rate_limited", "exhausted"
# Not a key but the caller's fault or the vendor's whim: bad keys and unpaid plans only.
_REFUSED_KEY = frozenset({401, 402})
# A key freed later than this before the request's deadline would only buy a timeout.
ROOM_FOR_ATTEMPT = 0.25


def key_id(key: str) -> str:
    """A key's short name for metrics, logs and Redis: 8 hex digits of its hash."""
    return hashlib.blake2b(key.encode(), digest_size=4).hexdigest()


@dataclass(frozen=True)
class KeysConfig:
    """A route's `keys:`: its vendor keys (an empty one, from an unset `${VAR:-}`, left out)."""

    keys: tuple[str, ...] = field(default=(), repr=False)


def parse(raw: Any, path: str) -> KeysConfig:
    """`keys: [key1, "${KEY_2}", ...]`. Messages name positions, never a key."""
    if not isinstance(raw, list):
        raise ConfigError(path, 'expected a list of API keys, like ["${TAVILY_KEY_1}", ...]')
    found: list[str] = []
    for i, value in enumerate(raw):
        where = f"{path}[{i}]"
        if not isinstance(value, str) or FIELD_CONTROL.search(value) or " " in value.strip():
            raise ConfigError(where, "expected an API key: one word of text")
        key = value.strip()
        if not key:
            continue  # an unset ${VAR:-}: that key is not configured
        if key in found or key_id(key) in map(key_id, found):
            raise ConfigError(where, f"repeats keys[{raw.index(value)}]: list each key once")
        found.append(key)
    return KeysConfig(tuple(found))


def document(cfg: KeysConfig) -> list[str]:
    return list(cfg.keys)


def check(cfg: KeysConfig, route: RouteConfig, path: str) -> list[ConfigError]:
    if not route.has("search"):
        return [ConfigError(path, "needs the route's search section (its vendor's key slot)")]
    return []


SECTION = Section("keys", parse, check, document=document)


class KeyPool:
    """Puts one of the route's keys on each call; see the module docstring."""

    def __init__(
        self,
        route: str,
        keys: tuple[str, ...],
        slot: CredentialSlot,
        benched: Benched,
        clock: Clock,
        events: Events,
        classify: Classifier,
        exhausted_for: float = EXHAUSTED_FOR_S,
        fields: tuple[str, ...] = (),
    ) -> None:
        self.route = route
        self.keys = keys
        self.fields = fields  # body fields the vendor also reads a key from: they get it too
        self.ids = tuple(key_id(k) for k in keys)
        self.slot = slot
        self.benched = benched
        self.clock = clock
        self.events = events
        self.classify = classify
        self.exhausted_for = exhausted_for
        self._names = tuple(f"{route}|key:{i}" for i in self.ids)  # what Benched records
        self._turn = 0

    def side_key(self) -> tuple[str, str]:
        """(header or parameter name, value) of the next key in turn, for a call outside any
        agent's request (the breaker's active probe)."""
        key = self.keys[self._turn % len(self.keys)]
        return self.slot.name, self.slot.prefix + key

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        if flow.request.own_key:  # the caller's own key for this vendor (/v1/search)
            return await call_next(flow)
        start, self._turn = self._turn, (self._turn + 1) % len(self.keys)
        tried: set[int] = set()
        waited = False
        while True:
            index, soonest = await self._free(start, tried)
            if index is None:
                if not tried and not waited and soonest <= self._allowance(flow):
                    await self.clock.sleep(soonest)  # the first key back is back soon enough
                    flow.trace.waited_seconds += soonest
                    flow.context.waited(soonest)
                    waited = True
                    continue
                raise await self._refusal(flow, soonest)
            reply = await call_next(flow.with_request(self._keyed(flow.request, index)))
            bench = self._bench_for(reply)
            self.events.key_call(self.route, self.ids[index], bench[1] if bench else "used")
            if bench is None:
                return reply
            try:
                if not flow.context.fault_test:  # an injected fault benches no key
                    await self.benched.mark(self._names[index], bench[0], bench[1])
                    log.info(
                        "key_benched",
                        route=self.route,
                        key=self.ids[index],
                        reason=bench[1],
                        seconds=round(bench[0], 3),
                    )
                tried.add(index)
                more, soonest = await self._free(start, tried)
                spent = more is None and bench[1] != RATE_LIMITED and await self._all_spent()
            except BaseException:
                reply.discard()  # cancelled meanwhile: its connection goes back
                raise
            calls = flow.context.calls  # the re-send is one more vendor call of the request
            if more is not None and (calls is None or calls.spend()):
                reply.discard()
                continue
            if more is not None or bench[1] == RATE_LIMITED or spent:
                # The vendor's own answer goes up as is: its pause (the limiter and the retry
                # loop honour it), the last call allowed, or every key spent (failover benches
                # the route as for one key).
                return reply
            reply.discard()
            # Calls were made: the refusal must not give the retry loop's call back.
            flow.trace.attempts += 1
            if calls is not None:
                calls.spend()
            raise await self._refusal(flow, soonest)

    async def _free(self, start: int, tried: set[int]) -> tuple[int | None, float]:
        """The first key from `start` on neither benched nor tried yet, or None and the seconds
        until the first benched one is free."""
        soonest = math.inf
        for step in range(len(self.keys)):
            index = (start + step) % len(self.keys)
            left = await self.benched.remaining(self._names[index])
            if left <= 0 and index not in tried:
                return index, 0.0
            if left > 0:
                soonest = min(soonest, left)
        return None, soonest

    async def _all_spent(self) -> bool:
        """Whether every key is benched out of credits (not merely paused)."""
        for name in self._names:
            if await self.benched.remaining(name) <= 0 or self.benched.why(name) != EXHAUSTED:
                return False
        return True

    def _allowance(self, flow: Flow) -> float:
        """How long the request may wait for a benched key to come back."""
        room = flow.context.deadline - self.clock.now() - ROOM_FOR_ATTEMPT
        return min(room, flow.context.wait_at_most)

    def _bench_for(self, reply: Reply) -> tuple[float, str] | None:
        """(seconds, why) the key that got `reply` is benched; None when the answer says
        nothing against the key."""
        hinted = parse_retry_after(reply.headers.get("Retry-After"), self.clock.wall())
        if self.classify(reply) is Outcome.TERMINAL or reply.status in _REFUSED_KEY:
            return bench_seconds(hinted, self.exhausted_for), EXHAUSTED
        if reply.status == 429 and hinted and hinted > 0:
            return hinted, RATE_LIMITED
        return None

    def _keyed(self, request: Request, index: int) -> Request:
        """`request` carrying key `index` where the vendor reads its key."""
        slot, key = self.slot, self.keys[index]
        if slot.kind == "query":
            return replace(request, query_string=set_param(request.query_string, slot.name, key))
        headers = CIMultiDict(request.headers)
        headers[slot.name] = slot.prefix + key
        # One key reaches the vendor: the agent's in a body field it also reads is replaced.
        body = with_body_key(request.body, self.fields, key)
        return replace(request, headers=headers, body=body)

    async def _refusal(self, flow: Flow, soonest: float) -> KeysBenched:
        """The error when every key is benched, saying why in numbers (never naming a key)."""
        self.events.keys_benched(self.route)
        whys = [self.benched.why(n) for n in self._names if await self.benched.remaining(n) > 0]
        spent = whys.count(EXHAUSTED)
        parts = [f"{spent} out of credits or refused"] if spent else []
        parts += [f"{len(whys) - spent} paused by the vendor"] if len(whys) > spent else []
        retry = seconds_text(soonest) if math.isfinite(soonest) else "a while"
        return KeysBenched(
            f"{self.route}: every one of the route's {len(self.keys)} API keys is benched "
            f"({', '.join(parts) or 'each refused this request'}); the first is free again "
            f"in {retry}: retry then, or use another provider",
            route=self.route,
            attempts=flow.trace.attempts,
            retry_after_s=soonest if math.isfinite(soonest) else None,
        )


def build(cfg: KeysConfig, route: Build) -> KeyPool | None:
    """The route's pool; none without keys (an unset `${VAR:-}` each: the caller's key passes).
    The document checks that the route's vendor takes a key (`key_slot`)."""
    profile = route.profile
    if not cfg.keys or profile is None or profile.key_slot is None:
        return None
    fallback = route.route.section("fallback")
    clock, redis = route.clock, route.redis
    return KeyPool(
        route.route.name,
        cfg.keys,
        profile.key_slot,
        route.once("benched", lambda: Benched(clock, redis)),
        clock,
        route.events,
        route.classify,
        exhausted_for=fallback.exhausted_for if fallback is not None else EXHAUSTED_FOR_S,
        fields=profile.key_fields,
    )


LINK = Link("key pool", SECTION, build)

"""Token-bucket rate limits per route or per caller, shared by all replicas through Redis.

`TokenBucket` is the pure math, `MemoryBuckets` and `RedisBuckets` keep the buckets, `RateLimit`
is the policy that takes a token before each upstream attempt and learns pauses from the vendor.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

import structlog

from policies.backoff import parse_retry_after
from policies.core.clock import Clock
from policies.core.errors import RateLimited, seconds_text
from policies.core.events import Events, NullEvents
from policies.core.flow import Flow, Handler, Reply
from policies.core.profile import VendorProfile
from policies.core.section import Build, Link, Section, plain
from policies.core.settings import (
    one_of,
    parse_duration,
    parse_rate,
    rate_text,
    section,
    text,
    whole_in,
)
from policies.core.shared import LATE, UNAVAILABLE
from policies.profiles import ratelimit_hint

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

log = structlog.get_logger("search_proxy.ratelimit")

# Float sums of intervals land a few ulps off; a wait this short is no wait.
_EPSILON = 1e-5
# A vendor header may say anything; a day covers daily quotas and keeps PX in range.
MAX_PAUSE = 86_400.0
# A token granted later than this before the request's deadline would only buy a timeout.
ROOM_FOR_ATTEMPT = 0.25
# Buckets one route keeps in a process by default (`rate_limit.max_clients`): with `key: client`
# every caller has its own, and callers cost nothing to invent.
MAX_CLIENTS = 10_000


@dataclass(frozen=True)
class RateLimitConfig:
    """A route's `rate_limit:` section."""

    rate: float  # tokens per second
    burst: int
    key: Literal["route", "client"] = "route"
    client_header: str | None = None  # identity header for key=client; default: credentials
    max_clients: int = MAX_CLIENTS  # buckets held in this process; the least recent go first
    # Longest a request queues for a token before it is refused; None: as long as its deadline
    # leaves room for the attempt itself.
    max_wait: float | None = None


@dataclass(frozen=True, slots=True)
class Grant:
    """A token is ours after sleeping `wait` seconds (0 = at once)."""

    wait: float


@dataclass(frozen=True, slots=True)
class Refusal:
    """No token within the allowed wait; one would be free in `retry_after` seconds."""

    retry_after: float
    paused: bool  # the vendor's pause, not our own rate, is what holds the bucket


Decision: TypeAlias = Grant | Refusal


class TokenBucket:
    """`burst` tokens refilled at `rate` per second; a taker may reserve a future token.

    The state is one instant, `full_at`: when the bucket will be full again. Tokens at time t are
    `burst - (full_at - t) * rate`, negative while future tokens are reserved. A pause holds every
    token until it ends, and the bucket restarts from one token then, so the requests it held
    leave at the configured rate instead of all at once.
    """

    __slots__ = ("_interval", "_span", "burst", "full_at", "paused_until", "rate")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be a positive number, got {rate!r}")
        if burst < 1:
            raise ValueError(f"burst must be at least 1, got {burst!r}")
        self.rate = rate
        self.burst = burst
        self._interval = 1.0 / rate
        self._span = burst * self._interval
        self.full_at = now
        self.paused_until = now

    def reserve(self, now: float, max_wait: float) -> Decision:
        """Take the next token if it is free within `max_wait` seconds; a refusal takes nothing."""
        full_at = max(self.full_at, now) + self._interval
        wait = max(full_at - self._span - now, self.paused_until - now, 0.0)
        if wait <= _EPSILON:
            wait = 0.0
        if wait > max_wait:
            return Refusal(wait, paused=self.paused_until > now)
        self.full_at = full_at
        return Grant(wait)

    def pause(self, now: float, seconds: float) -> None:
        """Grant nothing for `seconds`; a later pause extends, a shorter one changes nothing."""
        until = now + seconds
        self.paused_until = max(self.paused_until, until)
        self.full_at = max(self.full_at, until + self._span - self._interval)

    def paused_for(self, now: float) -> float:
        """Seconds left in the current pause (0 when not paused)."""
        return max(0.0, self.paused_until - now)

    def tokens(self, now: float) -> float:
        """Tokens free at `now`; below 0 while future tokens are reserved (requests queue)."""
        return self.burst - max(0.0, self.full_at - now) * self.rate

    def idle(self, now: float) -> bool:
        """Full and not paused: indistinguishable from a new bucket, so it may be dropped."""
        return self.full_at <= now and self.paused_until <= now


class BucketStore(Protocol):
    """Where one route's buckets live (one per route, chosen at start-up)."""

    async def acquire(self, key: str, max_wait: float) -> Decision:
        """Reserve a token from bucket `key`, waiting at most `max_wait` seconds for it."""
        ...

    async def pause(self, key: str, seconds: float) -> None:
        """Hold bucket `key` for `seconds` (the vendor asked us to back off)."""
        ...


class MemoryBuckets:
    """Buckets in this process: the store without Redis, and the fallback while Redis is down.

    At most `max_keys` buckets: past that, the least recently used one is evicted (its caller
    starts again from a full bucket), so callers inventing identities cannot grow the map.
    `events.buckets` reports the count and the evictions under `route`.
    """

    def __init__(
        self,
        rate: float,
        burst: int,
        clock: Clock,
        *,
        max_keys: int = MAX_CLIENTS,
        route: str = "",
        events: Events | None = None,
    ) -> None:
        TokenBucket(rate, burst, 0.0)  # validate once at start-up, not on first use
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys!r}")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.max_keys = max_keys
        self.route = route
        self.events = events or NullEvents()
        self.evicted = 0
        # Least recently used first.
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        # Idle buckets are dropped when the map doubles, well before the LRU bound bites.
        self._sweep_at = 1024

    def take(self, key: str, max_wait: float) -> Decision:
        """`acquire` without the await, for callers already on the hot path."""
        now = self.clock.now()
        return self._bucket(key, now).reserve(now, max_wait)

    async def acquire(self, key: str, max_wait: float) -> Decision:
        return self.take(key, max_wait)

    async def pause(self, key: str, seconds: float) -> None:
        now = self.clock.now()
        self._bucket(key, now).pause(now, seconds)

    def paused_for(self, key: str) -> float:
        """Seconds left in bucket `key`'s pause."""
        bucket = self._buckets.get(key)
        return 0.0 if bucket is None else bucket.paused_for(self.clock.now())

    def tokens(self, key: str) -> float:
        """Tokens free in bucket `key` now (a bucket not made yet is full)."""
        bucket = self._buckets.get(key)
        return float(self.burst) if bucket is None else bucket.tokens(self.clock.now())

    def __len__(self) -> int:
        return len(self._buckets)

    def _bucket(self, key: str, now: float) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is not None:
            self._buckets.move_to_end(key)
            return bucket
        if len(self._buckets) >= self._sweep_at:
            self._sweep(now)
        evicted = 0
        while len(self._buckets) >= self.max_keys:
            self._buckets.popitem(last=False)
            evicted += 1
        self.evicted += evicted
        bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, now)
        self.events.buckets(self.route, len(self._buckets), evicted)
        return bucket

    def _sweep(self, now: float) -> None:
        self._buckets = OrderedDict((k, b) for k, b in self._buckets.items() if not b.idle(now))
        self._sweep_at = max(1024, 2 * len(self._buckets))


# Both scripts read time from Redis (replicas' clocks differ) and keep times as milliseconds.
# Lua numbers returned to Redis are truncated to integers, so fractions go back as strings.
# KEYS[1] holds the bucket's full_at, KEYS[2] the pause's end; both share a {hash tag}.
_TIME_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
"""

ACQUIRE_SCRIPT = (
    """
-- ARGV: interval ms, burst, max wait ms, not-after ms (0: none).
-- Returns {granted 1|0, wait ms, pause left ms}, or {-1} when the caller gave up before this ran
-- (a command a stalled Redis ran late must not reserve tokens nobody will use).
"""
    + _TIME_MS
    + """
local not_after = tonumber(ARGV[4])
if not_after > 0 and now > not_after then return {-1} end
local interval = tonumber(ARGV[1])
local full_at = math.max(tonumber(redis.call('GET', KEYS[1])) or now, now) + interval
local paused = math.max((tonumber(redis.call('GET', KEYS[2])) or 0) - now, 0)
local wait = math.max(full_at - tonumber(ARGV[2]) * interval - now, paused, 0)
if wait <= 0.01 then wait = 0 end
if wait > tonumber(ARGV[3]) then
  return {0, string.format('%.3f', wait), string.format('%.3f', paused)}
end
-- The key lives exactly until the bucket is full again, when it means nothing.
redis.call('SET', KEYS[1], string.format('%.17g', full_at), 'PX', math.ceil(full_at - now))
return {1, string.format('%.3f', wait), string.format('%.3f', paused)}
"""
)

PAUSE_SCRIPT = (
    """
-- ARGV: interval ms, burst, pause ms. Same rule as TokenBucket.pause. Returns 1.
"""
    + _TIME_MS
    + """
local interval = tonumber(ARGV[1])
local ms = tonumber(ARGV[3])
local untl = now + ms
local prev = tonumber(redis.call('GET', KEYS[2]))
if prev == nil or prev < untl then
  redis.call('SET', KEYS[2], string.format('%.17g', untl), 'PX', math.ceil(ms))
end
local full_at = math.max(tonumber(redis.call('GET', KEYS[1])) or now,
                         untl + (tonumber(ARGV[2]) - 1) * interval)
redis.call('SET', KEYS[1], string.format('%.17g', full_at), 'PX', math.ceil(full_at - now))
return 1
"""
)


class RedisBuckets:
    """Buckets shared by every replica: one EVALSHA per acquire, in-process while Redis is down.

    A pause is also kept locally, so it holds even if Redis loses it; the local buckets take no
    tokens while Redis answers, so each replica starts an outage with a full burst.
    """

    def __init__(
        self,
        link: RedisLink,
        rate: float,
        burst: int,
        clock: Clock,
        *,
        max_keys: int = MAX_CLIENTS,
        route: str = "",
        events: Events | None = None,
    ) -> None:
        self.link = link
        self.clock = clock
        self.local = MemoryBuckets(
            rate, burst, clock, max_keys=max_keys, route=route, events=events
        )
        self._interval_ms = repr(1000.0 / rate)
        self._burst = str(burst)
        self._prefix = link.key("ratelimit", "{")
        self._acquire = link.client.register_script(ACQUIRE_SCRIPT)
        self._pause = link.client.register_script(PAUSE_SCRIPT)

    def keys(self, key: str) -> tuple[str, str]:
        """The Redis keys of bucket `key`: its full_at and its pause."""
        bucket = f"{self._prefix}{key}}}"
        return bucket, bucket + ":pause"

    async def acquire(self, key: str, max_wait: float) -> Decision:
        local_pause = self.local.paused_for(key)
        if local_pause > max_wait:
            return Refusal(local_pause, paused=True)
        args = (self._interval_ms, self._burst, f"{max(0.0, max_wait) * 1000:.3f}")
        keys = self.keys(key)
        result = await self.link.run(
            lambda r: self._acquire(keys=keys, args=(*args, self.link.not_after()), client=r)
        )
        if result is not UNAVAILABLE and result[0] == LATE:
            self.link.resync()  # we were still waiting: our idea of Redis's clock is off
            result = UNAVAILABLE
        if result is UNAVAILABLE:
            return self.local.take(key, max_wait)
        granted, wait_ms, paused_ms = result
        wait = max(float(wait_ms) / 1000, local_pause)
        if not granted:
            return Refusal(wait, paused=float(paused_ms) > 0 or local_pause > 0)
        return Grant(wait)

    async def pause(self, key: str, seconds: float) -> None:
        await self.local.pause(key, seconds)
        args = (self._interval_ms, self._burst, f"{seconds * 1000:.3f}")
        keys = self.keys(key)
        await self.link.run(lambda r: self._pause(keys=keys, args=args, client=r))


def bucket_store(
    config: RateLimitConfig,
    clock: Clock,
    link: RedisLink | None,
    *,
    route: str = "",
    events: Events | None = None,
) -> BucketStore:
    """The store for one route: shared through Redis when a link is configured, else in-process.
    Either way at most `config.max_clients` buckets stay in this process."""
    rate, burst, bound = config.rate, config.burst, config.max_clients
    if link is None:
        return MemoryBuckets(rate, burst, clock, max_keys=bound, route=route, events=events)
    return RedisBuckets(link, rate, burst, clock, max_keys=bound, route=route, events=events)


Hint = Callable[[Reply], float | None]
"""Seconds to pause the bucket, read from an upstream reply before the vendor answers 429."""


def quota_hint(remaining: str = "X-RateLimit-Remaining", reset: str = "X-RateLimit-Reset") -> Hint:
    """A hint for `Remaining: 0` + `Reset: <seconds>` headers, comma lists included (Brave)."""

    def hint(reply: Reply) -> float | None:
        left = reply.headers.get(remaining)
        if left is None or "0" not in left:
            return None
        resets = reply.headers.get(reset, "").split(",")
        pause: float | None = None
        for i, count in enumerate(left.split(",")):
            if count.strip() != "0" or i >= len(resets):
                continue
            try:
                seconds = float(resets[i])
            except ValueError:
                continue
            if math.isfinite(seconds) and seconds > 0:
                pause = seconds if pause is None else max(pause, seconds)
        return pause

    return hint


def _rate_text(rate: float) -> str:
    if rate >= 1:
        return f"{round(rate, 3):g}/s"
    if rate * 60 >= 1:
        return f"{round(rate * 60, 3):g}/m"
    return f"{round(rate * 3600, 3):g}/h"


class RateLimit:
    """Takes a token before each upstream attempt (it runs inside the retry loop).

    Callers queue in arrival order: each reserves the next free token and sleeps until it is
    due (delayed), for at most `max_wait` and never past its deadline less ROOM_FOR_ATTEMPT;
    beyond that it gets `RateLimited` with the time until a token is free. A vendor 429 with
    Retry-After, or a `hint`, pauses the bucket on every replica.
    """

    def __init__(
        self,
        route: str,
        config: RateLimitConfig,
        store: BucketStore,
        clock: Clock,
        events: Events,
        hint: Hint | None = None,
    ) -> None:
        self.route = route
        self.config = config
        self.store = store
        self.clock = clock
        self.events = events
        self.hint = hint
        self._per_client = config.key == "client"
        self._route_key = route
        self._client_prefix = route + "|"
        per = " per client" if self._per_client else ""
        self._limit_text = f"rate limit of {_rate_text(config.rate)}{per}"

    def tokens(self) -> float | None:
        """Tokens in the route's bucket now, below 0 while requests queue for reserved ones;
        None when there is no one bucket here to read (per client, or shared through Redis)."""
        if self._per_client or not isinstance(self.store, MemoryBuckets):
            return None
        return self.store.tokens(self._route_key)

    def bucket_key(self, flow: Flow) -> str:
        """The bucket this request draws from: the route's, or its caller's."""
        if not self._per_client:
            return self._route_key
        identity = None
        if self.config.client_header is not None:
            identity = flow.request.headers.get(self.config.client_header)
        if identity is None:
            identity = flow.request.client or "anonymous"
        # Identity headers may carry credentials: only a digest goes into keys. surrogateescape:
        # a header's bytes that were not UTF-8 count as they came, and never raise.
        raw = identity.encode("utf-8", "surrogateescape")
        digest = hashlib.blake2b(raw, digest_size=8).hexdigest()
        return self._client_prefix + digest

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        key = self.bucket_key(flow)
        allowed = flow.context.deadline - self.clock.now() - ROOM_FOR_ATTEMPT
        if self.config.max_wait is not None:
            allowed = min(allowed, self.config.max_wait)
        # While a fallback can be asked, a queue longer than this sends it there instead.
        allowed = max(0.0, min(allowed, flow.context.wait_at_most))
        decision = await self.store.acquire(key, allowed)
        if isinstance(decision, Refusal):
            self.events.ratelimit(self.route, "rejected", 0.0)
            raise RateLimited(
                self._refusal_text(decision),
                route=self.route,
                attempts=flow.trace.attempts,
                retry_after_s=decision.retry_after,
            )
        if decision.wait > 0:
            await self.clock.sleep(decision.wait)
            flow.context.waited(decision.wait)
            self.events.ratelimit(self.route, "delayed", decision.wait)
        else:
            self.events.ratelimit(self.route, "allowed", 0.0)
        reply = await call_next(flow)
        pause = 0.0 if flow.context.fault_test else self.pause_for(reply)
        if pause > 0:
            log.info("ratelimit_paused", route=self.route, seconds=round(pause, 3))
            try:
                await self.store.pause(key, pause)
            except BaseException:
                reply.discard()  # cancelled meanwhile: its connection goes back
                raise
        return reply

    def pause_for(self, reply: Reply) -> float:
        """Seconds the vendor's reply asks us to hold the bucket (0 = none)."""
        pause = 0.0
        if reply.status == 429:
            pause = parse_retry_after(reply.headers.get("Retry-After"), self.clock.wall()) or 0.0
        if self.hint is not None:
            hinted = self.hint(reply)
            if hinted is not None and math.isfinite(hinted):
                pause = max(pause, hinted)
        return min(pause, MAX_PAUSE)

    def _refusal_text(self, refusal: Refusal) -> str:
        retry = seconds_text(refusal.retry_after)
        if refusal.paused:
            return (
                f"{self.route}: the vendor asked search-proxy to pause calls (Retry-After or an "
                f"exhausted rate-limit window); the pause ends in {retry}; retry then or use "
                "another provider"
            )
        return (
            f"{self.route}: search-proxy's own {self._limit_text} is reached (this is the "
            f"proxy's limit, not the vendor's: the vendor plan is not exhausted); "
            f"retry in {retry}"
        )


# ---------------------------------------------------------------------------------------------
# The `rate_limit:` section


def parse(raw: Any, path: str) -> RateLimitConfig:
    return section(
        raw,
        path,
        RateLimitConfig,
        {
            "rate": parse_rate,
            "burst": whole_in(1, 1_000_000),
            "key": one_of("route", "client"),
            "client_header": text,
            "max_clients": whole_in(1, 10_000_000),
            "max_wait": parse_duration,
        },
        required=("rate", "burst"),
    )


def document(cfg: RateLimitConfig) -> dict[str, Any]:
    doc: dict[str, Any] = plain(cfg)
    doc["rate"] = rate_text(cfg.rate)
    return doc


SECTION = Section("rate_limit", parse, document=document)


def profile_hint(profile: VendorProfile, clock: Clock) -> Hint:
    """Pause the bucket when the vendor's headers say the quota is spent (before the 429)."""

    def hint(reply: Reply) -> float | None:
        found = ratelimit_hint(profile, reply.headers, now=clock.wall())
        if found is None or found.remaining > 0:
            return None
        return found.reset_s

    return hint


def build(cfg: RateLimitConfig, route: Build) -> RateLimit:
    profile = route.profile
    hint = profile_hint(profile, route.clock) if profile and profile.ratelimit_headers else None
    name = route.route.name
    # A reload keeps the buckets (tokens spent, pauses, queued reservations) while the section
    # is unchanged.
    store = route.keep(
        "rate limit buckets",
        cfg,
        lambda: bucket_store(cfg, route.clock, route.redis, route=name, events=route.events),
    )
    return RateLimit(name, cfg, store, route.clock, route.events, hint=hint or quota_hint())


LINK = Link("rate limit", SECTION, build)

"""Tests for token-bucket rate limits: the math on a ManualClock, the policy's decisions, and the
Redis-shared buckets against a real redis-server (two links standing for two replicas)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from email.utils import formatdate

import pytest
from multidict import CIMultiDict
from redis.asyncio import Redis

from policies.core.clock import SYSTEM_CLOCK, ManualClock
from policies.core.errors import RateLimited
from policies.core.events import NullEvents
from policies.core.flow import Flow, Reply
from policies.core.redislink import RedisLink
from policies.ratelimit import (
    MAX_PAUSE,
    ROOM_FOR_ATTEMPT,
    Grant,
    MemoryBuckets,
    RateLimit,
    RateLimitConfig,
    RedisBuckets,
    Refusal,
    TokenBucket,
    bucket_store,
    quota_hint,
)
from proxy.config import parse_rate
from testkit.redisserver import RedisServer, redis_time


class RecordingEvents(NullEvents):
    def __init__(self) -> None:
        self.ratelimits: list[tuple[str, str, float]] = []

    def ratelimit(self, route: str, decision: str, waited_s: float) -> None:
        self.ratelimits.append((route, decision, waited_s))


class Upstream:
    """The next step of the chain: answers `reply` and records when it was called."""

    def __init__(self, clock: ManualClock, reply: Reply | None = None) -> None:
        self.clock = clock
        self.reply = reply or Reply(200, CIMultiDict())
        self.called_at: list[float] = []

    async def __call__(self, flow: Flow) -> Reply:
        self.called_at.append(self.clock.now())
        return self.reply


def make_flow(
    clock: ManualClock,
    deadline_in: float = 30.0,
    client: str = "caller-a",
    headers: dict[str, str] | None = None,
) -> Flow:
    return Flow.new(
        route="tavily",
        method="POST",
        path="/search",
        query_string="",
        headers=CIMultiDict(headers or {}),
        body=b"{}",
        request_id="req-1",
        client=client,
        deadline=clock.now() + deadline_in,
        started=clock.now(),
    )


def reply(status: int, **headers: str) -> Reply:
    return Reply(status, CIMultiDict({k.replace("_", "-"): v for k, v in headers.items()}))


def waits(decisions: list[Grant | Refusal]) -> list[float]:
    return [round(d.wait, 6) for d in decisions if isinstance(d, Grant)]


# --- the bucket math ------------------------------------------------------------------------


async def test_burst_is_granted_at_once_then_refused_with_time_to_next_token() -> None:
    clock = ManualClock()
    store = MemoryBuckets(rate=10, burst=3, clock=clock)
    granted = [await store.acquire("k", 0) for _ in range(3)]
    assert granted == [Grant(0.0)] * 3
    refused = await store.acquire("k", 0)
    assert isinstance(refused, Refusal)
    assert refused.retry_after == pytest.approx(0.1)
    assert refused.paused is False


async def test_tokens_refill_at_rate_and_never_beyond_burst() -> None:
    clock = ManualClock()
    store = MemoryBuckets(rate=10, burst=3, clock=clock)
    for _ in range(3):
        await store.acquire("k", 0)
    clock.advance(0.25)  # 2.5 tokens back
    assert [await store.acquire("k", 0) for _ in range(2)] == [Grant(0.0)] * 2
    third = await store.acquire("k", 0)
    assert isinstance(third, Refusal)
    assert third.retry_after == pytest.approx(0.05)

    clock.advance(100)  # a long idle refills to burst, not to 1000 tokens
    grants = [await store.acquire("k", 0) for _ in range(4)]
    assert grants[:3] == [Grant(0.0)] * 3
    assert isinstance(grants[3], Refusal)


async def test_reservations_wait_in_line_for_future_tokens() -> None:
    clock = ManualClock()
    store = MemoryBuckets(rate=10, burst=1, clock=clock)
    decisions = [await store.acquire("k", 1.0) for _ in range(5)]
    assert waits(decisions) == [0.0, 0.1, 0.2, 0.3, 0.4]


async def test_a_wait_of_exactly_the_allowed_wait_is_granted_and_beyond_is_refused() -> None:
    clock = ManualClock()
    store = MemoryBuckets(rate=4, burst=1, clock=clock)
    await store.acquire("k", 0)
    assert await store.acquire("k", 0.25) == Grant(0.25)
    refused = await store.acquire("k", 0.49)
    assert isinstance(refused, Refusal)
    assert refused.retry_after == pytest.approx(0.5)


async def test_a_refusal_reserves_nothing() -> None:
    clock = ManualClock()
    store = MemoryBuckets(rate=10, burst=1, clock=clock)
    await store.acquire("k", 0)
    for _ in range(5):
        assert isinstance(await store.acquire("k", 0.05), Refusal)
    # Had the refusals reserved tokens, this wait would be 0.6 s.
    assert await store.acquire("k", 1.0) == Grant(pytest.approx(0.1))


async def test_per_minute_rates_space_tokens_evenly() -> None:
    clock = ManualClock()
    store = MemoryBuckets(rate=parse_rate("600/m", "rate"), burst=1, clock=clock)
    assert waits([await store.acquire("k", 1.0) for _ in range(3)]) == [0.0, 0.1, 0.2]
    slow = MemoryBuckets(rate=parse_rate("3/m", "rate"), burst=2, clock=clock)
    await slow.acquire("k", 0)
    await slow.acquire("k", 0)
    refused = await slow.acquire("k", 0)
    assert isinstance(refused, Refusal)
    assert refused.retry_after == pytest.approx(20.0)


async def test_buckets_with_different_keys_are_independent() -> None:
    clock = ManualClock()
    store = MemoryBuckets(rate=1, burst=1, clock=clock)
    assert await store.acquire("a", 0) == Grant(0.0)
    assert await store.acquire("b", 0) == Grant(0.0)
    assert isinstance(await store.acquire("a", 0), Refusal)


def test_bucket_rejects_impossible_settings() -> None:
    with pytest.raises(ValueError, match="rate"):
        TokenBucket(0, 1, 0.0)
    with pytest.raises(ValueError, match="burst"):
        TokenBucket(1, 0, 0.0)


async def test_idle_buckets_are_dropped_so_per_client_keys_do_not_grow_forever() -> None:
    clock = ManualClock()
    store = MemoryBuckets(rate=100, burst=1, clock=clock)
    for i in range(1024):
        await store.acquire(f"client-{i}", 0)
    clock.advance(0.02)  # every bucket is full again, so idle
    await store.acquire("client-0", 0)  # busy again: must survive the sweep
    await store.acquire("new-client", 0)
    assert len(store) == 2
    assert isinstance(await store.acquire("client-0", 0), Refusal)


# --- pauses -----------------------------------------------------------------------------------


async def test_pause_holds_every_token_then_restarts_from_one_token() -> None:
    clock = ManualClock()
    store = MemoryBuckets(rate=10, burst=5, clock=clock)
    await store.pause("k", 3.0)
    refused = await store.acquire("k", 1.0)
    assert isinstance(refused, Refusal)
    assert refused.paused is True
    assert refused.retry_after == pytest.approx(3.0)
    # Requests allowed to wait leave one token apart after the pause, not as a burst.
    assert waits([await store.acquire("k", 5.0) for _ in range(3)]) == [3.0, 3.1, 3.2]


async def test_pause_ends_by_itself_and_a_shorter_pause_does_not_shorten_it() -> None:
    clock = ManualClock()
    store = MemoryBuckets(rate=10, burst=5, clock=clock)
    await store.pause("k", 3.0)
    clock.advance(1.0)
    await store.pause("k", 0.5)
    assert store.paused_for("k") == pytest.approx(2.0)
    clock.advance(2.0)
    assert store.paused_for("k") == 0.0
    assert await store.acquire("k", 0) == Grant(0.0)


# --- the policy -------------------------------------------------------------------------------


def make_policy(
    clock: ManualClock,
    rate: float = 10,
    burst: int = 1,
    max_wait: float | None = 1.0,
    key: str = "route",
    client_header: str | None = None,
    hint: Callable[[Reply], float | None] | None = None,
) -> tuple[RateLimit, MemoryBuckets, RecordingEvents]:
    config = RateLimitConfig(
        rate=rate, burst=burst, key=key, client_header=client_header, max_wait=max_wait
    )
    store = MemoryBuckets(config.rate, config.burst, clock)
    events = RecordingEvents()
    return RateLimit("tavily", config, store, clock, events, hint=hint), store, events


async def test_policy_allows_a_request_with_a_free_token_without_waiting() -> None:
    clock = ManualClock()
    policy, _, events = make_policy(clock)
    upstream = Upstream(clock)
    result = await policy.handle(make_flow(clock), upstream)
    assert result is upstream.reply
    assert upstream.called_at == [1000.0]
    assert clock.sleeps == []
    assert events.ratelimits == [("tavily", "allowed", 0.0)]


async def test_policy_delays_a_request_until_its_reserved_token_then_calls_upstream() -> None:
    clock = ManualClock()
    policy, _, events = make_policy(clock, rate=10, burst=1, max_wait=1.0)
    upstream = Upstream(clock)
    await policy.handle(make_flow(clock), upstream)
    await policy.handle(make_flow(clock), upstream)
    assert clock.sleeps == [pytest.approx(0.1)]
    assert upstream.called_at == [1000.0, pytest.approx(1000.1)]
    assert events.ratelimits[1] == ("tavily", "delayed", pytest.approx(0.1))


async def test_policy_rejects_with_retry_after_and_an_actionable_message() -> None:
    clock = ManualClock()
    policy, _, events = make_policy(clock, rate=10, burst=2, max_wait=0)
    upstream = Upstream(clock)
    await policy.handle(make_flow(clock), upstream)
    await policy.handle(make_flow(clock), upstream)
    flow = make_flow(clock)
    flow.trace.attempts = 1
    with pytest.raises(RateLimited) as caught:
        await policy.handle(flow, upstream)
    err = caught.value
    assert err.status == 429
    assert err.retry_after_s == pytest.approx(0.1)
    assert err.message == (
        "tavily: search-proxy's own rate limit of 10/s is reached (this is the proxy's limit, "
        "not the vendor's: the vendor plan is not exhausted); retry in 100ms"
    )
    assert err.route == "tavily"
    assert err.attempts == 1
    assert err.response_headers()["Retry-After"] == "1"
    assert len(upstream.called_at) == 2
    assert events.ratelimits[-1] == ("tavily", "rejected", 0.0)


async def test_policy_wait_is_capped_by_the_deadline() -> None:
    clock = ManualClock()
    policy, _, events = make_policy(clock, rate=10, burst=1, max_wait=5.0)
    upstream = Upstream(clock)
    await policy.handle(make_flow(clock), upstream)
    # The next token is due in 0.1 s; the deadline must also leave room for the attempt.
    with pytest.raises(RateLimited):
        await policy.handle(make_flow(clock, deadline_in=0.05 + ROOM_FOR_ATTEMPT), upstream)
    await policy.handle(make_flow(clock, deadline_in=0.15 + ROOM_FOR_ATTEMPT), upstream)
    assert clock.sleeps == [pytest.approx(0.1)]
    assert [d for _, d, _ in events.ratelimits] == ["allowed", "rejected", "delayed"]


async def test_policy_past_its_deadline_only_takes_a_free_token() -> None:
    clock = ManualClock()
    policy, _, _ = make_policy(clock, rate=10, burst=1, max_wait=5.0)
    upstream = Upstream(clock)
    await policy.handle(make_flow(clock, deadline_in=-1.0), upstream)
    with pytest.raises(RateLimited):
        await policy.handle(make_flow(clock, deadline_in=-1.0), upstream)


async def test_vendor_429_with_retry_after_seconds_pauses_the_bucket() -> None:
    clock = ManualClock()
    policy, store, _ = make_policy(clock, rate=100, burst=50, max_wait=0)
    await policy.handle(make_flow(clock), Upstream(clock, reply(429, Retry_After="3")))
    assert store.paused_for("tavily") == pytest.approx(3.0)
    with pytest.raises(RateLimited) as caught:
        await policy.handle(make_flow(clock), Upstream(clock))
    assert caught.value.retry_after_s == pytest.approx(3.0)
    assert caught.value.message.startswith("tavily: the vendor asked search-proxy to pause")
    assert "the pause ends in 3s" in caught.value.message


async def test_vendor_429_with_an_http_date_pauses_until_that_date() -> None:
    clock = ManualClock()
    policy, _, _ = make_policy(clock, rate=100, burst=50, max_wait=5.0)
    date = formatdate(clock.wall() + 4, usegmt=True)
    await policy.handle(make_flow(clock), Upstream(clock, reply(429, Retry_After=date)))
    upstream = Upstream(clock)
    await policy.handle(make_flow(clock), upstream)
    assert clock.sleeps == [pytest.approx(4.0)]
    assert upstream.called_at == [pytest.approx(1004.0)]


@pytest.mark.parametrize(
    "answer",
    [reply(429), reply(429, Retry_After="soon"), reply(503, Retry_After="5"), reply(200)],
    ids=["429-without-retry-after", "unreadable", "not-a-429", "ok"],
)
async def test_replies_that_do_not_ask_for_a_pause_leave_the_bucket_alone(answer: Reply) -> None:
    clock = ManualClock()
    policy, store, _ = make_policy(clock, rate=100, burst=50)
    await policy.handle(make_flow(clock), Upstream(clock, answer))
    assert store.paused_for("tavily") == 0.0


async def test_an_absurd_retry_after_is_capped_at_a_day() -> None:
    clock = ManualClock()
    policy, store, _ = make_policy(clock)
    huge = reply(429, Retry_After="99999999999999999999")
    await policy.handle(make_flow(clock), Upstream(clock, huge))
    assert store.paused_for("tavily") == MAX_PAUSE


async def test_a_quota_hint_pauses_before_the_vendor_answers_429() -> None:
    clock = ManualClock()
    policy, store, _ = make_policy(clock, rate=100, burst=50, hint=quota_hint())
    spent = reply(200, X_RateLimit_Remaining="0", X_RateLimit_Reset="2")
    await policy.handle(make_flow(clock), Upstream(clock, spent))
    assert store.paused_for("tavily") == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("remaining", "reset", "expected"),
    [
        ("0", "2", 2.0),
        ("3", "2", None),
        ("10", "2", None),
        ("5, 0", "1, 3600", 3600.0),  # Brave: per-second and per-month windows
        ("0, 0", "1, 3600", 3600.0),
        ("0", "", None),
        ("0", "later", None),
    ],
)
def test_quota_hint_reads_remaining_and_reset_windows(
    remaining: str, reset: str, expected: float | None
) -> None:
    hint = quota_hint()
    answer = reply(200, X_RateLimit_Remaining=remaining, X_RateLimit_Reset=reset)
    assert hint(answer) == expected
    assert hint(reply(200)) is None


async def test_per_client_keys_give_each_caller_its_own_bucket() -> None:
    clock = ManualClock()
    policy, _, _ = make_policy(clock, rate=1, burst=1, max_wait=0, key="client")
    upstream = Upstream(clock)
    await policy.handle(make_flow(clock, client="caller-a"), upstream)
    await policy.handle(make_flow(clock, client="caller-b"), upstream)
    with pytest.raises(RateLimited) as caught:
        await policy.handle(make_flow(clock, client="caller-a"), upstream)
    assert "rate limit of 1/s per client" in caught.value.message
    assert len(upstream.called_at) == 2


async def test_client_header_names_the_caller_and_its_value_never_appears_in_the_key() -> None:
    clock = ManualClock()
    policy, _, _ = make_policy(clock, rate=1, burst=1, max_wait=0, key="client",
                               client_header="X-Agent-Id")  # fmt: skip
    upstream = Upstream(clock)
    same_creds = [make_flow(clock, client="shared", headers={"X-Agent-Id": a}) for a in "ab"]
    for flow in same_creds:
        await policy.handle(flow, upstream)
    key = policy.bucket_key(make_flow(clock, headers={"X-Agent-Id": "secret-agent-key"}))
    assert key.startswith("tavily|")
    assert "secret" not in key
    # Without the header, the credential hash decides.
    assert policy.bucket_key(make_flow(clock, client="x")) != policy.bucket_key(
        make_flow(clock, client="y")
    )


def test_bucket_store_is_in_process_without_a_link() -> None:
    store = bucket_store(RateLimitConfig(rate=1, burst=1), ManualClock(), None)
    assert isinstance(store, MemoryBuckets)


# --- shared through Redis ---------------------------------------------------------------------


async def test_two_replicas_never_grant_more_than_burst_plus_rate_times_elapsed(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    rate, burst = 40.0, 5
    replicas = [RedisBuckets(link, rate, burst, SYSTEM_CLOCK) for link in links]
    granted = [0, 0]

    async def hammer(i: int, until: float) -> None:
        while time.monotonic() < until:
            if isinstance(await replicas[i].acquire("tavily", 0), Grant):
                granted[i] += 1

    started = await redis_time(raw)  # the buckets' clock
    until = time.monotonic() + 0.4
    await asyncio.gather(*(hammer(i % 2, until) for i in range(8)))
    elapsed = await redis_time(raw) - started  # every grant happened inside this span
    total = sum(granted)
    assert total <= burst + rate * elapsed + 1e-9
    # The limiter must actually be granting, and to both replicas.
    assert total >= burst + rate * 0.4 * 0.7
    assert min(granted) > 0


async def test_reservations_from_two_replicas_line_up_one_interval_apart(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    replicas = [RedisBuckets(link, 10.0, 1, SYSTEM_CLOCK) for link in links]
    # Each grant's moment (when its script ran, plus the wait it gave) lies in a window: the
    # script ran between the Redis times read before and after it (a slow round trip widens
    # the window, never moves the moment).
    windows = []
    for i in range(6):
        before = await redis_time(raw)
        decision = await replicas[i % 2].acquire("tavily", 10.0)
        after = await redis_time(raw)
        assert isinstance(decision, Grant)
        windows.append((before + decision.wait, after + decision.wait))
    # The moments are one interval apart whichever replica asked: some first moment t0 has
    # every grant i at t0 + 0.1 * i, within its window (10 ms of slack for the clocks).
    earliest = max(lo - 0.1 * i for i, (lo, _) in enumerate(windows)) - 0.01
    latest = min(hi - 0.1 * i for i, (_, hi) in enumerate(windows)) + 0.01
    assert earliest <= latest, windows


async def test_fractions_of_a_second_survive_the_lua_script(
    links: tuple[RedisLink, RedisLink],
) -> None:
    store = RedisBuckets(links[0], 3.0, 1, SYSTEM_CLOCK)
    await store.acquire("tavily", 0)
    refusals = [await store.acquire("tavily", 0.1) for _ in range(3)]
    assert all(isinstance(r, Refusal) for r in refusals)
    assert refusals[0].retry_after == pytest.approx(1 / 3, abs=0.01)
    # A Lua number would come back as whole milliseconds; real time makes sub-ms parts.
    assert any(round(r.retry_after * 1000, 3) % 1 for r in refusals)


async def test_one_evalsha_round_trip_per_acquire(
    links: tuple[RedisLink, RedisLink], raw: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RedisBuckets(links[0], 1000.0, 100, SYSTEM_CLOCK)
    await store.acquire("tavily", 0)  # the first call loads the script
    sent: list[str] = []
    execute = links[0].client.execute_command

    async def counting(*args: object, **options: object) -> object:
        sent.append(str(args[0]))
        return await execute(*args, **options)

    monkeypatch.setattr(links[0].client, "execute_command", counting)
    await raw.config_resetstat()
    for _ in range(5):
        await store.acquire("tavily", 0)
    assert sent == ["EVALSHA"] * 5
    stats = await raw.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 5
    assert stats["cmdstat_time"]["calls"] == 5  # time is read inside the script


async def test_bucket_keys_expire_when_the_bucket_is_full_again(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    store = RedisBuckets(links[0], 10.0, 5, SYSTEM_CLOCK)
    await store.acquire("tavily", 0)
    await store.acquire("tavily", 0)
    bucket, pause = store.keys("tavily")
    assert bucket.startswith("test:ratelimit:{")
    assert 100 < await raw.pttl(bucket) <= 200
    await store.pause("tavily", 5.0)
    assert 4900 < await raw.pttl(pause) <= 5000
    # Drained at the pause's end: full again 5 s + 4 intervals from now.
    assert 5300 < await raw.pttl(bucket) <= 5400


async def test_a_pause_on_one_replica_holds_the_other(
    links: tuple[RedisLink, RedisLink],
) -> None:
    a, b = (RedisBuckets(link, 100.0, 50, SYSTEM_CLOCK) for link in links)
    await a.pause("tavily", 2.0)
    refused = await b.acquire("tavily", 0.5)
    assert isinstance(refused, Refusal)
    assert refused.paused is True
    assert refused.retry_after == pytest.approx(2.0, abs=0.05)
    waited = await b.acquire("tavily", 5.0)
    assert isinstance(waited, Grant)
    assert waited.wait == pytest.approx(2.0, abs=0.05)


async def test_a_pause_holds_locally_even_if_redis_loses_it(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    store = RedisBuckets(links[0], 100.0, 50, SYSTEM_CLOCK)
    await store.pause("tavily", 2.0)
    await raw.flushall()
    refused = await store.acquire("tavily", 0)
    assert isinstance(refused, Refusal)
    assert refused.retry_after == pytest.approx(2.0, abs=0.05)
    # Redis has a fresh bucket with no pause; the local pause still sets the wait.
    waited = await store.acquire("tavily", 5.0)
    assert isinstance(waited, Grant)
    assert waited.wait == pytest.approx(2.0, abs=0.05)


async def test_a_vendor_429_seen_by_one_replica_rejects_requests_on_the_other(
    links: tuple[RedisLink, RedisLink],
) -> None:
    clock = ManualClock()  # drives deadlines and sleeps; bucket time comes from Redis
    config = RateLimitConfig(rate=100, burst=50, max_wait=0.5)
    policies = [
        RateLimit("tavily", config, RedisBuckets(link, 100, 50, clock), clock, NullEvents())
        for link in links
    ]
    await policies[0].handle(make_flow(clock), Upstream(clock, reply(429, Retry_After="7")))
    with pytest.raises(RateLimited) as caught:
        await policies[1].handle(make_flow(clock), Upstream(clock))
    assert caught.value.retry_after_s == pytest.approx(7.0, abs=0.05)
    assert "vendor asked search-proxy to pause" in caught.value.message


async def test_redis_dying_falls_back_to_local_buckets_and_recovers_by_itself(
    killable_redis: RedisServer,
) -> None:
    # A rate of one token per 5 s keeps local buckets from refilling during the test.
    links = [RedisLink(killable_redis.url, "test", retry_interval=0.05) for _ in range(2)]
    a, b = (RedisBuckets(link, 0.2, 3, SYSTEM_CLOCK) for link in links)
    try:
        assert [await a.acquire("tavily", 0) for _ in range(3)] == [Grant(0.0)] * 3
        assert isinstance(await b.acquire("tavily", 0), Refusal)  # shared: a took the burst

        killable_redis.stop()
        outcomes: dict[str, list[bool]] = {"a": [], "b": []}
        for _ in range(10):
            for name, store in (("a", a), ("b", b)):
                async with asyncio.timeout(0.2):  # a dead Redis must not stall a decision
                    decision = await store.acquire("tavily", 0)
                outcomes[name].append(isinstance(decision, Grant))
        # Each replica's own bucket serves its burst at once, then limits at its rate.
        assert outcomes["a"] == [True] * 3 + [False] * 7
        assert outcomes["b"] == [True] * 3 + [False] * 7
        assert not links[0].up

        killable_redis.start()
        await asyncio.sleep(0.06)  # past the links' retry interval
        # Both local buckets are empty now, so grants can only come from the fresh shared one.
        assert await b.acquire("tavily", 0) == Grant(0.0)
        assert [await a.acquire("tavily", 0) for _ in range(2)] == [Grant(0.0)] * 2
        assert links[0].up and links[1].up
        assert isinstance(await b.acquire("tavily", 0), Refusal)
    finally:
        for link in links:
            await link.close()


async def test_without_max_wait_a_burst_queues_in_arrival_order_up_to_each_deadline() -> None:
    """A burst of parallel tool calls waits its turn instead of being refused: the reserved
    tokens come due one interval apart, in the order the requests arrived."""
    clock = ManualClock()
    config = RateLimitConfig(rate=10, burst=2)  # no max_wait: queue up to the deadline
    store = MemoryBuckets(config.rate, config.burst, clock)
    decisions = [await store.acquire("tavily", 30.0 - ROOM_FOR_ATTEMPT) for _ in range(50)]
    waits = [d.wait for d in decisions if isinstance(d, Grant)]
    assert len(waits) == 50
    assert waits[:2] == [0.0, 0.0]
    assert waits[2:] == sorted(waits[2:])
    assert waits[-1] == pytest.approx(4.8)
    # A request whose deadline is nearer than its turn is refused with the wait, not queued.
    refused = await store.acquire("tavily", 1.0)
    assert isinstance(refused, Refusal) and refused.retry_after == pytest.approx(4.9)


async def test_policy_without_max_wait_delays_rather_than_refuses() -> None:
    clock = ManualClock()
    policy, _, events = make_policy(clock, rate=1, burst=1, max_wait=None)
    upstream = Upstream(clock)
    await policy.handle(make_flow(clock), upstream)
    await policy.handle(make_flow(clock, deadline_in=5.0), upstream)
    assert clock.sleeps == [pytest.approx(1.0)]
    assert [d for _, d, _ in events.ratelimits] == ["allowed", "delayed"]

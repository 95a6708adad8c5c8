"""Tests for the circuit breaker: local behaviour on a ManualClock, then replicas sharing Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from multidict import CIMultiDict
from redis.asyncio import Redis

from policies.breaker import Breaker, BreakerConfig, Snapshot, parse_snapshot
from policies.core.clock import ManualClock
from policies.core.errors import (
    BadRequest,
    CircuitOpen,
    DeadlineExceeded,
    RateLimited,
    UpstreamMalformed,
    UpstreamRetryAfterTooLong,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from policies.core.events import NullEvents
from policies.core.flow import Flow, Reply
from policies.core.redislink import RedisLink
from testkit.redisserver import RedisServer
from testkit.waiting import eventually

ROUTE = "tavily"
CONFIG = BreakerConfig(fail_max=5, reset_timeout=30.0, success_threshold=1, half_open_probes=1)


class RecordingEvents(NullEvents):
    def __init__(self) -> None:
        self.transitions: list[str] = []

    def breaker_transition(self, route: str, state: str) -> None:
        assert route == ROUTE
        self.transitions.append(state)


class Upstream:
    """A scripted call_next: answers `status` or raises `error`; `gate` holds calls in flight."""

    def __init__(self) -> None:
        self.calls = 0
        self.status = 200
        self.error: Exception | None = None
        self.gate: asyncio.Event | None = None

    async def __call__(self, flow: Flow) -> Reply:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        return Reply(self.status, CIMultiDict())


def make_flow() -> Flow:
    return Flow.new(
        route=ROUTE,
        method="POST",
        path="/search",
        query_string="",
        headers=CIMultiDict(),
        body=b"{}",
        request_id="req-1",
        client="",
        deadline=2000.0,
        started=1000.0,
    )


async def answer(breaker: Breaker, upstream: Upstream, status: int = 200) -> Reply:
    upstream.status, upstream.error = status, None
    return await breaker.handle(make_flow(), upstream)


async def fail(breaker: Breaker, upstream: Upstream, times: int = 1, status: int = 503) -> None:
    for _ in range(times):
        reply = await answer(breaker, upstream, status)
        assert reply.status == status  # the vendor's reply goes back untouched


async def refused(breaker: Breaker, upstream: Upstream) -> CircuitOpen:
    flow = make_flow()
    with pytest.raises(CircuitOpen) as info:
        await breaker.handle(flow, upstream)
    assert flow.trace.breaker == "open"
    return info.value


def new_breaker(
    clock: ManualClock | None = None,
    config: BreakerConfig = CONFIG,
    link: RedisLink | None = None,
) -> tuple[Breaker, RecordingEvents]:
    events = RecordingEvents()
    return Breaker(ROUTE, config, clock or ManualClock(), events, link), events


# -- local behaviour ---------------------------------------------------------------------------


async def test_trips_after_fail_max_consecutive_failures() -> None:
    breaker, events = new_breaker()
    upstream = Upstream()
    await fail(breaker, upstream, 4, status=500)
    assert breaker.state == "closed"
    await fail(breaker, upstream, 1, status=429)
    assert breaker.state == "open"
    assert events.transitions == ["open"]


@pytest.mark.parametrize(
    "error",
    [
        UpstreamTimeout("t"),
        UpstreamUnreachable("u"),
        DeadlineExceeded("d"),
        UpstreamMalformed("m"),
        UpstreamRetryAfterTooLong("r"),
    ],
)
async def test_vendor_exceptions_count_and_are_reraised(error: Exception) -> None:
    breaker, _ = new_breaker()
    upstream = Upstream()
    upstream.error = error
    for _ in range(CONFIG.fail_max):
        with pytest.raises(type(error)) as info:
            await breaker.handle(make_flow(), upstream)
        assert info.value is error
    assert breaker.state == "open"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422, 200])
async def test_caller_mistakes_never_trip_and_reset_the_count(status: int) -> None:
    breaker, _ = new_breaker()
    upstream = Upstream()
    for _ in range(3):
        await fail(breaker, upstream, CONFIG.fail_max - 1)
        await answer(breaker, upstream, status)
    assert breaker.state == "closed"
    await fail(breaker, upstream, CONFIG.fail_max - 1)
    assert breaker.state == "closed"
    await fail(breaker, upstream, 1)
    assert breaker.state == "open"


@pytest.mark.parametrize("error", [RateLimited("ours"), BadRequest("yours")])
async def test_own_refusals_neither_count_nor_reset(error: Exception) -> None:
    breaker, _ = new_breaker()
    upstream = Upstream()
    await fail(breaker, upstream, CONFIG.fail_max - 1)
    upstream.error = error
    for _ in range(3):
        with pytest.raises(type(error)):
            await breaker.handle(make_flow(), upstream)
    assert breaker.state == "closed"  # not counted as failures
    await fail(breaker, upstream, 1)
    assert breaker.state == "open"  # nor as a success that resets the count


async def test_open_makes_no_upstream_calls_until_reset_timeout() -> None:
    clock = ManualClock()
    breaker, _ = new_breaker(clock)
    upstream = Upstream()
    await fail(breaker, upstream, CONFIG.fail_max)
    calls = upstream.calls
    for _ in range(20):
        await refused(breaker, upstream)
    clock.advance(CONFIG.reset_timeout - 0.01)
    await refused(breaker, upstream)
    assert upstream.calls == calls
    clock.advance(0.01)
    await answer(breaker, upstream)
    assert upstream.calls == calls + 1
    assert breaker.state == "closed"


async def test_circuit_open_carries_retry_after_header_and_message() -> None:
    clock = ManualClock()
    breaker, _ = new_breaker(clock)
    upstream = Upstream()
    await fail(breaker, upstream, CONFIG.fail_max)
    clock.advance(3.0)
    error = await refused(breaker, upstream)
    assert error.status == 503
    assert error.retry_after_s == pytest.approx(27.0)
    assert breaker.seconds_until_half_open() == pytest.approx(27.0)
    assert error.message == "tavily: circuit open after 5 consecutive failures; retry in 27s"
    assert error.response_headers() == {"X-Circuit": "open", "Retry-After": "27"}
    assert error.route == ROUTE


async def test_half_open_admits_exactly_one_of_ten_concurrent_requests() -> None:
    clock = ManualClock()
    breaker, events = new_breaker(clock)
    upstream = Upstream()
    await fail(breaker, upstream, CONFIG.fail_max)
    clock.advance(CONFIG.reset_timeout)
    calls = upstream.calls
    upstream.status, upstream.gate = 200, asyncio.Event()
    flows = [make_flow() for _ in range(10)]
    tasks = [asyncio.create_task(breaker.handle(f, upstream)) for f in flows]
    await asyncio.sleep(0)
    assert upstream.calls == calls + 1
    assert breaker.state == "half_open"
    rejected = [t for t in tasks if t.done()]
    assert len(rejected) == 9
    for task in rejected:
        error = task.exception()
        assert isinstance(error, CircuitOpen)
        assert error.retry_after_s is not None and error.retry_after_s >= 1.0
        assert "probe" in error.message
    assert sorted(f.trace.breaker for f in flows) == ["half_open"] + ["open"] * 9
    upstream.gate.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert breaker.state == "closed"
    assert events.transitions == ["open", "half_open", "closed"]


async def test_failed_probe_reopens_for_a_full_reset_timeout() -> None:
    clock = ManualClock()
    breaker, events = new_breaker(clock)
    upstream = Upstream()
    await fail(breaker, upstream, CONFIG.fail_max)
    clock.advance(CONFIG.reset_timeout + 5)
    upstream.error = UpstreamTimeout("slow")
    with pytest.raises(UpstreamTimeout):
        await breaker.handle(make_flow(), upstream)
    assert breaker.state == "open"
    assert breaker.seconds_until_half_open() == pytest.approx(CONFIG.reset_timeout)
    assert events.transitions == ["open", "half_open", "open"]


async def test_success_threshold_needs_that_many_probe_successes() -> None:
    clock = ManualClock()
    config = BreakerConfig(fail_max=2, reset_timeout=10.0, success_threshold=2, half_open_probes=1)
    breaker, _ = new_breaker(clock, config)
    upstream = Upstream()
    await fail(breaker, upstream, 2)
    clock.advance(10.0)
    await answer(breaker, upstream)
    assert breaker.state == "half_open"
    await answer(breaker, upstream)
    assert breaker.state == "closed"


async def test_half_open_probes_bounds_concurrent_probes() -> None:
    clock = ManualClock()
    config = BreakerConfig(fail_max=1, reset_timeout=10.0, success_threshold=3, half_open_probes=3)
    breaker, _ = new_breaker(clock, config)
    upstream = Upstream()
    await fail(breaker, upstream, 1)
    clock.advance(10.0)
    upstream.status, upstream.gate = 200, asyncio.Event()
    tasks = [asyncio.create_task(breaker.handle(make_flow(), upstream)) for _ in range(8)]
    await asyncio.sleep(0)
    assert upstream.calls == 1 + 3
    upstream.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert sum(isinstance(r, CircuitOpen) for r in results) == 5
    assert breaker.state == "closed"


async def test_a_probe_ended_by_our_own_refusal_frees_its_slot() -> None:
    clock = ManualClock()
    breaker, _ = new_breaker(clock)
    upstream = Upstream()
    await fail(breaker, upstream, CONFIG.fail_max)
    clock.advance(CONFIG.reset_timeout)
    upstream.error = RateLimited("ours")
    with pytest.raises(RateLimited):
        await breaker.handle(make_flow(), upstream)
    assert breaker.state == "half_open"
    await answer(breaker, upstream)  # admitted as the next probe, not refused
    assert breaker.state == "closed"


async def test_outcome_of_a_call_admitted_before_a_trip_is_ignored() -> None:
    breaker, _ = new_breaker()
    slow = Upstream()
    slow.gate = asyncio.Event()
    straggler = asyncio.create_task(breaker.handle(make_flow(), slow))
    await asyncio.sleep(0)
    await fail(breaker, Upstream(), CONFIG.fail_max)
    assert breaker.state == "open"
    slow.gate.set()
    assert (await straggler).status == 200
    assert breaker.state == "open"  # a success from the closed era must not close it


async def test_reset_closes_an_open_breaker() -> None:
    breaker, events = new_breaker()
    upstream = Upstream()
    await fail(breaker, upstream, CONFIG.fail_max)
    await breaker.reset()
    assert breaker.state == "closed"
    await fail(breaker, upstream, CONFIG.fail_max - 1)
    assert breaker.state == "closed"  # the failure count was reset too
    assert events.transitions == ["open", "closed"]


def test_snapshot_wire_format_round_trips_and_rejects_garbage() -> None:
    snap = Snapshot("open", 1_700_000_000_123_456, 1_700_000_000_000_000, 5, "replica-a")
    assert parse_snapshot(snap.encode().encode()) == snap
    bad_messages = (b"", b"open|1|2|3", b"sideways|1|2|3|o", b"open|x|2|3|o", b"\xff|1|2|3|o")
    for bad in bad_messages:
        assert parse_snapshot(bad) is None


# -- replicas sharing Redis --------------------------------------------------------------------


@dataclass
class Replicas:
    """Two breakers for one route in two "processes": each with its own RedisLink."""

    a: Breaker
    b: Breaker
    b_events: RecordingEvents
    clock: ManualClock
    links: list[RedisLink]


async def start_replicas(url: str, interval: float = 1.0) -> AsyncIterator[Replicas]:
    clock = ManualClock()
    links = [RedisLink(url, "test", retry_interval=interval) for _ in range(2)]
    a = Breaker(ROUTE, CONFIG, clock, RecordingEvents(), links[0], sync_interval=interval)
    b_events = RecordingEvents()
    b = Breaker(ROUTE, CONFIG, clock, b_events, links[1], sync_interval=interval)
    await a.start()
    await b.start()
    try:
        yield Replicas(a, b, b_events, clock, links)
    finally:
        await a.stop()
        await b.stop()
        for link in links:
            await link.close()


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[Replicas]:
    async for pair in start_replicas(redis_server.url):
        yield pair


async def test_trip_in_one_replica_is_seen_by_the_other_within_a_second(
    replicas: Replicas,
) -> None:
    a, b = replicas.a, replicas.b
    upstream = Upstream()
    await fail(a, upstream, CONFIG.fail_max)
    await eventually(lambda: b.state == "open", within=1.0)
    assert replicas.b_events.transitions == ["open"]
    calls = upstream.calls
    error = await refused(b, upstream)
    assert upstream.calls == calls
    assert error.message.startswith("tavily: circuit open after 5 consecutive failures")


async def test_half_open_probe_is_gated_across_replicas(replicas: Replicas) -> None:
    a, b = replicas.a, replicas.b
    upstream = Upstream()
    await fail(a, upstream, CONFIG.fail_max)
    await eventually(lambda: b.state == "open", within=1.0)
    replicas.clock.advance(CONFIG.reset_timeout)
    upstream.status, upstream.gate = 200, asyncio.Event()
    calls = upstream.calls
    probe = asyncio.create_task(a.handle(make_flow(), upstream))
    await eventually(lambda: upstream.calls == calls + 1, within=1.0)
    error = await refused(b, upstream)  # b's own gate is free: Redis holds the slot
    assert error.retry_after_s == 1.0
    assert upstream.calls == calls + 1
    upstream.gate.set()
    assert (await probe).status == 200
    assert a.state == "closed"
    await eventually(lambda: b.state == "closed", within=1.0)
    assert replicas.b_events.transitions == ["open", "half_open", "closed"]
    await answer(b, upstream)


async def test_reset_propagates_to_other_replicas(replicas: Replicas) -> None:
    a, b = replicas.a, replicas.b
    upstream = Upstream()
    await fail(a, upstream, CONFIG.fail_max)
    await eventually(lambda: b.state == "open", within=1.0)
    await b.reset()
    await eventually(lambda: a.state == "closed", within=1.0)
    await answer(a, upstream)


async def test_periodic_read_repairs_a_lost_message(redis_server: RedisServer) -> None:
    clock = ManualClock()
    link = RedisLink(redis_server.url, "test")
    breaker, events = new_breaker(clock, CONFIG, link)
    await breaker.start()
    raw = Redis.from_url(redis_server.url)
    try:
        await asyncio.sleep(0.05)  # past the read at start-up: only a periodic one can see it
        # Another replica's trip whose PUBLISH never arrived: only the hash has it.
        opened_us = int((clock.wall() - 10.0) * 1_000_000)
        await raw.hset(
            "test:breaker:{tavily}",
            mapping={
                "state": "open",
                "since": opened_us,
                "opened_at": opened_us,
                "failures": 7,
                "origin": "elsewhere",
            },
        )
        await eventually(lambda: breaker.state == "open", within=1.1)  # read every 1 s
        assert events.transitions == ["open"]
        assert breaker.seconds_until_half_open() == pytest.approx(CONFIG.reset_timeout - 10.0)
        error = await refused(breaker, Upstream())
        assert "after 7 consecutive failures" in error.message
    finally:
        await breaker.stop()
        await link.close()
        await raw.aclose()


async def test_a_replica_started_later_adopts_the_open_state(redis_server: RedisServer) -> None:
    clock = ManualClock()
    first_link, late_link = RedisLink(redis_server.url, "test"), RedisLink(redis_server.url, "test")
    first, _ = new_breaker(clock, CONFIG, first_link)
    late, _ = new_breaker(clock, CONFIG, late_link)
    await first.start()
    try:
        await fail(first, Upstream(), CONFIG.fail_max)
        clock.advance(10.0)
        await first.stop()  # flushes the trip to Redis
        await late.start()
        await eventually(lambda: late.state == "open", within=1.0)
        assert late.seconds_until_half_open() == pytest.approx(CONFIG.reset_timeout - 10.0)
    finally:
        await late.stop()
        await first_link.close()
        await late_link.close()


@pytest.fixture
async def fast_replicas(killable_redis: RedisServer) -> AsyncIterator[Replicas]:
    # Short intervals so the outage is noticed (and survived) within a test's patience.
    async for pair in start_replicas(killable_redis.url, interval=0.1):
        yield pair


async def test_redis_down_each_replica_works_alone_then_rejoins(
    killable_redis: RedisServer, fast_replicas: Replicas
) -> None:
    a, b, clock = fast_replicas.a, fast_replicas.b, fast_replicas.clock
    upstream = Upstream()
    await fail(a, upstream, CONFIG.fail_max)
    await eventually(lambda: b.state == "open", within=1.0)
    await b.reset()
    await eventually(lambda: a.state == "closed", within=1.0)

    killable_redis.stop()
    await eventually(lambda: not any(link.up for link in fast_replicas.links), within=1.0)
    for _ in range(CONFIG.fail_max):
        async with asyncio.timeout(0.2):  # a dead Redis must not stall a call
            await fail(a, upstream, 1)
    assert a.state == "open"
    for _ in range(3):
        async with asyncio.timeout(0.2):
            await answer(b, upstream)
    await asyncio.sleep(0.2)  # a few sync ticks fail meanwhile
    assert b.state == "closed"  # b keeps its own breaker while Redis is away
    clock.advance(CONFIG.reset_timeout)
    for breaker in (a, b):  # a probes (gated locally), b answers as usual
        async with asyncio.timeout(0.2):
            await answer(breaker, upstream)
    assert a.state == "closed"

    killable_redis.start()
    await eventually(lambda: all(link.up for link in fast_replicas.links), within=2.0)
    clock.advance(1.0)  # time passes on the wall too; replicas order transitions by it
    await fail(b, upstream, CONFIG.fail_max)
    assert b.state == "open"
    await eventually(lambda: a.state == "open", within=1.0)

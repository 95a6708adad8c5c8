"""A Redis that stalls (SIGSTOP, as `DEBUG SLEEP` or a frozen VM does) and wakes up: it then runs
every command still in its sockets, long after the callers gave up. Such late commands take no
fetch lock, no token and no probe slot; a timed-out command is sent once, never resent; fetch
locks lapse within lock_wait and only their owner deletes them; a subscription (AUTH included)
gives up in time and resumes; and after a stall, a burst of requests does not wait on locks that
nobody holds."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from redis.asyncio import Redis

from policies.breaker import RedisBreakerState
from policies.cache import CacheConfig, FetchLock, Found, LockAsk, LockState, RedisStore
from policies.core.clock import SYSTEM_CLOCK
from policies.core.redislink import REDIS_FAILURES, RedisLink
from policies.ratelimit import Grant, RedisBuckets
from proxy.app import STATE
from testkit.fakevendor import FakeVendor
from testkit.redisserver import RedisServer
from tests.conftest import route


def freeze(server: RedisServer) -> None:
    """Stop Redis as a stall does: connections are still accepted and commands pile up in its
    sockets, unread."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)


async def thaw(server: RedisServer) -> None:
    """Resume Redis, and return once it answers again, having run what piled up."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGCONT)
    probe = Redis.from_url(server.url)
    try:
        async with asyncio.timeout(5):
            await probe.ping()
        await asyncio.sleep(0.1)  # the backlog of other connections, read in the same wake-up
    finally:
        await probe.aclose()


@asynccontextmanager
async def stalled(server: RedisServer) -> AsyncIterator[None]:
    """Redis frozen for the block, thawed after it."""
    freeze(server)
    try:
        yield
    finally:
        await thaw(server)


@pytest.fixture
async def link(killable_redis: RedisServer) -> AsyncIterator[RedisLink]:
    link = RedisLink(killable_redis.url, "rec", timeout=0.1, retry_interval=0.05)
    assert await link.run(lambda r: r.ping()) is True  # up, and Redis's clock measured
    yield link
    await link.close()


@pytest.fixture
async def raw(killable_redis: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(killable_redis.url)
    yield client
    await client.aclose()


async def past_the_deadline_it_sent(link: RedisLink) -> None:
    """Stay frozen until Redis's own clock (which no test can inject) is past the deadline the
    link put on its command: gives_up_after plus a small margin after sending, most of which
    gives_up_in_time already waited."""
    await asyncio.sleep(link.gives_up_after)


async def gives_up_in_time(call: Awaitable[Any], link: RedisLink) -> Any:
    """`call` returns (its fallback) once the link gives up, not when Redis wakes."""
    started = time.monotonic()
    result = await call
    assert time.monotonic() - started < link.gives_up_after + 0.1
    return result


# Keeps Redis busy for ARGV[1] microseconds: every other client waits, then is served in turn.
BUSY_LUA = """
local started = redis.call('TIME')
repeat
  local now = redis.call('TIME')
until (now[1] - started[1]) * 1000000 + (now[2] - started[2]) > tonumber(ARGV[1])
return 1
"""


async def test_a_command_that_timed_out_is_not_sent_again(link: RedisLink, raw: Redis) -> None:
    busy = asyncio.create_task(raw.eval(BUSY_LUA, 0, 200_000))
    await asyncio.sleep(0.02)
    # Redis answers again within the link's patience: a resend on the timeout would get there
    # too, and the counter would count this one call twice.
    await gives_up_in_time(link.run(lambda r: r.incr("rec:counter")), link)
    await busy
    await asyncio.sleep(0.1)
    assert await raw.get("rec:counter") == b"1"


async def missing(store: RedisStore, key: str, token: str) -> Found:
    """A lookup of `key` that no entry can answer fresh, asking for its fetch lock as `token`."""
    return await store.lookup(key, math.inf, LockAsk(token, 2.0))


async def test_a_fetch_lock_sent_to_a_stalled_redis_takes_nothing_when_it_wakes(
    killable_redis: RedisServer, link: RedisLink, raw: Redis
) -> None:
    store = RedisStore(link, retain=60.0, clock=SYSTEM_CLOCK)
    # A lookup of a missing entry asks for the fetch lock with it (and loads the script).
    assert (await missing(store, "r:warm", "w")).lease.state is LockState.ACQUIRED
    async with stalled(killable_redis):
        found = await gives_up_in_time(missing(store, "r:k", "mine"), link)
        assert found.lease.state is LockState.ABSENT  # fetch without a lock meanwhile
        await past_the_deadline_it_sent(link)
    assert not await raw.exists(store.lock_key("r:k"))
    # Redis is back: the next request takes the lock as usual.
    await asyncio.sleep(0.06)  # the link's retry_interval
    assert (await missing(store, "r:k", "next")).lease.state is LockState.ACQUIRED


async def test_a_token_asked_of_a_stalled_redis_is_not_reserved_when_it_wakes(
    killable_redis: RedisServer, link: RedisLink, raw: Redis
) -> None:
    buckets = RedisBuckets(link, rate=1.0, burst=1, clock=SYSTEM_CLOCK)
    assert await buckets.acquire("warm", max_wait=30.0) == Grant(0.0)  # script loaded
    async with stalled(killable_redis):
        for _ in range(3):  # the in-process bucket answers meanwhile
            await gives_up_in_time(buckets.acquire("r", max_wait=30.0), link)
        await past_the_deadline_it_sent(link)
    assert await raw.keys("rec:ratelimit:{r}*") == []
    await asyncio.sleep(0.06)
    # A late reservation would have booked the next seconds: the shared bucket is still full.
    assert await buckets.acquire("r", max_wait=30.0) == Grant(0.0)


async def test_a_probe_slot_asked_of_a_stalled_redis_is_not_taken_when_it_wakes(
    killable_redis: RedisServer, link: RedisLink, raw: Redis
) -> None:
    shared = RedisBreakerState(link, "r", probes=1, probe_lease=30.0)
    await shared.release_probe(await shared.acquire_probe())  # script loaded, slot free again
    async with stalled(killable_redis):
        grant = await gives_up_in_time(shared.acquire_probe(), link)
        assert grant.admitted and grant.key is None  # the local gate decides meanwhile
        await past_the_deadline_it_sent(link)
    assert not await raw.exists(*shared.slots)


async def test_a_fetch_lock_lapses_after_lock_wait_and_only_its_owner_releases_it(
    link: RedisLink, raw: Redis
) -> None:
    store = RedisStore(link, retain=60.0, clock=SYSTEM_CLOCK)
    lock = FetchLock(store, CacheConfig(lock_wait=1.5), SYSTEM_CLOCK, poll_interval=0.01)
    lease = (await store.lookup("r:k", math.inf, lock.ask(SYSTEM_CLOCK.now() + 30))).lease
    assert lease.state is LockState.ACQUIRED
    name = store.lock_key("r:k")
    assert 1000 < await raw.pttl(name) <= 1500  # lock_wait, not the 30 s the caller has
    again = await store.lookup("r:k", math.inf, lock.ask(SYSTEM_CLOCK.now() + 30))
    assert again.lease.state is LockState.HELD
    await store.unlock("r:k", "someone else")
    assert await raw.exists(name)
    await lock.release("r:k", lease)
    assert not await raw.exists(name)


async def test_no_lock_is_asked_for_by_a_caller_out_of_time(link: RedisLink, raw: Redis) -> None:
    store = RedisStore(link, retain=60.0, clock=SYSTEM_CLOCK)
    lock = FetchLock(store, CacheConfig(lock_wait=1.5), SYSTEM_CLOCK, poll_interval=0.01)
    ask = lock.ask(SYSTEM_CLOCK.now() - 0.001)
    assert ask is None
    found = await store.lookup("r:k", math.inf, ask)
    assert found.lease.state is LockState.ABSENT and not await raw.exists(store.lock_key("r:k"))


async def test_after_a_redis_stall_a_burst_does_not_wait_on_locks_nobody_holds(
    killable_redis: RedisServer, vendor: FakeVendor, start_proxy: Any, raw: Redis
) -> None:
    vendor.latency(0.02)
    cache = {"ttl": "10m", "shared": True, "lock_wait": "2s"}
    config = {
        "redis": {"url": killable_redis.url, "key_prefix": "rec", "timeout": "100ms"},
        "routes": {"v": route(vendor.url + "/tavily", "/v", cache=cache)},
    }
    a, b = await start_proxy(config), await start_proxy(config)

    async def search(client: Any, query: str) -> Any:
        return await client.post("/v/search", json={"query": query})

    assert (await search(a, "warm a")).status == (await search(b, "warm b")).status == 200
    # Replica a's burst reaches Redis, and Redis freezes as their cache lookups, which take the
    # fetch locks, arrive: the moment that left ownerless locks behind.
    store = a.app[STATE].routes["v"].cache.store.shared
    look_up: Callable[..., Awaitable[Found]] = store.lookup
    frozen = asyncio.Event()

    async def freeze_then_look_up(key: str, fresh_after: float, ask: LockAsk | None) -> Found:
        if not frozen.is_set():
            frozen.set()
            freeze(killable_redis)
        return await look_up(key, fresh_after, ask)

    store.lookup = freeze_then_look_up
    queries = [f"query {i}" for i in range(20)]
    try:
        replies = await asyncio.gather(*(search(a, q) for q in queries))
        assert {r.status for r in replies} == {200} and frozen.is_set()
        link = a.app[STATE].redis
        assert link is not None
        await past_the_deadline_it_sent(link)  # what reached Redis meanwhile is too late now
    finally:
        await thaw(killable_redis)
    assert await raw.keys("rec:cache-lock:*") == []

    started = time.monotonic()
    replies = await asyncio.gather(*(search(b, q) for q in queries))
    assert {r.status for r in replies} == {200}
    assert time.monotonic() - started < 1.0  # nobody waited out a lock_wait of 2 s


async def test_a_subscription_to_a_stalled_redis_gives_up_in_time_and_resumes(
    killable_redis: RedisServer, raw: Redis
) -> None:
    """Subscribing reads AUTH's answer on a new connection, and reading waits for news: neither
    outlasts the link's patience while Redis is frozen, and both work again once it wakes."""
    await raw.config_set("requirepass", "pw-for-this-test")
    url = killable_redis.url.replace("redis://", "redis://:pw-for-this-test@")
    link = RedisLink(url, "rec", timeout=0.1, retry_interval=0.05)
    news = link.subscription("rec:news")
    assert killable_redis.proc is not None
    try:
        freeze(killable_redis)
        try:
            started = time.monotonic()
            with pytest.raises(REDIS_FAILURES):
                await asyncio.wait_for(news.get(0.2), 5)
            assert time.monotonic() - started < link.gives_up_after + 1
            assert not news.subscribed
        finally:
            os.kill(killable_redis.proc.pid, signal.SIGCONT)  # thaw() asks without the password
        assert await news.get(0.2) is None and news.subscribed
        publisher = Redis.from_url(url)
        try:
            await publisher.publish("rec:news", b"awake")
        finally:
            await publisher.aclose()
        assert await news.get(2) == b"awake"
    finally:
        await news.close()
        await link.close()

"""What one request costs Redis, counted by Redis itself (MONITOR): on a route with every policy
that keeps shared state, a cache miss is three round trips (lookup and fetch lock, a rate-limit
token, store and unlock), a hit one, a refused token three; none is a bare TIME; and nothing a
cluster refuses (KEYS, a script or command over keys of two slots) is ever sent."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from testkit.fakevendor import FakeVendor
from testkit.redisserver import RedisServer
from tests.conftest import route


class Monitored:
    """Every command Redis runs while the block runs: `sent` by clients (round trips), `inside`
    scripts."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, ...]] = []
        self.inside: list[tuple[str, ...]] = []

    def named(self, which: list[tuple[str, ...]]) -> Counter[str]:
        return Counter(c[0].upper() for c in which)


@contextlib.asynccontextmanager
async def monitored(url: str) -> AsyncIterator[Monitored]:
    seen = Monitored()
    client = Redis.from_url(url)
    async with client.monitor() as monitor:
        started = asyncio.Event()

        async def read() -> None:
            started.set()
            while True:
                info = await monitor.next_command()
                words = tuple(str(info["command"]).split())
                if words and words[0].upper() in ("MONITOR", "PING"):
                    continue  # ours: the monitor itself, and the marker below
                (seen.inside if info["client_type"] == "lua" else seen.sent).append(words)

        reader = asyncio.create_task(read())
        await started.wait()
        await asyncio.sleep(0.05)
        try:
            yield seen
        finally:
            await asyncio.sleep(0.1)  # MONITOR lines trail the commands a little
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
    await client.aclose()


EVERY_POLICY = {
    "cache": {"ttl": "10m", "stale_ttl": "1h", "lock_wait": "2s"},
    "breaker": {"fail_max": 5, "reset_timeout": "30s"},
    "retry": {"attempts": 2, "backoff": {"initial": "10ms", "max": "20ms"}},
    "rate_limit": {"rate": "1000/s", "burst": 1000},
    "search": {"vendor": "tavily"},
}


@pytest.fixture
async def proxy(redis_server: RedisServer, vendor: FakeVendor, start_proxy: Any) -> Any:
    config = {
        "redis": {"url": redis_server.url, "key_prefix": "rt"},
        "routes": {"tavily": route(vendor.url + "/tavily", "/tavily", **EVERY_POLICY)},
    }
    client = await start_proxy(config)
    # The first request loads the scripts and measures Redis's clock: not counted below.
    assert (await client.post("/tavily/search", json={"query": "warm up"})).status == 200
    return client


async def search(proxy: Any, query: str) -> Any:
    reply = await proxy.post("/tavily/search", json={"query": query})
    await reply.read()
    return reply


async def test_a_miss_is_three_round_trips_and_a_hit_in_the_replicas_own_tier_none(
    redis_server: RedisServer, proxy: Any
) -> None:
    async with monitored(redis_server.url) as misses:
        for i in range(10):
            assert (await search(proxy, f"new query {i}")).headers["X-Cache"] == "MISS"
    assert misses.named(misses.sent) == {"EVALSHA": 30}  # no bare TIME: read inside the scripts
    async with monitored(redis_server.url) as hits:
        for i in range(10):
            assert (await search(proxy, f"new query {i}")).headers["X-Cache"] == "HIT"
    assert hits.named(hits.sent) == {}


async def test_a_hit_on_an_entry_another_replica_stored_is_one_round_trip(
    redis_server: RedisServer, vendor: FakeVendor, start_proxy: Any
) -> None:
    config = {
        "redis": {"url": redis_server.url, "key_prefix": "rt"},
        "routes": {"tavily": route(vendor.url + "/tavily", "/tavily", **EVERY_POLICY)},
    }
    a, b = await start_proxy(config), await start_proxy(config)
    for client in (a, b):
        await search(client, "warm up")
    for i in range(10):
        await search(a, f"query {i}")
    async with monitored(redis_server.url) as hits:
        for i in range(10):
            assert (await search(b, f"query {i}")).headers["X-Cache"] == "HIT"
    assert hits.named(hits.sent) == {"EVALSHA": 10}
    assert hits.named(hits.inside) == {"GET": 10}  # no lock taken for a fresh entry


async def test_a_request_the_limiter_refuses_is_three_round_trips(
    redis_server: RedisServer, vendor: FakeVendor, start_proxy: Any
) -> None:
    limited = {**EVERY_POLICY, "rate_limit": {"rate": "1/m", "burst": 1}}
    config = {
        "redis": {"url": redis_server.url, "key_prefix": "rt"},
        "routes": {"tavily": route(vendor.url + "/tavily", "/tavily", **limited)},
    }
    client = await start_proxy(config)
    assert (await search(client, "takes the only token")).status == 200
    assert (await search(client, "loads the unlock script")).status == 429
    async with monitored(redis_server.url) as refused:
        for i in range(5):
            assert (await search(client, f"refused {i}")).status == 429
    # The lookup (which took the fetch lock), the refused token, and the lock given back so
    # other replicas need not wait it out.
    assert refused.named(refused.sent) == {"EVALSHA": 15}


async def test_no_command_a_cluster_refuses_is_sent(redis_server: RedisServer, proxy: Any) -> None:
    async with monitored(redis_server.url) as seen:
        for i in range(5):
            await search(proxy, f"query {i}")
            await search(proxy, f"query {i}")
    refused = {"KEYS", "MGET", "MSET", "SCAN"}
    assert not refused & set(seen.named(seen.sent))
    # Every key a script touches carries one {hash tag}: one cluster slot.
    for words in seen.sent:
        if words[0].upper() == "EVALSHA":
            keys = [w.strip('"') for w in words[3 : 3 + int(words[2].strip('"'))]]
            tags = {k[k.index("{") + 1 : k.index("}")] for k in keys}
            assert len(tags) == 1, words

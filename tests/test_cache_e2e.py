"""The stale-while-error cache end to end: hits without vendor calls, stale answers when the
vendor fails, what is never stored, isolation between callers, and sharing through Redis."""

from __future__ import annotations

import asyncio

from policies.core.clock import ManualClock
from testkit.fakevendor import Fault
from tests.conftest import route

CACHE = {"ttl": "10m", "stale_ttl": "1h"}


def cached(vendor, redis_url=None, **extra):
    extra.setdefault("cache", CACHE)
    extra.setdefault("search", {"vendor": "tavily", "on_empty": "pass"})
    raw = {"routes": {"tavily": route(vendor.url + "/tavily", "/tavily", **extra)}}
    if redis_url:
        raw["redis"] = {"url": redis_url, "key_prefix": "cache-e2e"}
    return raw


async def search(client, query="cache me", key="Bearer k1", **headers):
    return await client.post(
        "/tavily/search", json={"query": query}, headers={"Authorization": key, **headers}
    )


async def test_fresh_hit_makes_no_vendor_call(vendor, start_proxy):
    clock = ManualClock()
    client = await start_proxy(cached(vendor), clock=clock)
    first = await search(client)
    assert first.headers["X-Cache"] == "MISS"
    clock.advance(30)
    second = await search(client)
    assert second.headers["X-Cache"] == "HIT"
    assert second.headers["Age"] == "30"
    assert second.headers["Cache-Status"].startswith("search-proxy; hit")
    assert await second.read() == await first.read()
    assert vendor.count() == 1


async def test_stale_served_when_vendor_down_after_ttl(vendor, start_proxy):
    clock = ManualClock()
    client = await start_proxy(cached(vendor, retry={"attempts": 2}), clock=clock)
    original = await (await search(client)).read()
    clock.advance(11 * 60)  # past the fresh TTL
    vendor.down()
    r = await search(client)
    assert r.status == 200
    assert r.headers["X-Cache"] == "STALE"
    assert r.headers["Age"] == str(11 * 60)
    assert "fwd-status=503" in r.headers["Cache-Status"]
    assert await r.read() == original
    assert vendor.count() == 1 + 2  # the warm call, then both attempts of the failed refresh


async def test_errors_and_429s_are_never_cached(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    vendor.script(Fault.status(429), Fault.status(500), Fault.malformed())
    for status in (429, 500, 502):
        assert (await search(client)).status == status
    r = await search(client)
    assert r.status == 200 and r.headers["X-Cache"] == "MISS"
    assert vendor.count() == 4


async def test_callers_with_different_keys_never_share_entries(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    await search(client, key="Bearer alice")
    r = await search(client, key="Bearer bob")
    assert r.headers["X-Cache"] == "MISS"
    r = await search(client, key="Bearer alice")
    assert r.headers["X-Cache"] == "HIT"
    assert vendor.count() == 2


async def test_shared_cache_ignores_credentials(vendor, start_proxy):
    client = await start_proxy(cached(vendor, cache={**CACHE, "shared": True}))
    await search(client, key="Bearer alice")
    assert (await search(client, key="Bearer bob")).headers["X-Cache"] == "HIT"


async def test_equivalent_queries_share_an_entry(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    await client.post("/tavily/search", json={"query": "a  b", "max_results": 3})
    r = await client.post("/tavily/search", json={"max_results": 3, "query": " a b "})
    assert r.headers["X-Cache"] == "HIT"


async def test_no_cache_and_no_store(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    await search(client)
    r = await search(client, **{"Cache-Control": "no-cache"})
    assert r.headers["X-Cache"] == "MISS" and vendor.count() == 2
    r = await search(client, query="private", **{"Cache-Control": "no-store"})
    assert r.headers["X-Cache"] == "BYPASS"
    r = await search(client, query="private")
    assert r.headers["X-Cache"] == "MISS"


async def test_concurrent_identical_requests_make_one_vendor_call(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    vendor.latency(0.05)
    answers = await asyncio.gather(*(search(client, "popular query") for _ in range(20)))
    assert {r.status for r in answers} == {200}
    assert vendor.count() == 1
    text = await (await client.get("/metrics")).text()
    assert 'search_proxy_coalesced_total{route="tavily"} 19.0' in text


async def test_rate_limit_refusal_is_answered_stale(vendor, start_proxy):
    clock = ManualClock()
    raw = cached(vendor, rate_limit={"rate": "1/m", "burst": 1, "max_wait": "0s"})
    client = await start_proxy(raw, clock=clock)
    await search(client)
    clock.advance(11 * 60)
    await search(client, query="spend the token")  # refills allowed one; spend it
    r = await search(client)
    assert r.headers["X-Cache"] == "STALE"
    assert "detail=rate_limited" in r.headers["Cache-Status"]


async def test_two_proxies_share_entries_through_redis(vendor, start_proxy, redis_server):
    clock = ManualClock()
    a = await start_proxy(cached(vendor, redis_server.url), clock=clock)
    b = await start_proxy(cached(vendor, redis_server.url), clock=clock)
    await search(a)
    r = await search(b)
    assert r.headers["X-Cache"] == "HIT" and vendor.count() == 1
    clock.advance(11 * 60)
    vendor.down()
    c = await start_proxy(cached(vendor, redis_server.url), clock=clock)  # an empty local tier
    r = await search(c)
    assert r.status == 200 and r.headers["X-Cache"] == "STALE"


async def test_redis_killed_every_request_is_still_answered(vendor, start_proxy, killable_redis):
    client = await start_proxy(cached(vendor, killable_redis.url))
    await search(client)
    killable_redis.stop()
    async with asyncio.timeout(2):  # a dead Redis must not stall requests
        for i in range(10):
            r = await search(client, query=f"during outage {i}")
            assert r.status == 200
    assert (await search(client, query="during outage 0")).headers["X-Cache"] == "HIT"

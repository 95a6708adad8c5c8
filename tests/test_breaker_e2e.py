"""Circuit breakers end to end: tripping, failing fast with zero vendor calls, half-open probes,
stale answers while open, and one breaker shared by two proxies through Redis."""

from __future__ import annotations

import asyncio

from policies.core.clock import ManualClock
from testkit.fakevendor import Fault
from testkit.waiting import eventually
from tests.conftest import route

BREAKER = {"fail_max": 3, "reset_timeout": "30s"}


def guarded(vendor, redis_url=None, **extra):
    extra.setdefault("breaker", BREAKER)
    raw = {"routes": {"tavily": route(vendor.url + "/tavily", "/tavily", **extra)}}
    if redis_url:
        raw["redis"] = {"url": redis_url, "key_prefix": "breaker-e2e"}
    return raw


async def search(client, query="breaker"):
    return await client.post("/tavily/search", json={"query": query})


async def trip(client, vendor, n=3):
    vendor.set_default(Fault.status(503))
    for _ in range(n):
        assert (await search(client)).status == 503


async def test_open_breaker_fails_fast_without_vendor_calls(vendor, start_proxy, admin_of):
    clock = ManualClock()
    client = await start_proxy(guarded(vendor), clock=clock)
    await trip(client, vendor)
    calls = vendor.count()
    clock.advance(3)
    r = await search(client)
    assert r.status == 503
    assert r.headers["X-Circuit"] == "open"
    assert r.headers["Retry-After"] == "27"
    err = (await r.json())["error"]
    assert err["type"] == "circuit_open"
    assert err["message"] == "tavily: circuit open after 3 consecutive failures; retry in 27s"
    for _ in range(10):
        assert (await search(client)).status == 503
    assert vendor.count() == calls  # zero vendor calls while open
    text = await (await client.get("/metrics")).text()
    assert 'search_proxy_breaker_state{route="tavily"} 2.0' in text
    admin = await (await (await admin_of(client)).get("/admin/breakers")).json()
    assert admin["breakers"]["tavily"]["state"] == "open"


async def test_client_errors_never_open_the_breaker(vendor, start_proxy):
    client = await start_proxy(guarded(vendor))
    vendor.set_default(Fault.status(401))
    for _ in range(10):
        assert (await search(client)).status == 401
    assert vendor.count() == 10


async def test_half_open_admits_exactly_one_probe(vendor, start_proxy):
    clock = ManualClock()
    client = await start_proxy(guarded(vendor), clock=clock)
    await trip(client, vendor)
    vendor.reset()
    vendor.latency(0.1)
    clock.advance(31)
    answers = await asyncio.gather(*(search(client, f"q{i}") for i in range(10)))
    statuses = sorted(r.status for r in answers)
    assert statuses.count(200) == 1 and statuses.count(503) == 9
    assert vendor.count() == 1
    assert (await search(client)).status == 200  # the probe succeeded: closed again


async def test_open_breaker_serves_stale_when_it_can(vendor, start_proxy):
    clock = ManualClock()
    raw = guarded(vendor, cache={"ttl": "1m", "stale_ttl": "1h"})
    client = await start_proxy(raw, clock=clock)
    warm = await (await search(client, "warm")).read()
    clock.advance(120)
    await trip(client, vendor)
    calls = vendor.count()
    r = await search(client, "warm")
    assert r.status == 200 and r.headers["X-Cache"] == "STALE"
    assert await r.read() == warm
    assert "detail=circuit_open" in r.headers["Cache-Status"]
    assert vendor.count() == calls


async def test_admin_reset_closes_it(vendor, start_proxy, admin_of):
    client = await start_proxy(guarded(vendor))
    admin = await admin_of(client)
    await trip(client, vendor)
    vendor.reset()
    r = await admin.post("/admin/breakers/tavily/reset", headers={"X-Requested-By": "test"})
    assert (await r.json()) == {"route": "tavily", "state": "closed"}
    assert (await search(client)).status == 200


async def test_trip_in_one_proxy_opens_the_other(vendor, start_proxy, admin_of, redis_server):
    a = await start_proxy(guarded(vendor, redis_server.url))
    b = await start_proxy(guarded(vendor, redis_server.url))
    b_admin = await admin_of(b)
    await trip(a, vendor)

    async def b_open() -> bool:
        return (await (await b_admin.get("/admin/breakers")).json())["breakers"]["tavily"][
            "state"
        ] == "open"

    await eventually(b_open, within=1.5)
    calls = vendor.count()
    r = await search(b)
    assert r.status == 503 and r.headers["X-Circuit"] == "open"
    assert vendor.count() == calls


async def test_redis_down_each_proxy_keeps_its_own_breaker(vendor, start_proxy, killable_redis):
    a = await start_proxy(guarded(vendor, killable_redis.url))
    killable_redis.stop()
    async with asyncio.timeout(1.5):  # a dead Redis must not stall requests
        await trip(a, vendor)
    r = await search(a)
    assert r.status == 503 and r.headers["X-Circuit"] == "open"


async def test_requests_in_flight_stop_retrying_once_the_breaker_opens(vendor, start_proxy):
    retry = {
        "attempts": 3,
        "backoff": {"initial": "200ms", "max": "200ms", "multiplier": 1, "jitter": "none"},
        "budget": {"ratio": 0, "min_per_s": 10},
    }
    client = await start_proxy(guarded(vendor, retry=retry, breaker={"fail_max": 1}))
    vendor.set_default(Fault.status(503))
    first = asyncio.create_task(search(client, "a"))  # attempts at 0, 200 and 400 ms
    await vendor.wait_for_requests(2)
    second = await search(client, "b")  # fails at ~200 ms, would retry at ~400 and ~600 ms
    assert (await first).status == 503
    assert second.status == 503
    # The first request's failure opened the breaker while the second waited to retry: it
    # stopped instead of spending its attempts on a vendor known to be down.
    assert int(second.headers["X-Proxy-Attempts"]) < 3
    assert vendor.count() < 6

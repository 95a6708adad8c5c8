"""Rate limits end to end: smoothing, refusing, learning from the vendor's 429, and one bucket
shared by two proxy processes through a real Redis."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from redis.utils import HIREDIS_AVAILABLE

from policies.core.clock import ManualClock
from testkit.fakevendor import Fault
from testkit.proxyprocess import ProxyProcess
from testkit.redisserver import redis_time
from testkit.waiting import eventually
from tests.conftest import route


def limited(vendor, **rate_limit):
    body = route(vendor.url + "/tavily", "/tavily", rate_limit=rate_limit)
    return {"routes": {"tavily": body}}


async def search(client, query="rate me"):
    return await client.post("/tavily/search", json={"query": query})


def max_in_window(times: list[float], window: float) -> int:
    times = sorted(times)
    best, start = 0, 0
    for end, t in enumerate(times):
        while t - times[start] >= window:
            start += 1
        best = max(best, end - start + 1)
    return best


async def test_over_the_burst_is_refused_with_retry_after(vendor, start_proxy):
    client = await start_proxy(limited(vendor, rate="2/s", burst=2, max_wait="0s"))
    statuses = [(await search(client)).status for _ in range(3)]
    assert statuses == [200, 200, 429]
    r = await search(client)
    err = (await r.json())["error"]
    assert err["type"] == "rate_limited" and 0 < err["retry_after_s"] <= 0.5
    assert r.headers["Retry-After"] == "1"
    assert vendor.count() == 2


class FrozenClock(ManualClock):
    """Time stands still and every sleep is recorded: concurrent requests each keep the wait
    they were given, instead of one request's sleep moving the clock for the others."""

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await asyncio.sleep(0)


async def test_bursts_are_smoothed_within_max_wait(vendor, start_proxy):
    clock = FrozenClock()
    raw = limited(vendor, rate="20/s", burst=1, max_wait="1s")
    client = await start_proxy(raw, clock=clock)
    results = await asyncio.gather(*(search(client, f"q{i}") for i in range(5)))
    assert [r.status for r in results] == [200] * 5
    assert vendor.count() == 5
    # 20/s: the first goes at once, each other one waits for its own token, 50 ms apart.
    assert sorted(clock.sleeps) == pytest.approx([0.05, 0.1, 0.15, 0.2])
    text = await (await client.get("/metrics")).text()
    assert 'search_proxy_ratelimit_total{decision="delayed",route="tavily"} 4.0' in text


async def test_vendor_429_pauses_the_bucket_for_everyone(vendor, start_proxy):
    client = await start_proxy(limited(vendor, rate="100/s", burst=10, max_wait="0s"))
    vendor.script(Fault.status(429, retry_after=2))
    assert (await search(client)).status == 429
    r = await search(client, "another caller")
    assert r.status == 429
    assert (await r.json())["error"]["type"] == "rate_limited"  # refused by us, not the vendor
    assert vendor.count() == 1


@pytest.mark.e2e  # two proxy processes
async def test_two_processes_share_one_bucket(vendor, redis_server, raw):
    config = {
        "redis": {"url": redis_server.url, "key_prefix": "rl-test"},
        "routes": {
            "tavily": route(
                vendor.url + "/tavily",
                "/tavily",
                rate_limit={"rate": "10/s", "burst": 5, "max_wait": "0s"},
            )
        },
    }
    a, b = ProxyProcess(config), ProxyProcess(config)
    await asyncio.gather(asyncio.to_thread(a.start), asyncio.to_thread(b.start))
    # Each says which reply parser redis-py runs (the suite's `test` extra installs hiredis).
    parser = "hiredis" if HIREDIS_AVAILABLE else "python"
    assert [e["redis_parser"] for p in (a, b) for e in p.events("listening")] == [parser] * 2
    try:
        async with aiohttp.ClientSession() as http:

            async def one(base: str, i: int) -> int:
                r = await http.post(f"{base}/tavily/search", json={"query": f"q{i}"})
                await r.read()
                return r.status

            started = time.monotonic()
            statuses = []
            redis_started = await redis_time(raw)
            while time.monotonic() - started < 1.5:
                statuses += await asyncio.gather(*(one(p.url, i) for i, p in enumerate((a, b))))
                await asyncio.sleep(0.02)
            span = await redis_time(raw) - redis_started  # the buckets' clock
    finally:
        await asyncio.gather(asyncio.to_thread(a.stop), asyncio.to_thread(b.stop))
    arrivals = [rec.at for rec in vendor.requests]
    assert statuses.count(200) == len(arrivals)
    assert 429 in statuses
    # rate + burst in any one-second window, whichever replica sent it
    assert max_in_window(arrivals, 1.0) <= 10 + 5
    assert len(arrivals) <= 5 + 10 * span + 1


async def test_redis_killed_mid_run_requests_keep_succeeding(vendor, start_proxy, killable_redis):
    raw = limited(vendor, rate="1000/s", burst=100, max_wait="0s")
    raw["redis"] = {"url": killable_redis.url}
    client = await start_proxy(raw)
    assert (await search(client)).status == 200
    killable_redis.stop()
    for i in range(20):
        async with asyncio.timeout(0.5):  # a dead Redis must not stall requests
            assert (await search(client, f"q{i}")).status == 200
    text = await (await client.get("/metrics")).text()
    assert "search_proxy_redis_up 0.0" in text
    killable_redis.start()

    async def redis_up_again() -> bool:
        assert (await search(client)).status == 200
        return "search_proxy_redis_up 1.0" in await (await client.get("/metrics")).text()

    await eventually(redis_up_again, within=3, interval=0.05)  # probed once per second

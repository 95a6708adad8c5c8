"""Known clients against a running proxy: tokens sent where each SDK sends its vendor key are
swapped for the route's key, unknown ones are refused before any vendor call, bucket or count,
per-client limits key on the client's name, and a daily quota holds across replicas sharing
Redis, failing in the vendor's dialect so the SDK raises its rate-limit error with our message.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import aiohttp
import pytest
import tavily
from exa_py import AsyncExa, Exa

from policies.ratelimit import MemoryBuckets, RateLimit
from proxy.app import STATE
from testkit.fakevendor import FakeVendor, Received, make_results
from testkit.proxyprocess import ProxyProcess
from testkit.redisserver import RedisServer
from tests.conftest import route

A_TOKEN = "agent-a-" + "a1" * 12
B_TOKEN = "agent-b-" + "b2" * 12
ENV = {"AGENT_A_TOKEN": A_TOKEN, "AGENT_B_TOKEN": B_TOKEN}
TAVILY_KEY = "tvly-the-operators-own-key"
EXA_KEY = "exa-the-operators-own-key"


def config(
    vendor: FakeVendor,
    *,
    daily: int | None = None,
    rate_limit: dict[str, Any] | None = None,
    redis: RedisServer | None = None,
) -> dict[str, Any]:
    agent_a: dict[str, Any] = {"token": "${AGENT_A_TOKEN}"}
    if daily is not None:
        agent_a["daily_requests"] = daily
    limits = {"rate_limit": rate_limit} if rate_limit else {}
    raw: dict[str, Any] = {
        "clients": {"agent-a": agent_a, "agent-b": "${AGENT_B_TOKEN}"},
        "routes": {
            "tavily": route(
                f"{vendor.url}/tavily",
                "/tavily",
                headers={"set": {"Authorization": f"Bearer {TAVILY_KEY}"}},
                search={"vendor": "tavily"},
                **limits,
            ),
            "exa": route(
                f"{vendor.url}/exa",
                "/exa",
                headers={"set": {"x-api-key": EXA_KEY}},
                search={"vendor": "exa"},
                **limits,
            ),
            "serpapi": route(f"{vendor.url}/serpapi", "/serpapi", search={"vendor": "serpapi"}),
        },
    }
    if redis is not None:
        raw["redis"] = {"url": redis.url, "key_prefix": "clients-test"}
    return raw


def carries(rec: Received, secret: str) -> bool:
    """Whether the vendor saw `secret` anywhere in the request."""
    seen = " ".join(f"{k}: {v}" for k, v in rec.headers.items())
    return secret in seen or secret in rec.query_string or secret in rec.text


def assert_only_the_routes_key(vendor: FakeVendor) -> None:
    assert vendor.requests, "no request reached the vendor"
    for rec in vendor.requests:
        assert not carries(rec, A_TOKEN) and not carries(rec, B_TOKEN), dict(rec.headers)
        if rec.vendor == "tavily":
            assert rec.headers.getall("Authorization") == [f"Bearer {TAVILY_KEY}"]
        if rec.vendor == "exa":
            assert rec.headers.getall("x-api-key") == [EXA_KEY]
            assert "Authorization" not in rec.headers


async def metric(client: Any, line_start: str) -> str | None:
    text = await (await client.get("/metrics")).text()
    return next((line for line in text.splitlines() if line.startswith(line_start)), None)


async def tavily_search(client: Any, token: str | None, query: str = "q") -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return await client.post("/tavily/search", json={"query": query}, headers=headers)


# --- refused before anything is spent ---------------------------------------------------------


async def test_unknown_tokens_cost_no_vendor_call_no_bucket_and_no_quota(vendor, start_proxy):
    limit = {"rate": "1/m", "burst": 1, "key": "client", "max_wait": "0s"}
    client = await start_proxy(config(vendor, daily=1, rate_limit=limit), env=ENV)
    made_up = [f"Bearer {secrets.token_hex(16)}" for _ in range(300)]
    for value in (*made_up, None, f"Bearer {TAVILY_KEY}", A_TOKEN, f"Bearer {A_TOKEN}x"):
        headers = {"Authorization": value} if value is not None else {}
        r = await client.post("/tavily/search", json={"query": "free?"}, headers=headers)
        assert r.status == 401 and r.headers["X-Proxy-Error"] == "unauthorized"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        message = (await r.json())["detail"]["error"]  # Tavily's error shape
        assert "no known client token" in message
        assert value is None or value.split()[-1] not in message
    r = await client.post("/exa/search", json={"query": "free?"}, headers={"x-api-key": "nope"})
    assert r.status == 401 and "x-api-key: <token>" in (await r.json())["error"]
    r = await client.post("/v1/search", json={"query": "free?"})
    assert r.status == 401 and (await r.json())["error"]["type"] == "unauthorized"
    assert vendor.count() == 0
    refused = await metric(client, 'search_proxy_clients_refused_total{reason="unknown_token"}')
    assert refused is not None and float(refused.split()[-1]) == len(made_up) + 6
    # Nothing was minted for them: no rate-limit bucket, no quota count.
    (limiter,) = [
        p for p in client.app[STATE].routes["tavily"].policies if isinstance(p, RateLimit)
    ]
    assert isinstance(limiter.store, MemoryBuckets) and len(limiter.store) == 0
    buckets = await metric(client, 'search_proxy_ratelimit_buckets{route="tavily"}')
    assert buckets is not None and float(buckets.split()[-1]) == 0  # the series reads 0
    assert (await tavily_search(client, A_TOKEN)).status == 200  # agent-a's one request is intact


@pytest.mark.e2e  # a proxy process: what it logs is checked too
async def test_a_proxy_process_refuses_a_flood_of_made_up_tokens_without_a_vendor_call(vendor):
    limit = {"rate": "1/h", "burst": 1, "key": "client", "max_wait": "0s"}
    proxy = ProxyProcess(config(vendor, rate_limit=limit), env=ENV)
    await asyncio.to_thread(proxy.start)
    made_up = [secrets.token_hex(16) for _ in range(1000)]
    try:
        async with aiohttp.ClientSession() as http:

            async def send(token: str) -> int:
                headers = {"Authorization": f"Bearer {token}"}
                url = f"{proxy.url}/tavily/search"
                async with http.post(url, json={"query": "q"}, headers=headers) as r:
                    await r.read()
                    return r.status

            statuses = []
            for start in range(0, len(made_up), 100):
                statuses += await asyncio.gather(*map(send, made_up[start : start + 100]))
            assert statuses == [401] * len(made_up)
            assert vendor.count() == 0
            assert await send(A_TOKEN) == 200
            async with http.get(f"{proxy.url}/metrics") as r:
                text = await r.text()
    finally:
        await asyncio.to_thread(proxy.stop)
    assert f'search_proxy_clients_refused_total{{reason="unknown_token"}} {len(made_up)}.0' in text
    assert 'search_proxy_ratelimit_buckets{route="tavily"} 1.0' in text  # agent-a's only
    assert_only_the_routes_key(vendor)
    logged = "\n".join(proxy.lines)
    assert A_TOKEN not in logged and not any(token in logged for token in made_up[:50])


# --- the token is swapped for the route's key -------------------------------------------------


async def test_a_client_token_is_swapped_for_the_routes_key_wherever_the_sdk_sends_it(
    vendor, start_proxy
):
    client = await start_proxy(config(vendor), env=ENV)
    assert (await tavily_search(client, A_TOKEN)).status == 200
    for headers in ({"x-api-key": A_TOKEN}, {"Authorization": f"Bearer {B_TOKEN}"}):
        r = await client.post("/exa/search", json={"query": "q"}, headers=headers)
        assert r.status == 200, await r.text()
    assert_only_the_routes_key(vendor)
    # A vendor that takes its key as a query parameter: the token is taken out; this route
    # injects no key of its own, so none goes (the proxy cannot inject query keys).
    r = await client.get(f"/serpapi/search.json?engine=google&q=coffee&api_key={A_TOKEN}")
    assert r.status == 200
    assert vendor.last.query_string == "engine=google&q=coffee"


async def test_per_client_limits_key_on_the_clients_name_not_its_credential(vendor, start_proxy):
    limit = {"rate": "1/m", "burst": 1, "key": "client", "max_wait": "0s"}
    client = await start_proxy(config(vendor, rate_limit=limit), env=ENV)
    exa = "/exa/search"
    assert (
        await client.post(exa, json={"query": "a"}, headers={"x-api-key": A_TOKEN})
    ).status == 200
    # The same client in the other place a token may go: the same bucket, already spent.
    again = await client.post(
        exa, json={"query": "b"}, headers={"Authorization": f"Bearer {A_TOKEN}"}
    )
    assert again.status == 429 and again.headers["X-Proxy-Error"] == "rate_limited"
    assert (
        await client.post(exa, json={"query": "c"}, headers={"x-api-key": B_TOKEN})
    ).status == 200
    held = await metric(client, 'search_proxy_ratelimit_buckets{route="exa"}')
    assert held is not None and float(held.split()[-1]) == 2  # one per client name


# --- daily quotas ---------------------------------------------------------------------------------


async def test_two_replicas_sharing_redis_enforce_one_clients_daily_quota_together(
    vendor, start_proxy, redis_server
):
    raw = config(vendor, daily=3, redis=redis_server)
    a = await start_proxy(raw, env=ENV)
    b = await start_proxy(raw, env=ENV)
    statuses = [(await tavily_search(p, A_TOKEN, f"q{i}")).status for i, p in enumerate((a, b, a))]
    assert statuses == [200, 200, 200]
    for replica in (b, a):
        r = await tavily_search(replica, A_TOKEN, "one more")
        assert r.status == 429 and r.headers["X-Proxy-Error"] == "quota_exceeded"
        retry_after = int(r.headers["Retry-After"])
        assert 0 < retry_after <= 86_400
        message = (await r.json())["detail"]["error"]
        assert "daily quota of 3 requests" in message and "resets at 00:00 UTC, in " in message
    assert vendor.count() == 3
    assert (await tavily_search(b, B_TOKEN)).status == 200  # agent-b has no quota
    refused = await metric(a, 'search_proxy_clients_refused_total{reason="quota"}')
    assert refused is not None and float(refused.split()[-1]) == 1


async def test_v1_search_identifies_its_caller_and_counts_it(vendor, start_proxy):
    client = await start_proxy(config(vendor, daily=1), env=ENV)
    bearer = {"Authorization": f"Bearer {A_TOKEN}"}
    r = await client.post(
        "/v1/search", json={"query": "q", "providers": ["tavily"]}, headers=bearer
    )
    assert r.status == 200, await r.text()
    assert (await r.json())["results"]
    assert_only_the_routes_key(vendor)
    r = await client.post("/v1/search", json={"query": "q2"}, headers=bearer)
    assert r.status == 429 and (await r.json())["error"]["type"] == "quota_exceeded"


# --- the vendors' own SDKs --------------------------------------------------------------------


def expected(query: str) -> list[str]:
    return [r.url for r in make_results(query, 2)]


@pytest.mark.e2e
async def test_tavily_and_exa_sdks_with_a_client_token_get_results_and_the_vendor_only_its_key(
    vendor, start_proxy
):
    client = await start_proxy(config(vendor), env=ENV)

    def base(name: str) -> str:
        return str(client.make_url(f"/{name}"))

    def tavily_sync(query: str) -> list[str]:
        with tavily.TavilyClient(api_key=A_TOKEN, api_base_url=base("tavily")) as sdk:
            return [r["url"] for r in sdk.search(query, max_results=2)["results"]]

    def exa_sync(query: str) -> list[str]:
        answer = Exa(api_key=B_TOKEN, base_url=base("exa")).search(query, num_results=2)
        return [r.url for r in answer.results]

    assert await asyncio.to_thread(tavily_sync, "sync tavily") == expected("sync tavily")
    assert await asyncio.to_thread(exa_sync, "sync exa") == expected("sync exa")
    async with tavily.AsyncTavilyClient(api_key=B_TOKEN, api_base_url=base("tavily")) as sdk:
        answer = await sdk.search("async tavily", max_results=2)
    assert [r["url"] for r in answer["results"]] == expected("async tavily")
    async with AsyncExa(api_key=A_TOKEN, api_base=base("exa")) as exa:
        found = await exa.search("async exa", num_results=2)
    assert [r.url for r in found.results] == expected("async exa")
    assert vendor.count() == 4
    assert_only_the_routes_key(vendor)


@pytest.mark.e2e
async def test_sdks_raise_their_own_errors_with_our_message_for_a_bad_token_or_a_spent_quota(
    vendor, start_proxy
):
    client = await start_proxy(config(vendor, daily=1), env=ENV)
    tavily_base = str(client.make_url("/tavily"))

    def tavily_search_with(token: str, query: str) -> Any:
        with tavily.TavilyClient(api_key=token, api_base_url=tavily_base) as sdk:
            return sdk.search(query)

    with pytest.raises(tavily.InvalidAPIKeyError, match="no known client token"):
        await asyncio.to_thread(tavily_search_with, "tvly-" + "0" * 24, "q")
    await asyncio.to_thread(tavily_search_with, A_TOKEN, "first")
    with pytest.raises(tavily.UsageLimitExceededError, match=r"daily quota of 1 requests.*UTC"):
        await asyncio.to_thread(tavily_search_with, A_TOKEN, "second")
    exa = Exa(api_key=A_TOKEN, base_url=str(client.make_url("/exa")))
    with pytest.raises(ValueError, match=r"(?s)429.*daily quota of 1 requests"):
        await asyncio.to_thread(exa.search, "third")
    assert vendor.count() == 1

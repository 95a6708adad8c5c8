"""Hedged attempts through a running proxy against the fake vendor: the loser is cancelled and its
connection given back, the breaker and the cache see the winner once, hedges to a fallback
answer in the primary's shape, and only idempotent requests are hedged."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from testkit.fakevendor import FakeVendor, Fault, expected_urls
from testkit.waiting import eventually
from tests.conftest import route

QUERY = "hedged search through the proxy"
# Short enough for a test, far longer than a hedge: a request that waits for it has failed.
TIMEOUTS = {"connect": "200ms", "per_try": "2s", "total": "5s"}
GENEROUS = {"ratio": 1.0, "min_per_s": 10}  # the budget never binds in these tests


def tavily(vendor: FakeVendor, **extra: Any) -> dict[str, Any]:
    body = route(
        vendor.url + "/tavily",
        "/tavily",
        search={"vendor": "tavily", "loop_guard": "0s"},
        hedge=extra.pop("hedge", {"after": "50ms", "budget": GENEROUS}),
        **extra,
    )
    body["timeouts"] = TIMEOUTS
    return body


async def search(client: Any, query: str = QUERY) -> Any:
    return await client.post("/tavily/search", json={"query": query, "max_results": 2})


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def test_the_loser_is_cancelled_and_its_connection_returned_to_the_pool(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    """Two connections to the vendor in all: a hedge needs both. Had a loser kept its
    connection, the next request's hedge would find the pool full (200 ms, then an error) and
    that request would wait out the hung attempt's 2 s per_try."""
    client = await start_proxy(
        {"server": {"upstream_connections_per_host": 2}, "routes": {"tavily": tavily(vendor)}}
    )
    for _ in range(4):
        vendor.script(Fault.hang(20), Fault.ok())
        started = time.monotonic()
        r = await search(client)
        assert r.status == 200
        assert (await r.json())["results"]
        assert time.monotonic() - started < 1.0
        assert r.headers["X-Proxy-Attempts"] == "1"
        assert r.headers["X-Proxy-Hedges"] == "1"
    assert vendor.count() == 8
    # The fake saw each hung call's connection close: its handler was cancelled, not left
    # waiting 20 s for a client that had moved on.
    hung = [pause for pause in vendor.pauses if pause.cause == "hang"]
    assert len(hung) == 4
    await eventually(lambda: all(pause.ended == "cancelled" for pause in hung))
    text = await (await client.get("/metrics")).text()
    assert metric(text, "search_proxy_hedges_total", route="tavily", result="won") == 4
    assert metric(text, "search_proxy_retries_total", route="tavily") == 0
    assert metric(text, "search_proxy_upstream_attempts_total", route="tavily", outcome="ok") == 4


async def test_the_breaker_counts_one_outcome_per_request(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    """Each request fails twice at the vendor (its attempt and its hedge); with fail_max: 2 the
    circuit opens after two requests, not after one."""
    vendor.latency(0.1)
    vendor.script(*[Fault.status(503)] * 4)
    raw = tavily(vendor, hedge={"after": "20ms", "budget": GENEROUS}, breaker={"fail_max": 2})
    client = await start_proxy({"routes": {"tavily": raw}})
    for expected_calls in (2, 4):
        r = await search(client)
        assert r.status == 503 and r.headers["X-Proxy-Hedges"] == "1"
        assert vendor.count() == expected_calls
    r = await search(client)
    assert r.status == 503 and r.headers.get("X-Circuit") == "open"
    assert vendor.count() == 4  # open: no vendor call
    text = await (await client.get("/metrics")).text()
    assert metric(text, "search_proxy_hedges_total", route="tavily", result="lost") == 2


async def test_the_cache_stores_the_winner(vendor: FakeVendor, start_proxy: Any) -> None:
    client = await start_proxy({"routes": {"tavily": tavily(vendor, cache={"ttl": "10m"})}})
    vendor.script(Fault.hang(20), Fault.ok())
    first = await search(client)
    assert first.status == 200 and first.headers["X-Cache"] == "MISS"
    assert first.headers["X-Proxy-Hedges"] == "1"
    second = await search(client)
    assert second.headers["X-Cache"] == "HIT"
    assert await second.read() == await first.read()
    assert vendor.count() == 2


async def test_a_hedge_to_the_fallback_answers_in_the_primarys_shape(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    primary = tavily(
        vendor,
        hedge={"after": "50ms", "to": "fallback", "budget": GENEROUS},
        fallback={"providers": ["exa"]},
    )
    exa = route(
        vendor.url + "/exa",
        "/exa",
        search={"vendor": "exa"},
        headers={"set": {"x-api-key": "exa-proxy-key"}},
    )
    client = await start_proxy({"routes": {"tavily": primary, "exa": exa}})
    vendor.script(Fault.hang(20), path_prefix="/tavily")
    r = await search(client)
    assert r.status == 200
    body = await r.json()
    assert [hit["url"] for hit in body["results"]] == expected_urls(QUERY, 2)  # Tavily's shape
    assert r.headers["X-Search-Provider"] == "exa"
    assert r.headers["X-Proxy-Hedges"] == "1"
    sent = vendor.last
    assert sent.path == "/exa/search"
    assert sent.headers.get("x-api-key") == "exa-proxy-key"  # the fallback's own key


async def test_only_idempotent_requests_are_hedged(vendor: FakeVendor, start_proxy: Any) -> None:
    plain = route(vendor.url + "/echo", "/plain", hedge={"after": "20ms", "budget": GENEROUS})
    client = await start_proxy({"routes": {"plain": plain}})
    vendor.script(Fault.hang(0.3))
    r = await client.post("/plain/orders", json={"create": "something"})
    assert r.status == 200 and "X-Proxy-Hedges" not in r.headers
    assert vendor.count() == 1  # a POST the route did not mark safe: never sent twice
    vendor.script(Fault.hang(20), Fault.ok())
    r = await client.get("/plain/orders/7")
    assert r.status == 200 and r.headers["X-Proxy-Hedges"] == "1"
    assert vendor.count() == 3

"""One envelope for every endpoint: a route, /v1/search and /mcp are each counted in the request
metrics under their own label and logged with one access line, through a real proxy on
loopback in front of the fake vendor."""

from __future__ import annotations

from typing import Any

import structlog

from policies.profiles import reading
from testkit.fakevendor import FakeVendor
from tests.conftest import route

RPC_PING = {"jsonrpc": "2.0", "id": 1, "method": "ping"}


def requests_count(exposition: str, label: str, status_class: str) -> float:
    head = f'search_proxy_requests_total{{route="{label}",status_class="{status_class}"}} '
    lines = [line for line in exposition.splitlines() if line.startswith(head)]
    return float(lines[0].split()[-1]) if lines else 0.0


async def test_routes_search_and_mcp_are_each_counted_and_logged(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(
        {"routes": {"tavily": route(vendor.url, "/tavily", search={"vendor": "tavily"})}}
    )
    with structlog.testing.capture_logs() as logs:
        assert (await client.post("/tavily/search", json={"query": "a b"})).status == 200
        assert (await client.post("/v1/search", json={"query": "a b"})).status == 200
        assert (await client.get("/v1/search")).status == 405
        r = await client.post("/mcp", json=RPC_PING, headers={"Accept": "application/json"})
        assert r.status == 200
    exposition = await (await client.get("/metrics")).text()
    assert requests_count(exposition, "tavily", "2xx") == 1
    assert requests_count(exposition, "/v1/search", "2xx") == 1
    assert requests_count(exposition, "/v1/search", "4xx") == 1
    assert requests_count(exposition, "/mcp", "2xx") == 1
    assert 'search_proxy_request_duration_seconds_count{route="/v1/search"} 2.0' in exposition
    assert 'search_proxy_request_duration_seconds_count{route="/mcp"} 1.0' in exposition
    lines = [e for e in logs if e["event"] == "request"]
    assert [(e["route"], e["status"]) for e in lines] == [
        ("tavily", 200),
        ("search", 200),
        ("search", 405),
        ("mcp", 200),
    ]
    assert lines[1]["providers"] == ["tavily"] and lines[1]["attempts"] == 1
    assert lines[2]["error"] == "method_not_allowed"
    assert lines[3]["rpc"] == "ping"
    assert all(e["request_id"] and e["duration_ms"] >= 0 for e in lines)


async def test_the_parse_a_requests_policies_shared_ends_with_it(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    """The guard, the classifier and the cache share one parse of the body and of the answer
    (policies/profiles/reading.py). A vendor's answer of many small results parses to many
    times its size, outside the memory budget: it must not stay once the request is done."""
    client = await start_proxy(
        {"routes": {"tavily": route(vendor.url, "/tavily", search={"vendor": "tavily"})}}
    )
    for path in ("/tavily/search", "/v1/search"):
        r = await client.post(path, json={"query": "a b"})
        assert r.status == 200 and (await r.json())["results"]
        assert reading._last == (b"", reading.NOT_JSON)  # neither its body's nor its answer's

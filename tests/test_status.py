"""The status document (GET /admin/status) and the page's shell (GET /) on the admin listener:
what they report of routes, endpoints and providers, who may read them, that nothing secret
shows, and the numbers derived from the sampled metrics (pure functions)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from proxy.app import STATE
from proxy.config import parse_config
from proxy.metrics import LATENCY_BUCKETS, Metrics
from proxy.status import Pulse, Tick, quantile
from proxy.statushtml import PAGE, SCRIPT, STYLE
from proxy.statuspage import CSP
from testkit.fakevendor import Fault
from testkit.waiting import eventually
from tests.conftest import route

KEY = "tvly-secret-key-0123456789"
TOKEN = "op-b7e2d9f4a1c8e3b6d0"
OTHER_KEY = "other-secret-0123456789"


def config(vendor: Any) -> dict[str, Any]:
    return {
        "routes": {
            "tavily": route(
                vendor.url + "/tavily",
                "/tavily",
                search={"vendor": "tavily"},
                headers={"set": {"Authorization": f"Bearer {KEY}"}},
                breaker={"fail_max": 1, "reset_timeout": "60s"},
                cache={"ttl": "1m"},
                rate_limit={"rate": "10/s", "burst": 5},
                hedge={"after": "1s"},
            ),
            "brave": route(
                "http://127.0.0.1:1/brave",
                "/brave",
                search={"vendor": "brave"},
                fallback={"providers": ["tavily"]},
            ),
            "exa": route(
                vendor.url + "/exa",
                "/exa",
                search={"vendor": "exa"},
                headers={"set": {"x-api-key": "${EXA_KEY:-}"}},
            ),
        }
    }


async def status(admin: Any, **headers: str) -> Any:
    r = await admin.get("/admin/status", headers=headers)
    assert r.status == 200, await r.text()
    return await r.json()


async def test_the_status_document_reports_routes_endpoints_and_providers(
    vendor: Any, start_proxy: Any, admin_of: Any
) -> None:
    client = await start_proxy(config(vendor))
    admin = await admin_of(client)
    pulse = client.app[STATE].pulse
    now = [100.0]
    pulse.now = lambda: now[0]
    pulse.ticks.clear()
    pulse.sample()
    for query in ("a b", "a b", "c d", "e f"):
        assert (await client.post("/tavily/search", json={"query": query})).status == 200
    assert (await client.post("/v1/search", json={"query": "x y"})).status == 200
    vendor.script(Fault.status(503))
    assert (await client.post("/tavily/search", json={"query": "boom"})).status == 503
    now[0] += 2.0
    pulse.sample()
    body = await status(admin)
    routes = {r["name"]: r for r in body["routes"]}
    tavily = routes["tavily"]
    assert tavily["requests_per_s"] == 2.5  # 5 requests in 2 s
    assert tavily["success_pct"] == 80.0
    assert tavily["p50_ms"] is not None and tavily["p99_ms"] >= tavily["p50_ms"]
    assert tavily["breaker"]["state"] == "open" and tavily["breaker"]["retry_in_s"] > 50
    assert tavily["colour"] == "bad"
    assert tavily["limiter"]["rate"] == "10/s" and tavily["limiter"]["burst"] == 5
    assert tavily["limiter"]["queued"] == 0 and tavily["limiter"]["tokens"] < 5
    # One hit of 6 lookups (/v1/search searched through the route too); 4 answers stored.
    assert tavily["cache"] == {"entries": 4, "hit_pct": 17} and "cache_hit_pct" not in tavily
    assert tavily["hedges"] == {"won": 0, "lost": 0, "cancelled": 0, "refused": 0}
    assert tavily["rate"] == [2.5] and tavily["errors"] == [0.5]
    (error,) = tavily["last_errors"]
    assert error["status"] == 503 and error["error"] is None
    assert error["message"] == "the vendor answered 503"
    assert routes["brave"]["failovers"] == {"answered": 0, "empty": 0, "failed": 0, "skipped": 0}
    assert routes["exa"]["missing_key"] == "x-api-key" and routes["exa"]["colour"] == "warn"
    endpoints = {e["name"]: e for e in body["endpoints"]}
    assert endpoints["/v1/search"]["requests_per_s"] == 0.5 and endpoints["/mcp"]["enabled"]
    providers = {p["name"]: (p["state"], p["why"]) for p in body["providers"]}
    assert providers["tavily"][0] == "skipped" and "circuit open" in providers["tavily"][1]
    assert providers["brave"] == ("ready", None)
    assert providers["exa"] == ("skipped", "no API key: EXA_KEY is not set")  # what to export
    assert body["redis"] == "not configured" and body["version"]
    assert body["errors"][0]["route"] == "tavily"


async def test_nothing_secret_shows(vendor: Any, start_proxy: Any, admin_of: Any) -> None:
    raw = config(vendor)
    raw["server"] = {"admin_token": TOKEN}
    raw["routes"]["leaky"] = route("http://127.0.0.1:1/x", "/leaky")
    raw["routes"]["leaky"]["headers"] = {"set": {"X-Api-Key": OTHER_KEY}}
    client = await start_proxy(raw)
    admin = await admin_of(client)
    assert (await client.get("/leaky/search?q=a")).status == 502
    text = await (await admin.get("/admin/status", headers=auth())).text()
    page = await (await admin.get("/")).text()
    for secret in (KEY, TOKEN, OTHER_KEY):
        assert secret not in text and secret not in page
    assert "upstream_unreachable" in text  # the error is listed, its message redacted


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


async def test_who_may_read_the_status(vendor: Any, start_proxy: Any, admin_of: Any) -> None:
    raw = config(vendor)
    raw["server"] = {"admin_token": TOKEN}
    admin = await admin_of(await start_proxy(raw))
    assert (await admin.get("/admin/status")).status == 401
    assert (await admin.get("/admin/status", headers=auth())).status == 200
    page = await admin.get("/")  # the shell has no data: its script asks for the token
    assert page.status == 200 and "tavily" not in await page.text()
    open_admin = await admin_of(await start_proxy(config(vendor)))
    assert (await open_admin.get("/admin/status")).status == 200  # loopback, no token
    # Without a token, a page that reached 127.0.0.1 under another name (DNS rebinding) or
    # posts from another site is refused.
    rebound = await open_admin.get("/admin/status", headers={"Host": "evil.example:8081"})
    assert rebound.status == 403 and (await rebound.json())["error"]["type"] == "forbidden"
    other_site = await open_admin.post("/admin/reload", headers={"Origin": "http://evil.example"})
    assert other_site.status == 403
    ok = await open_admin.get("/admin/status", headers={"Host": "localhost:8081"})
    assert ok.status == 200


async def test_the_page_loads_nothing_from_elsewhere_under_a_strict_csp(
    vendor: Any, start_proxy: Any, admin_of: Any
) -> None:
    admin = await admin_of(await start_proxy(config(vendor)))
    r = await admin.get("/")
    assert r.headers["Content-Security-Policy"] == CSP
    assert r.headers["Content-Type"] == "text/html; charset=utf-8"
    assert "unsafe" not in CSP and "default-src 'none'" in CSP and "connect-src 'self'" in CSP
    body = await r.text()
    # Only the SVG namespace looks like a URL; nothing is fetched but /admin/status.
    assert set(re.findall(r"https?://[^\s\"'<>)]+", body)) == {"http://www.w3.org/2000/svg"}
    assert "<link" not in body and "@import" not in STYLE and "src=" not in PAGE
    assert re.findall(r"fetch\(\"([^\"]+)\"", SCRIPT) == ["/admin/status"]
    assert "innerHTML" not in SCRIPT  # data is written as text, never parsed as markup


# ---------------------------------------------------------------------------------------------
# The numbers (pure)


def test_quantile_interpolates_like_prometheus() -> None:
    bounds = (0.1, 0.5, 1.0)
    counts = (0.0, 10.0, 10.0, 10.0)  # every observation between 0.1 and 0.5 s, +Inf last
    assert quantile(0.5, bounds, counts) == pytest.approx(0.3)
    assert quantile(0.99, bounds, counts) == pytest.approx(0.496)
    assert quantile(0.5, bounds, (0.0, 0.0, 0.0, 0.0)) is None
    assert quantile(0.99, bounds, (0.0, 0.0, 0.0, 5.0)) == 1.0  # past the last bound


def test_numbers_read_the_windows_of_the_sampled_counters() -> None:
    pulse = Pulse(Metrics())
    empty = (0.0,) * (len(LATENCY_BUCKETS) + 1)
    slow = (*(0.0 if b < 0.1 else 4.0 for b in LATENCY_BUCKETS), 4.0)
    for at, answered, failed, buckets in ((0.0, 0.0, 0.0, empty), (1.0, 4.0, 1.0, slow)):
        pulse.ticks.append(Tick(at, {"r": answered}, {"r": failed}, {"r": buckets}, {}))
    found = pulse.numbers("r")
    assert found["requests_per_s"] == 4.0 and found["success_pct"] == 75.0
    assert found["p50_ms"] == pytest.approx(75.0)  # inside the 50-100 ms bucket
    assert found["rate"] == [4.0] and found["errors"] == [1.0]
    assert pulse.numbers("other")["requests_per_s"] == 0.0


def test_recorded_messages_hide_the_configured_secrets() -> None:
    pulse = Pulse(Metrics())
    raw = {"routes": {"t": {"prefix": "/t", "upstream": "http://t.example"}}}
    raw["routes"]["t"]["headers"] = {"set": {"X-Key": KEY}}
    pulse.follow(parse_config(raw, {}), ["t"])
    message = f"failed with {KEY} and Bearer abcdefghijklmnop"
    pulse.record("t", 502, "upstream_unreachable", message, "rid")
    (recent,) = pulse.recent("t")
    assert recent["message"] == "failed with <redacted> and Bearer <redacted>"
    pulse.record("t", 500, None, "x" * 1000, "rid")
    assert len(pulse.recent()[0]["message"]) == 300
    pulse.follow(parse_config(raw, {}), [])  # the route is gone: so are its errors
    assert pulse.recent("t") == [] and len(pulse.recent()) == 2


async def test_requests_waiting_for_tokens_show_as_queued(
    vendor: Any, start_proxy: Any, admin_of: Any
) -> None:
    limited = route(vendor.url + "/tavily", "/tavily", rate_limit={"rate": "1/m", "burst": 1})
    limited["timeouts"]["total"] = "5m"  # room to wait a minute or two for a token
    client = await start_proxy({"routes": {"tavily": limited}})
    admin = await admin_of(client)
    waiting = [
        asyncio.create_task(client.post("/tavily/search", json={"query": f"q{i}"}))
        for i in range(3)
    ]

    async def limiter() -> dict[str, Any]:
        (tavily,) = (await status(admin))["routes"]
        found: dict[str, Any] = tavily["limiter"]
        return found

    async def two_queued() -> bool:
        return bool((await limiter())["queued"] == 2)

    await eventually(two_queued)  # one token: two requests wait a minute or two for theirs
    assert vendor.count() == 1 and (await limiter())["tokens"] == 0
    assert (await status(admin))["routes"][0]["colour"] == "warn"
    for task in waiting:
        task.cancel()


async def test_endpoint_errors_are_listed_under_their_own_endpoint(
    vendor: Any, start_proxy: Any, admin_of: Any
) -> None:
    raw = config(vendor)
    raw["log"] = {"level": "warning"}  # no access line: the page must not depend on it
    client = await start_proxy(raw)
    admin = await admin_of(client)
    assert (await client.post("/v1/fetch", json={"urls": []})).status == 400
    vendor.down()  # every provider fails: web_search answers a tool error inside a 200
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "web_search", "arguments": {"query": "a b"}},
    }
    accept = {"Accept": "application/json, text/event-stream"}
    r = await client.post("/mcp", json=call, headers=accept)
    assert r.status == 200 and (await r.json())["result"]["isError"] is True
    errors = {e["route"]: e for e in (await status(admin))["errors"]}
    assert errors["/v1/fetch"]["status"] == 400
    assert errors["/mcp"]["status"] == 200 and errors["/mcp"]["error"] == "all_providers_failed"

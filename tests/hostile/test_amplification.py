"""No amplification through /v1/search, against a real proxy process: a small body naming a
batch of queries and a long providers list is refused before any vendor call, and what a valid
request may cost (queries x providers x retries and variants) stops at
search_api.max_calls_per_request, counted at the fake vendor. Each request writes one access-log
line, like every other."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from testkit.fakevendor import FakeVendor
from testkit.proxyprocess import ProxyProcess
from testkit.waiting import wait_until
from tests.conftest import route

PROVIDERS = ("tavily", "brave", "exa")
MAX_CALLS = 30


def config(vendor_url: str) -> dict[str, Any]:
    """Three providers retrying three times with simplification on: worst case 20 queries x 3
    providers x (3 attempts + 3 variants) = 360 calls, were it not for max_calls_per_request."""
    retry = {"attempts": 3, "backoff": {"initial": "1ms", "max": "1ms", "jitter": "none"}}
    routes = {
        name: route(f"{vendor_url}/{name}", f"/{name}", search={"vendor": name}, retry=retry)
        for name in PROVIDERS
    }
    api = {"providers": list(PROVIDERS), "max_calls_per_request": MAX_CALLS}
    return {"routes": routes, "search_api": api}


QUERIES = [f"query number {i}" for i in range(20)]
# The bodies of the report: 20 queries x 1,000 providers (8 KB), and its 1.5 KB variant.
AMPLIFYING = {
    "20 queries x 1,000 providers": {"queries": QUERIES, "providers": list(PROVIDERS) * 334},
    "1.5 KB, one provider over and over": {"queries": QUERIES, "providers": ["exa"] * 150},
    "a provider twice": {"queries": QUERIES, "providers": ["tavily", "tavily"]},
}


@pytest.fixture
async def proxy(vendor: FakeVendor) -> Any:
    process = ProxyProcess(config(vendor.url))
    await asyncio.to_thread(process.start)
    yield process
    assert await asyncio.to_thread(process.stop) == 0


def search_lines(proxy: ProxyProcess, count: int = 1) -> list[dict[str, Any]]:
    """The access-log lines of /v1/search, once there are `count` of them (blocking)."""

    def found() -> list[dict[str, Any]]:
        lines = [e for e in proxy.events("request") if e.get("route") == "search"]
        return lines if len(lines) >= count else []

    return wait_until(found, 5.0, interval=0.01)


@pytest.mark.parametrize("body", AMPLIFYING.values(), ids=AMPLIFYING.keys())
async def test_an_amplifying_body_is_refused_before_any_vendor_call(
    vendor: FakeVendor, proxy: ProxyProcess, body: dict[str, Any]
) -> None:
    data = json.dumps(body, separators=(",", ":"))
    assert len(data) < 10_000  # a small body: the cost is in what it asks for
    async with aiohttp.ClientSession() as http:
        r = await http.post(f"{proxy.url}/v1/search", data=data)
        error = (await r.json())["error"]
    assert r.status == 400 and error["type"] == "bad_request"
    assert error["message"].startswith("/v1/search: providers")
    assert vendor.count() == 0
    (line,) = await asyncio.to_thread(search_lines, proxy)
    assert line["status"] == 400 and line["attempts"] == 0


async def test_a_valid_batch_against_a_failing_vendor_stops_at_max_calls_per_request(
    vendor: FakeVendor, proxy: ProxyProcess
) -> None:
    vendor.down()
    async with aiohttp.ClientSession() as http:
        r = await http.post(f"{proxy.url}/v1/search", json={"queries": QUERIES})
        answers = (await r.json())["responses"]
    assert r.status == 200 and len(answers) == len(QUERIES)
    assert vendor.count() == MAX_CALLS
    assert all("error" in a for a in answers)
    (line,) = await asyncio.to_thread(search_lines, proxy)
    assert line["status"] == 200 and line["attempts"] == MAX_CALLS
    assert line["queries"] == 20 and line["providers"] == list(PROVIDERS)
    assert line["duration_ms"] > 0


async def test_every_search_request_writes_one_access_log_line(
    vendor: FakeVendor, proxy: ProxyProcess
) -> None:
    async with aiohttp.ClientSession() as http:
        ok = await http.post(f"{proxy.url}/v1/search", json={"query": "one line"})
        assert ok.status == 200
        wrong = await http.get(f"{proxy.url}/v1/search")
        assert wrong.status == 405
    first, second = await asyncio.to_thread(search_lines, proxy, 2)
    assert (first["method"], first["status"], first["providers"]) == ("POST", 200, ["tavily"])
    assert first["attempts"] == vendor.count() == 1
    assert (second["method"], second["status"], second["attempts"]) == ("GET", 405, 0)
    assert first["request_id"] != second["request_id"]

"""How long a `web_search` call on the proxy's own /mcp lives: one deadline for the whole call
(`mcp_server.call_timeout`), every provider attempt included, and it stops, with its vendor
calls, when its client leaves or cancels it (on a POST of its own: the server is stateless)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
import structlog

from testkit.fakevendor import FakeVendor
from testkit.waiting import eventually
from tests.conftest import route
from tests.test_mcp_server import TOKEN, TOOL_NAME, served_as_in_production, session, text_of

HANG = 5.0  # how long the fake vendor takes: far past every limit here
ACCEPT = {"Accept": "application/json, text/event-stream"}
OTHER_TOKEN = "mcp-other-d2f8a1c7e4b9036f5a"


def hanging(vendor: FakeVendor, **extra: Any) -> dict[str, Any]:
    """Two providers on a vendor that answers after HANG seconds; generous route limits, so
    only the call's own deadline or its client can end it sooner."""
    vendor.latency(HANG)
    slow = {"connect": "1s", "per_try": "10s", "total": "20s"}
    retry = {"attempts": 3, "backoff": {"initial": "10ms"}}
    tavily = route(f"{vendor.url}/tavily", "/tavily", search={"vendor": "tavily"}, retry=retry)
    brave = route(f"{vendor.url}/brave", "/brave", search={"vendor": "brave"})
    return {
        "routes": {"tavily": {**tavily, "timeouts": slow}, "brave": {**brave, "timeouts": slow}},
        **extra,
    }


def call(request_id: int, query: str = "slow question") -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": TOOL_NAME, "arguments": {"query": query}},
    }


def cancel(request_id: int) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "method": "notifications/cancelled",
        "params": {"requestId": request_id, "reason": "the user moved on"},
    }


async def test_a_call_with_every_provider_hanging_ends_at_its_deadline(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    raw = hanging(vendor, mcp_server={"call_timeout": "300ms"})
    proxy = await start_proxy(raw)
    async with session(str(proxy.make_url("/mcp"))) as mcp:
        started = time.monotonic()
        result = await mcp.call_tool(TOOL_NAME, {"query": "slow question"})
        took = time.monotonic() - started
    assert result.isError is True
    text = text_of(result)
    assert text.startswith("web_search ran out of its 300ms (mcp_server.call_timeout)")
    assert "All 2 providers failed" in text
    assert took < HANG / 2  # the deadline ended it, not the vendor
    # One vendor call started (cut at the deadline); no other provider, no retry, was asked.
    assert vendor.count() == 1
    await eventually(lambda: vendor.pauses[0].ended == "cancelled")


async def test_a_client_that_leaves_stops_the_call_and_its_vendor_calls(
    vendor: FakeVendor,
) -> None:
    """Served as the CLI serves it (aiohttp does not cancel a handler whose client left)."""
    raw = hanging(vendor)
    async with served_as_in_production(raw) as base:
        with structlog.testing.capture_logs() as logs:
            async with httpx.AsyncClient(
                trust_env=False, timeout=httpx.Timeout(5, read=0.2)
            ) as http:
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(f"{base}/mcp", json=call(1), headers=ACCEPT)
            left = time.monotonic()
            await eventually(lambda: any(e["event"] == "request" for e in logs), within=3)
            stopped = time.monotonic() - left
        [line] = [e for e in logs if e["event"] == "request"]
        assert line["status"] == 499 and line["cut"] == "client_gone"
        assert stopped < 2.0  # noticed within about a second, not after HANG
        await eventually(lambda: vendor.pauses[0].ended == "cancelled")
        assert vendor.count() == 1  # no vendor call after the client left


async def test_a_cancel_on_its_own_post_stops_the_call_it_names(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    clients = {"a": TOKEN, "b": OTHER_TOKEN}
    raw = hanging(vendor, clients=clients)
    proxy = await start_proxy(raw)
    url = str(proxy.make_url("/mcp"))
    a = {**ACCEPT, "Authorization": f"Bearer {TOKEN}"}
    b = {**ACCEPT, "Authorization": f"Bearer {OTHER_TOKEN}"}
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        pending = asyncio.create_task(http.post(url, json=call(7), headers=a))
        await eventually(lambda: vendor.count() == 1)
        others = await http.post(url, json=cancel(7), headers=b)  # b's own call 7: none
        assert others.status_code == 202 and not pending.done()
        assert vendor.pauses[0].ended is None
        cancelled = await http.post(url, json=cancel(7), headers=a)
        answer = await asyncio.wait_for(pending, 2)
    assert cancelled.status_code == 202
    result = answer.json()["result"]
    assert result["isError"] is True and "cancelled" in result["content"][0]["text"]
    await eventually(lambda: vendor.pauses[0].ended == "cancelled")
    assert vendor.count() == 1


async def test_a_cancel_that_names_two_callers_calls_stops_neither(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    """Without credentials two local agents cannot be told apart, and their ids start alike."""
    vendor.latency(0.3)
    raw = {
        "routes": {"tavily": route(f"{vendor.url}/tavily", "/tavily", search={"vendor": "tavily"})}
    }
    proxy = await start_proxy(raw)
    url = str(proxy.make_url("/mcp"))
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        both = [asyncio.create_task(http.post(url, json=call(3, q), headers=ACCEPT)) for q in "ab"]
        await eventually(lambda: vendor.count() == 2)
        await http.post(url, json=cancel(3), headers=ACCEPT)
        answers = await asyncio.gather(*both)
    assert all(a.json()["result"]["isError"] is False for a in answers)

"""Tests of the fake search vendor itself (proxy/testing/fakevendor/)."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from policies.core.clock import ManualClock
from testkit.fakevendor import (
    FakeVendor,
    FakeVendorProcess,
    Fault,
    Pause,
    expected_urls,
    make_results,
)
from testkit.waiting import eventually

ClientFactory = Callable[[web.Application], Awaitable[TestClient]]
URLS = expected_urls("hello world")


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def vendor(clock: ManualClock) -> FakeVendor:
    return FakeVendor(seed=7, clock=clock)


@pytest.fixture
async def client(vendor: FakeVendor, aiohttp_client: Any) -> TestClient:
    return await aiohttp_client(vendor.make_app())


# (vendor, method, path, request kwargs, function extracting the result urls)
SHAPES: list[tuple[str, str, str, dict[str, Any], Callable[[Any], list[str]]]] = [
    (
        "tavily",
        "POST",
        "/tavily/search",
        {"json": {"query": "hello world", "max_results": 5}},
        lambda b: [r["url"] for r in b["results"]],
    ),
    (
        "serper",
        "POST",
        "/serper/search",
        {"json": {"q": "hello world"}},
        lambda b: [r["link"] for r in b["organic"]],
    ),
    (
        "exa",
        "POST",
        "/exa/search",
        {"json": {"query": "hello world", "numResults": 3}},
        lambda b: [r["url"] for r in b["results"] if r["text"]],
    ),
    (
        "brave",
        "GET",
        "/brave/res/v1/web/search",
        {"params": {"q": "hello world", "count": "10"}},
        lambda b: [r["url"] for r in b["web"]["results"] if r["description"]],
    ),
    (
        "serpapi",
        "GET",
        "/serpapi/search.json",
        {"params": {"q": "hello world", "engine": "google", "api_key": "k"}},
        lambda b: [r["link"] for r in b["organic_results"] if r["snippet"]],
    ),
    (
        "scavio",
        "POST",
        "/scavio/api/v2/google",
        {"json": {"query": "hello world"}},
        lambda b: [r["link"] for r in b["organic_results"]],
    ),
    (
        "searxng",
        "GET",
        "/searxng/search",
        {"params": {"q": "hello world", "format": "json"}},
        lambda b: [r["url"] for r in b["results"] if r["content"]],
    ),
    (
        "linkup",
        "POST",
        "/linkup/v1/search",
        {"json": {"q": "hello world", "depth": "standard", "outputType": "searchResults"}},
        lambda b: [r["url"] for r in b["results"] if r["name"] and r["content"]],
    ),
    (
        "jina",
        "POST",
        "/jina/",
        {"json": {"q": "hello world"}},
        lambda b: [r["url"] for r in b["data"] if r["description"]],
    ),
    (
        "jina",
        "GET",
        "/jina/hello%20world",
        {},
        lambda b: [r["url"] for r in b["data"]],
    ),
    (
        "firecrawl",
        "POST",
        "/firecrawl/v2/search",
        {"json": {"query": "hello world", "limit": 5}},
        lambda b: [r["url"] for r in b["data"]["web"]] if b["success"] else [],
    ),
]


@pytest.mark.parametrize(
    ("name", "method", "path", "kwargs", "urls"), SHAPES, ids=[s[2] for s in SHAPES]
)
async def test_vendor_shapes(
    client: TestClient,
    vendor: FakeVendor,
    name: str,
    method: str,
    path: str,
    kwargs: dict[str, Any],
    urls: Callable[[Any], list[str]],
) -> None:
    resp = await client.request(method, path, **kwargs)
    assert resp.status == 200
    assert urls(await resp.json()) == URLS
    assert vendor.last.vendor == name


async def test_bare_paths_and_search_routing(client: TestClient, vendor: FakeVendor) -> None:
    tavily = await client.post(
        "/search", json={"query": "hello world"}, headers={"Authorization": "Bearer t"}
    )
    body = await tavily.json()
    assert body["query"] == "hello world" and [r["url"] for r in body["results"]] == URLS
    serper = await client.post("/search", json={"q": "hello world"}, headers={"X-API-KEY": "s"})
    assert [r["link"] for r in (await serper.json())["organic"]] == URLS
    # LangChain's Serper: q in the query string, no body
    serper_qs = await client.post("/search", params={"q": "hello world", "num": "2"})
    assert [r["position"] for r in (await serper_qs.json())["organic"]] == [1, 2]
    exa = await client.post("/search", json={"query": "hello world"}, headers={"x-api-key": "e"})
    assert "text" in (await exa.json())["results"][0]
    serpapi = await client.get("/search", params={"q": "hello world", "engine": "google"})
    assert "organic_results" in await serpapi.json()
    searx = await client.get("/search", params={"q": "hello world", "format": "json"})
    assert "results" in await searx.json()
    brave = await client.get("/res/v1/web/search", params={"q": "hello world"})
    assert "web" in await brave.json()
    assert [r.vendor for r in vendor.requests] == [
        "tavily",
        "serper",
        "serper",
        "exa",
        "serpapi",
        "searxng",
        "brave",
    ]


async def test_empty_answers_are_vendor_correct(client: TestClient, vendor: FakeVendor) -> None:
    vendor.empty_when_words_over(3)
    q = "one two three four"
    brave = await client.get("/brave/res/v1/web/search", params={"q": q})
    assert brave.status == 200 and "web" not in await brave.json()
    serpapi = await client.get("/serpapi/search.json", params={"q": q})
    body = await serpapi.json()
    assert serpapi.status == 200 and body["error"] and "organic_results" not in body
    assert body["search_information"]["organic_results_state"] == "Fully empty"
    linkup = await client.post("/linkup/v1/search", json={"q": q})
    assert linkup.status == 400
    assert (await linkup.json())["error"]["code"] == "SEARCH_QUERY_NO_RESULT"
    tavily = await client.post("/tavily/search", json={"query": q})
    assert (await tavily.json())["results"] == []
    short = await client.post("/tavily/search", json={"query": "one two three"})
    assert len((await short.json())["results"]) == 3


async def test_script_runs_in_order_then_normal(client: TestClient, vendor: FakeVendor) -> None:
    vendor.script(
        Fault.status(503),
        Fault.status(429, retry_after=2),
        Fault.status(432),
        Fault.missing_results(),
    )
    statuses = []
    for _ in range(5):
        resp = await client.post("/tavily/search", json={"query": "hello world"})
        statuses.append((resp.status, resp.headers.get("Retry-After"), await resp.json()))
    expected = [(503, None), (429, "2"), (432, None), (200, None), (200, None)]
    assert [s[:2] for s in statuses] == expected
    assert "plan" in statuses[2][2]["detail"]["error"]
    assert "results" not in statuses[3][2] and statuses[3][2]["query"] == "hello world"
    assert "results" in statuses[4][2]
    assert vendor.pending == 0 and vendor.count("/tavily") == 5


async def test_vendor_error_shapes_and_path_prefix(client: TestClient, vendor: FakeVendor) -> None:
    vendor.script(Fault.status(429, error_code="INSUFFICIENT_FUNDS_CREDITS"), path_prefix="/linkup")
    vendor.script(Fault.status(422), path_prefix="/brave")
    # /echo passes over faults meant for other prefixes
    assert (await client.get("/echo")).status == 200
    brave = await client.get("/brave/res/v1/web/search", params={"q": "x"})
    assert brave.status == 422
    assert (await brave.json())["error"]["code"] == "SUBSCRIPTION_TOKEN_INVALID"
    linkup = await client.post("/linkup/v1/search", json={"q": "x"})
    assert linkup.status == 429
    assert (await linkup.json())["error"]["code"] == "INSUFFICIENT_FUNDS_CREDITS"


async def test_record(client: TestClient, vendor: FakeVendor, clock: ManualClock) -> None:
    start = clock.now()
    await client.post(
        "/echo/a%2Fb/c?x=1&x=2", data=b"\x00\xffraw", headers={"X-Custom": "v", "Cookie": "c=1"}
    )
    clock.advance(2.5)
    await client.get("/brave/res/v1/web/search?q=hi")
    first, second = vendor.requests
    assert first.method == "POST" and first.path == "/echo/a/b/c"
    assert first.raw_path == "/echo/a%2Fb/c?x=1&x=2" and first.query_string == "x=1&x=2"
    assert first.query.getall("x") == ["1", "2"]
    assert first.headers["x-custom"] == "v" and first.headers["COOKIE"] == "c=1"
    assert first.body == b"\x00\xffraw"
    assert (first.at, second.at) == (start, start + 2.5)  # stamped on the fake's clock
    assert vendor.count() == 2 and vendor.count("/echo") == 1 and vendor.count("/brave") == 1
    vendor.script(Fault.status(500))
    vendor.down()
    vendor.reset()
    assert vendor.requests == [] and vendor.pending == 0
    assert (await client.get("/echo")).status == 200


async def test_echo(client: TestClient) -> None:
    resp = await client.put(
        "/echo/deep/path?a=1", data=b"hello", headers={"X-Trace": "t1", "Content-Type": "x/y"}
    )
    body = await resp.json()
    assert body["method"] == "PUT" and body["path"] == "/echo/deep/path"
    assert body["query_string"] == "a=1" and body["body"] == "hello"
    assert body["headers"]["X-Trace"] == "t1" and body["body_b64"] == "aGVsbG8="


async def test_gzip_answer_decodes(client: TestClient, vendor: FakeVendor) -> None:
    vendor.script(Fault.gzip())
    resp = await client.post("/tavily/search", json={"query": "hello world"})
    assert resp.headers["Content-Encoding"] == "gzip"
    assert [r["url"] for r in (await resp.json())["results"]] == URLS
    vendor.script(Fault.gzip())
    raw = await client.post("/tavily/search", json={"query": "hello world"}, auto_decompress=False)
    assert json.loads(gzip.decompress(await raw.read()))["query"] == "hello world"


async def test_malformed_is_truncated_json(client: TestClient, vendor: FakeVendor) -> None:
    vendor.script(Fault.malformed())
    resp = await client.post("/exa/search", json={"query": "hello world"})
    assert resp.status == 200 and resp.content_type == "application/json"
    with pytest.raises(ValueError):
        json.loads(await resp.read())


async def test_reset_closes_connection(client: TestClient, vendor: FakeVendor) -> None:
    vendor.script(Fault.reset())
    with pytest.raises(aiohttp.ClientConnectionError):
        await client.post("/tavily/search", json={"query": "hello world"})
    ok = await client.post("/tavily/search", json={"query": "hello world"})
    assert ok.status == 200 and vendor.count() == 2


async def test_hang_waits_its_seconds_then_answers(
    client: TestClient, vendor: FakeVendor, clock: ManualClock
) -> None:
    vendor.script(Fault.hang(0.15))
    resp = await client.get("/echo")
    assert resp.status == 200
    assert clock.sleeps == [0.15]
    assert vendor.pauses == [Pause("/echo", "hang", 0.15, "slept")]


async def test_hang_is_cut_by_the_client_leaving_and_by_shutdown() -> None:
    vendor = FakeVendor()  # real time: these hangs must still be waiting when they are cut
    server = await vendor.start()
    vendor.script(Fault.hang(30), Fault.hang(30))
    async with aiohttp.ClientSession() as session:
        leaving = asyncio.create_task(session.get(f"{server.url}/echo"))
        await vendor.wait_for_requests(1)
        leaving.cancel()
        await eventually(lambda: vendor.pauses[0].ended == "cancelled")
        task = asyncio.create_task(session.get(f"{server.url}/echo"))
        await vendor.wait_for_requests(2)
        await server.close()
        # Cut when shutdown began, not cancelled after the runner's 1 s shutdown timeout.
        assert vendor.pauses[1].ended == "shutdown"
        with pytest.raises(aiohttp.ClientConnectionError):
            await task


async def test_modes_rate_limit_down_fail_ratio(client: TestClient, vendor: FakeVendor) -> None:
    vendor.rate_limit(per_second=2)
    got = [(await client.get("/echo")).status for _ in range(3)]
    assert got == [200, 200, 429]
    limited = await client.get("/echo")
    assert limited.status == 429 and limited.headers["Retry-After"] == "1"
    vendor.rate_limit(None)
    vendor.down()
    assert (await client.get("/echo")).status == 503
    vendor.up()

    async def pattern() -> list[int]:
        vendor.reset()
        vendor.fail_ratio(0.5, status=502)
        return [(await client.get("/echo")).status for _ in range(12)]

    first = await pattern()
    assert first == await pattern() and {200, 502} == set(first)


async def test_brave_rate_limit_headers(client: TestClient, vendor: FakeVendor) -> None:
    vendor.brave_rate_limits(per_second=1, per_month=100)
    resp = await client.get("/brave/res/v1/web/search", params={"q": "x"})
    assert resp.status == 200
    assert resp.headers["X-RateLimit-Limit"] == "1, 100"
    assert resp.headers["X-RateLimit-Remaining"] == "0, 99"
    again = await client.get("/brave/res/v1/web/search", params={"q": "x"})
    assert again.status == 429 and (await again.json())["error"]["code"] == "RATE_LIMITED"


async def test_stream_gate(client: TestClient, vendor: FakeVendor) -> None:
    vendor.gate_streams()
    vendor.release_chunk()
    resp = await client.get("/stream")
    assert resp.headers["Content-Type"] == "application/octet-stream"
    first = await asyncio.wait_for(resp.content.readuntil(b"\n"), 1)
    assert first == b"chunk-0\n"
    await asyncio.sleep(0.05)
    assert vendor.chunks_sent == 1 and not resp.content.at_eof()
    vendor.release_chunk(2)
    assert await resp.content.read() == b"chunk-1\nchunk-2\n"


async def test_sse_and_mcp(client: TestClient, vendor: FakeVendor) -> None:
    sse = await client.get("/sse", params={"events": "2"})
    assert sse.headers["Content-Type"] == "text/event-stream"
    text = await sse.text()
    assert text.count("event: message") == 2 and '"i": 1' in text

    accept = {"Accept": "application/json, text/event-stream"}
    init = await client.post(
        "/mcp",
        json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}},
        headers=accept,
    )
    assert init.headers["Content-Type"] == "text/event-stream"
    session = init.headers["Mcp-Session-Id"]
    assert '"serverInfo"' in await init.text()
    note = await client.post(
        "/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=accept
    )
    assert note.status == 202
    vendor.gate_streams()
    vendor.release_chunk()
    call = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {
            "name": "search",
            "arguments": {"query": "hello world"},
            "_meta": {"progressToken": "p"},
        },
    }
    resp = await client.post("/mcp", json=call, headers=accept | {"Mcp-Session-Id": session})
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 1)
    assert b"notifications/progress" in first
    vendor.release_chunk()
    rest = (await resp.content.read()).decode()
    data = json.loads(rest.split("data: ", 1)[1])
    items = json.loads(data["result"]["content"][0]["text"])
    assert [i["url"] for i in items] == URLS


def test_results_are_deterministic() -> None:
    assert make_results("Hello, World!", 2)[1].url == "https://example.com/hello-world/2"
    assert expected_urls("a b", 3) == [f"https://example.com/a-b/{i}" for i in (1, 2, 3)]


async def test_thread_and_process() -> None:
    vendor = FakeVendor()
    with vendor.start_in_thread() as threaded:
        vendor.script(Fault.status(503))
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{threaded.url}/echo") as resp:
                assert resp.status == 503
            with FakeVendorProcess("--fail-ratio", "1", "--fail-status", "502") as proc:
                async with session.get(f"{proc.url}/res/v1/web/search?q=x") as resp:
                    assert resp.status == 502
                async with session.get(f"{proc.url}/__fake__/stats") as resp:
                    assert (await resp.json())["by_vendor"] == {"brave": 1}
    assert vendor.count("/echo") == 1

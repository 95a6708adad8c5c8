"""The MCP server's fetch_page tool through the official mcp client (streamable HTTP) against the
proxy app on a real port: listed beside web_search with /v1/fetch's schemas, reading pages with
the first provider down, and its tool errors; and tavily_extract on an MCP route, idempotent
by the tavily preset."""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema import Draft202012Validator

from proxy.mcp_fetch import ARGUMENTS, render_pages
from testkit.fakemcp import FakeMcp
from testkit.fakevendor import FakeVendor, make_page
from tests.conftest import route
from tests.test_fetch_api import A, B, extracts
from tests.test_mcp_route import connect, fake, start
from tests.test_mcp_route import text_of as route_text
from tests.test_mcp_server import mcp_url, session, text_of

__all__ = ["fake"]  # the fake MCP server's fixture, used here

NO_RETRY = {"attempts": 1}


@pytest.fixture
async def proxy(vendor: FakeVendor, start_proxy: Any) -> Any:
    """web_search over tavily; fetch_page over tavily's extract, then exa's contents."""
    raw = {
        "routes": {
            "tavily": route(
                f"{vendor.url}/tavily", "/tavily", search={"vendor": "tavily"}, retry=NO_RETRY
            ),
            "exa": route(f"{vendor.url}/exa", "/exa", search={"vendor": "exa"}, retry=NO_RETRY),
        },
        "search_api": {"providers": ["tavily"]},
        "fetch_api": {"providers": ["tavily", "exa"], "max_chars": 5000},
    }
    return await start_proxy(raw)


async def test_fetch_page_is_listed_with_v1_fetchs_schemas(proxy: Any) -> None:
    async with session(mcp_url(proxy)) as mcp:
        tools = {t.name: t for t in (await mcp.list_tools()).tools}
    assert set(tools) == {"web_search", "fetch_page"}
    tool = tools["fetch_page"]
    schema = tool.inputSchema
    assert schema["required"] == ["urls"] and tuple(schema["properties"]) == ARGUMENTS
    assert schema["properties"]["format"]["enum"] == ["markdown", "text"]
    assert "default 5000" in schema["properties"]["max_chars"]["description"]
    assert tool.annotations is not None and tool.annotations.readOnlyHint is True
    assert tool.outputSchema is not None
    Draft202012Validator.check_schema(tool.outputSchema)
    assert set(tool.outputSchema["$defs"]) == {"FetchResult", "FetchFailure"}


async def test_the_first_provider_down_fetch_page_reads_through_the_next(
    vendor: FakeVendor, proxy: Any
) -> None:
    vendor.down(503, path_prefix="/tavily")
    async with session(mcp_url(proxy)) as mcp:
        tool = next(t for t in (await mcp.list_tools()).tools if t.name == "fetch_page")
        result = await mcp.call_tool("fetch_page", {"urls": [A, B], "format": None})
    assert result.isError is False
    answer = result.structuredContent
    assert answer is not None
    Draft202012Validator(tool.outputSchema).validate(answer)
    assert [(r["url"], r["provider"]) for r in answer["results"]] == [(A, "exa"), (B, "exa")]
    text = text_of(result)
    assert text.startswith(f"# {make_page(A).title}\nURL: {A}\nRead by exa.")
    assert make_page(B).content in text
    assert [b["urls"] for b in extracts(vendor, "/exa/contents")] == [[A, B]]


async def test_one_url_as_text_and_what_could_not_be_read(vendor: FakeVendor, proxy: Any) -> None:
    vendor.fail_page(B)
    async with session(mcp_url(proxy)) as mcp:
        one = await mcp.call_tool("fetch_page", {"urls": A, "max_chars": 9})
        both = await mcp.call_tool("fetch_page", {"urls": [A, B]})
        none = await mcp.call_tool("fetch_page", {"urls": [B]})
    assert one.isError is False and "cut to 9 characters" in text_of(one)
    assert both.isError is False
    assert text_of(both).endswith(
        f"Could not read:\n- {B}: {both.structuredContent['failed'][0]['error']['message']}"
    )
    assert "from the proxy's cache" in text_of(both)  # A was read by the first call
    assert none.isError is True and "No provider could read this page" in text_of(none)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"url": A},
            "fetch_page: url is not an argument of fetch_page (its arguments: urls, "
            "format, max_chars)",
        ),
        ({"format": "text"}, "fetch_page: urls is required"),
        (
            {"urls": ["file:///etc/passwd"]},
            "fetch_page: urls[0] must be an absolute http or https URL",
        ),
    ],
)
async def test_bad_arguments_are_a_tool_error_naming_them(
    vendor: FakeVendor, proxy: Any, arguments: dict[str, Any], message: str
) -> None:
    async with session(mcp_url(proxy)) as mcp:
        result = await mcp.call_tool("fetch_page", arguments)
    assert result.isError is True and text_of(result).startswith(message)
    assert vendor.requests == []


def test_render_pages_says_where_each_page_came_from() -> None:
    answer = {
        "results": [
            {
                "url": A,
                "title": "",
                "content": "body",
                "provider": "tavily",
                "fetched_at": "2026-01-02T03:04:05+00:00",
                "format": "markdown",
                "truncated": True,
                "from_cache": True,
            }
        ],
        "failed": [],
    }
    assert render_pages(answer) == (
        f"# {A}\nURL: {A}\nRead by tavily (from the proxy's cache, read at "
        "2026-01-02T03:04:05+00:00); cut to 4 characters.\n\nbody"
    )


async def test_tavily_extract_on_an_mcp_route_is_retried_and_cached_by_the_preset(
    start_proxy: Any, fake: FakeMcp
) -> None:
    """The tavily preset lists tavily_extract as idempotent: its calls go through the route's
    policies (a failed one retried, an identical one answered by the cache)."""
    fake.fail_first = 1  # the first tool call gets HTTP 503
    retry = {"attempts": 2, "backoff": {"initial": "10ms", "max": "10ms"}}
    url = await start(start_proxy, fake, retry=retry, cache={"ttl": "60s"})
    arguments = {"urls": ["https://a.example/page"]}
    async with connect(url) as (session, _):
        first = await session.call_tool("tavily_extract", arguments)
        again = await session.call_tool("tavily_extract", arguments)
    assert not first.isError and route_text(again) == route_text(first)
    assert "a.example/page" in route_text(first)
    # The 503 retried; the second identical call answered by the cache, not the server.
    assert [c.status for c in fake.calls] == [503, 200]

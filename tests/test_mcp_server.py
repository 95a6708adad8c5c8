"""The proxy's own MCP server at /mcp, through the official mcp client (streamable HTTP) against
the proxy app on a real port, with fake vendors behind it: the web_search tool, its failover
across /v1/search's providers, its tool errors, and who may call it."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from aiohttp import web
from jsonschema import Draft202012Validator
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.server.streamable_http import StreamableHTTPServerTransport
from mcp.server.transport_security import TransportSecurityMiddleware

from proxy.app import build_app
from proxy.config import ConfigErrors, McpServerConfig, as_document, parse_config
from proxy.mcp_server import refusal, takes_json
from proxy.mcp_tool import ARGUMENTS, TOOL_NAME, render_text
from proxy.search_api import SearchApi
from testkit.fakevendor import FakeVendor, Fault, expected_urls
from testkit.procs import free_port
from tests.conftest import route

MCP_DOC = Path(__file__).resolve().parent.parent / "docs" / "mcp.md"
QUERY = "circuit breaker pattern"
TOKEN = "mcp-client-5b1e9d3f7a2c8e40f6"
RETRY = {"attempts": 1}


def providers(first: str, second: str, **extra: Any) -> dict[str, Any]:
    """Two search providers, tried in this order: tavily at `first`, brave at `second`."""
    return {
        "routes": {
            "tavily": route(first, "/tavily", search={"vendor": "tavily"}, retry=RETRY),
            "brave": route(second, "/brave", search={"vendor": "brave"}, retry=RETRY),
        },
        **extra,
    }


def dead() -> str:
    """An origin where nothing listens: connections are refused."""
    return f"http://127.0.0.1:{free_port()}"


def mcp_url(client: Any) -> str:
    return str(client.make_url("/mcp"))


@contextlib.asynccontextmanager
async def session(url: str, token: str | None = None) -> AsyncIterator[ClientSession]:
    """An initialized session of the official mcp client (no HTTP proxy from the environment)."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with (
        httpx.AsyncClient(headers=headers, trust_env=False, timeout=30) as http,
        streamable_http_client(url, http_client=http) as (read, write, _),
        ClientSession(read, write) as mcp,
    ):
        await mcp.initialize()
        yield mcp


def status_error(group: BaseExceptionGroup[Any]) -> httpx.HTTPStatusError:
    """The HTTP error inside the exception group the mcp client raises for a refused request."""
    found = group.subgroup(lambda e: isinstance(e, httpx.HTTPStatusError))
    assert found is not None, group
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    assert isinstance(found, httpx.HTTPStatusError)
    return found


async def request_lines(logs: list[dict[str, Any]], within: float = 3.0) -> list[dict[str, Any]]:
    """The access-log lines written so far, once there is one."""
    async with asyncio.timeout(within):
        while True:
            lines = [e for e in logs if e["event"] == "request"]
            if lines:
                return lines
            await asyncio.sleep(0.02)


def text_of(result: Any) -> str:
    assert len(result.content) == 1 and result.content[0].type == "text", result.content
    text: str = result.content[0].text
    return text


@pytest.fixture(autouse=True)
def no_unhandled_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """No request here may end in an exception nothing handled: aiohttp's bare "Error handling
    request", or an error the mcp package logs (a crashed session, a failed answer)."""
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    caplog.set_level(logging.WARNING, logger="mcp")
    yield
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


@pytest.fixture
async def proxy(vendor: FakeVendor, start_proxy: Any) -> Any:
    """Both providers healthy on the fake vendor."""
    return await start_proxy(providers(f"{vendor.url}/tavily", f"{vendor.url}/brave"))


# ---------------------------------------------------------------------------------------------
# The tool


async def test_initialize_and_list_tools_show_web_search_with_its_schemas(proxy: Any) -> None:
    async with (
        httpx.AsyncClient(trust_env=False) as http,
        streamable_http_client(mcp_url(proxy), http_client=http) as (read, write, _),
        ClientSession(read, write) as mcp,
    ):
        init = await mcp.initialize()
        assert init.serverInfo.name == "search-proxy"
        assert init.capabilities.tools is not None
        tools = (await mcp.list_tools()).tools
    assert [t.name for t in tools] == [TOOL_NAME, "fetch_page"]  # fetch_page: tavily extracts
    tool = tools[0]
    schema = tool.inputSchema
    assert schema["required"] == ["query"] and schema["additionalProperties"] is False
    assert tuple(schema["properties"]) == ARGUMENTS
    assert schema["properties"]["time_range"]["enum"] == ["day", "week", "month", "year"]
    assert schema["properties"]["max_results"]["maximum"] == 50
    assert "default 5" in schema["properties"]["max_results"]["description"]
    assert all(p["description"] for p in schema["properties"].values())
    assert tool.description and "Search the web" in tool.description
    assert tool.annotations is not None and tool.annotations.readOnlyHint is True
    output = tool.outputSchema
    assert output is not None
    Draft202012Validator.check_schema(output)
    assert set(output["required"]) >= {"results", "provider", "query_used", "attempts"}
    assert set(output["$defs"]) == {"SearchResult", "Attempt"}


async def test_web_search_returns_text_and_the_v1_search_answer(
    proxy: Any, vendor: FakeVendor
) -> None:
    async with session(mcp_url(proxy)) as mcp:
        result = await mcp.call_tool(TOOL_NAME, {"query": QUERY, "max_results": 2})
        output = (await mcp.list_tools()).tools[0].outputSchema
    assert result.isError is False
    answer = result.structuredContent
    assert answer is not None
    Draft202012Validator(output).validate(answer)
    assert [r["url"] for r in answer["results"]] == expected_urls(QUERY, 2)
    assert answer["provider"] == "tavily" and answer["query_used"] == QUERY
    assert vendor.last.path == "/tavily/search"
    # The same search through /v1/search: the same answer, but for the time it took.
    r = await proxy.post("/v1/search", json={"query": QUERY, "max_results": 2})
    direct = await r.json()
    for a in (answer, direct):
        for attempt in a["attempts"]:
            attempt.pop("ms")
    assert answer == direct
    text = text_of(result)
    assert text.startswith(f'Web search results for "{QUERY}":')
    first = answer["results"][0]
    assert f"1. {first['title']}\n   {first['url']}\n   {first['snippet']}" in text
    assert "2. Result 2 for" in text
    assert text.rstrip().endswith("Answered by tavily.")


@pytest.mark.parametrize("how", ["refusing connections", "503"])
async def test_first_provider_down_the_next_answers_and_the_text_says_so(
    how: str, vendor: FakeVendor, start_proxy: Any
) -> None:
    if how == "503":
        first = f"{vendor.url}/tavily"
        vendor.script(Fault.status(503), path_prefix="/tavily")
    else:
        first = dead()
    proxy = await start_proxy(providers(first, f"{vendor.url}/brave"))
    async with session(mcp_url(proxy)) as mcp:
        result = await mcp.call_tool(TOOL_NAME, {"query": QUERY})
    assert result.isError is False, text_of(result)
    answer = result.structuredContent
    assert answer is not None
    assert answer["provider"] == "brave"
    assert [(a["provider"], a["outcome"]) for a in answer["attempts"]] == [
        ("tavily", "failed"),
        ("brave", "results"),
    ]
    assert [r["url"] for r in answer["results"]] == expected_urls(QUERY, 3)
    assert "Answered by brave, after tavily (failed)." in text_of(result)
    assert vendor.last.path.startswith("/brave/")


async def test_all_providers_down_is_a_tool_error_with_the_proxys_message(
    start_proxy: Any,
) -> None:
    proxy = await start_proxy(providers(dead(), dead()))
    async with session(mcp_url(proxy)) as mcp:
        result = await mcp.call_tool(TOOL_NAME, {"query": QUERY})
    assert result.isError is True
    assert result.structuredContent is None
    text = text_of(result)
    assert text.startswith("All 2 providers failed: tavily ")
    assert ", brave " in text and "Retry" in text
    assert "Traceback" not in text
    r = await proxy.post("/v1/search", json={"query": QUERY})
    assert r.status == 503
    assert text == (await r.json())["error"]["message"]  # the very message /v1/search gives


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"query": "  "}, "web_search: query is empty; send the words to search for"),
        ({"query": None}, "web_search: query is required: send the words to search for"),
        ({"max_results": 3}, "web_search: query is required"),
        ({"query": "x", "max_results": 0}, "web_search: max_results must be a whole number"),
        ({"query": "x", "time_range": "hour"}, "web_search: time_range must be one of day, week"),
        ({"query": "x", "country": "UK"}, "web_search: country must be an ISO 3166-1 alpha-2"),
        ({"query": "x", "q": "y"}, "web_search: q is not an argument of web_search"),
        ({"query": "x", "providers": ["brave"]}, "web_search: providers is not an argument"),
    ],
)
async def test_bad_input_is_a_tool_error_naming_the_argument(
    proxy: Any, vendor: FakeVendor, arguments: dict[str, Any], message: str
) -> None:
    async with session(mcp_url(proxy)) as mcp:
        result = await mcp.call_tool(TOOL_NAME, arguments)
    assert result.isError is True
    assert text_of(result).startswith(message), text_of(result)
    assert vendor.count() == 0


async def test_optional_arguments_sent_as_null_count_as_not_sent(
    proxy: Any, vendor: FakeVendor
) -> None:
    async with session(mcp_url(proxy)) as mcp:
        result = await mcp.call_tool(
            TOOL_NAME, {"query": QUERY, "time_range": None, "max_results": None, "topic": "news"}
        )
    assert result.isError is False, text_of(result)
    sent = vendor.last.json()
    assert sent["topic"] == "news" and "time_range" not in sent
    assert sent["max_results"] == 5  # search_api.max_results, the default


async def test_an_unknown_tool_is_a_tool_error(proxy: Any) -> None:
    async with session(mcp_url(proxy)) as mcp:
        result = await mcp.call_tool("book_flight", {"to": "Lisbon"})
    assert result.isError is True
    assert text_of(result) == (
        "there is no tool 'book_flight' here: its tools are web_search, fetch_page"
    )


async def test_a_bug_is_a_tool_error_without_its_details(
    proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("detail of the bug, sk-not-for-the-llm")

    monkeypatch.setattr(SearchApi, "answer", broken)
    with structlog.testing.capture_logs() as logs:
        async with session(mcp_url(proxy)) as mcp:
            result = await mcp.call_tool(TOOL_NAME, {"query": QUERY})
    assert result.isError is True
    text = text_of(result)
    assert text.startswith("search-proxy failed while searching (a bug; its log has the details")
    assert "sk-not-for-the-llm" not in text and "RuntimeError" not in text
    failed = [e for e in logs if e["event"] == "mcp_tool_failed"]
    assert len(failed) == 1 and failed[0]["request_id"] in text


@contextlib.asynccontextmanager
async def served_as_in_production(raw: dict[str, Any]) -> AsyncIterator[str]:
    """The proxy app on a loopback port with aiohttp's defaults, as the CLI serves it: unlike
    pytest-aiohttp's test server, a handler is not cancelled when its client leaves."""
    runner = web.AppRunner(build_app(parse_config(raw, {})))
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("handlers", ["run on", "cancelled"])
async def test_a_client_that_leaves_mid_call_is_logged_499_and_nothing_breaks(
    handlers: str, vendor: FakeVendor, start_proxy: Any
) -> None:
    raw = providers(f"{vendor.url}/tavily", f"{vendor.url}/brave")
    # The search that runs on must outlast the client's 0.1 s; the one that is cancelled must
    # end far before the vendor would have answered, with room for a loaded machine.
    vendor_s = 0.3 if handlers == "run on" else 1.5
    vendor.latency(vendor_s)
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": TOOL_NAME, "arguments": {"query": QUERY}},
    }
    accept = {"Accept": "application/json, text/event-stream"}
    async with contextlib.AsyncExitStack() as stack:
        if handlers == "run on":
            base = await stack.enter_async_context(served_as_in_production(raw))
        else:  # pytest-aiohttp's server cancels the handler of a client that left
            base = str((await start_proxy(raw)).make_url("")).rstrip("/")
        with structlog.testing.capture_logs() as logs:
            # Connecting may take its time on a loaded machine; the answer may not.
            async with httpx.AsyncClient(
                trust_env=False, timeout=httpx.Timeout(5, read=0.1)
            ) as http:
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(f"{base}/mcp", json=call, headers=accept)
            [line] = await request_lines(logs)
        assert line["status"] == 499 and line["tool"] == TOOL_NAME
        if handlers == "run on":  # the search ran to its end; its answer found nobody
            assert line["providers"] == ["tavily"] and line["duration_ms"] >= vendor_s * 1000
        else:
            assert line["duration_ms"] < vendor_s * 1000
        vendor.latency(0)
        async with session(f"{base}/mcp") as mcp:  # and the server goes on serving
            result = await mcp.call_tool(TOOL_NAME, {"query": QUERY})
        assert result.isError is False


async def test_a_simplified_query_is_named_in_the_text(proxy: Any, vendor: FakeVendor) -> None:
    vendor.empty_when_words_over(3)
    query = "how do northern lights change their color"
    async with session(mcp_url(proxy)) as mcp:
        result = await mcp.call_tool(TOOL_NAME, {"query": query})
    assert result.isError is False, text_of(result)
    answer = result.structuredContent
    assert answer is not None
    used = answer["query_used"]
    assert used != query and len(used.split()) <= 3 and answer["results"]
    assert f'these results are for the simplified query "{used}"' in text_of(result)


async def test_ten_parallel_tool_calls_all_succeed(proxy: Any, vendor: FakeVendor) -> None:
    vendor.latency(0.05)  # so the calls really overlap
    queries = [f"parallel agent question {i}" for i in range(10)]
    async with session(mcp_url(proxy)) as mcp:
        results = await asyncio.gather(
            *(mcp.call_tool(TOOL_NAME, {"query": q, "max_results": 2}) for q in queries)
        )
    for q, result in zip(queries, results, strict=True):
        assert result.isError is False, text_of(result)
        assert result.structuredContent is not None
        assert [r["url"] for r in result.structuredContent["results"]] == expected_urls(q, 2)
    assert vendor.count("/tavily") == 10


async def test_the_documented_example_and_client_config(proxy: Any) -> None:
    """docs/mcp.md's snippet, run as written but for the proxy's address."""
    text = MCP_DOC.read_text(encoding="utf-8")
    start = text.index("\n## The proxy's own `/mcp` server\n")
    section = text[start : text.index("\n## ", start + 1)]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "http://localhost:8080/mcp" in code and code.rstrip().endswith("asyncio.run(main())")
    base = str(proxy.make_url("")).rstrip("/")
    code = code.replace("http://localhost:8080", base).replace("asyncio.run(main())", "")
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/mcp.md", "exec"), namespace)
    printed = io.StringIO()
    with structlog.testing.capture_logs(), contextlib.redirect_stdout(printed):  # logs aside
        await namespace["main"]()
    lines = printed.getvalue().splitlines()
    assert lines[0] == 'Web search results for "EU AI act":'
    assert lines[-2:] == ["Answered by tavily.", "tavily"]
    config = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    assert config["mcpServers"]["search"]["url"] == "http://localhost:8080/mcp"


def test_render_text_shows_dates_cache_and_dropped_options() -> None:
    answer = {
        "object": "search",
        "query": "eu ai act",
        "query_used": "eu ai act",
        "provider": "exa",
        "results": [
            {
                "title": "The Act",
                "url": "https://a.example/act",
                "snippet": "What it\n  says.",
                "date": None,
                "last_updated": None,
                "score": 0.5,
                "published_date": "2024-05-02T09:30:00+00:00",
                "position": 1,
                "provider": "exa",
            }
        ],
        "dropped_options": ["language"],
        "from_cache": True,
        "cache_age_s": 42,
        "attempts": [
            {"provider": "tavily", "outcome": "skipped", "status": None},
            {"provider": "exa", "outcome": "results", "status": 200},
        ],
    }
    text = render_text(answer)
    assert (
        "1. The Act\n   https://a.example/act\n   What it says.\n   Published: 2024-05-02" in text
    )
    assert "Answered by exa from the proxy's cache (42 s old), after tavily (skipped)." in text
    assert "exa could not apply language: its results are not filtered by them." in text
    nothing = {**answer, "results": [], "provider": None, "dropped_options": []}
    nothing["attempts"] = [{"provider": "exa", "outcome": "empty", "status": 200}]
    assert render_text(nothing).splitlines() == [
        'No results found for "eu ai act". Try fewer or different words.',
        "Providers asked: exa (no results).",
    ]


# ---------------------------------------------------------------------------------------------
# Access


def machine_address() -> str | None:
    """This machine's own address off loopback (the one its default route uses), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))  # UDP: no packet is sent, only a route chosen
        except OSError:
            return None
        address: str = s.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.fixture
def remote_address() -> str:
    address = machine_address()
    # A machine that installs packages has a route off loopback; the rule alone is also
    # unit-tested below (test_the_access_rule) for peers no machine can be at once.
    assert address is not None, "no address off loopback to be a remote peer from"
    return address


async def serve_at(aiohttp_server: Any, raw: dict[str, Any], host: str) -> str:
    server = await aiohttp_server(build_app(parse_config(raw, {})), host=host)
    return f"http://{host}:{server.port}/mcp"


@pytest.mark.parametrize(
    ("content_type", "taken"),
    [
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
        ("Application/JSON", False),  # the package's 415
        ("application/json-seq", False),  # the package's 415
        ("text/plain, application/json", False),  # the package's 400 (not its first)
        ("application/json; charset=utf-8", True),
        ("application/json, text/plain", True),
        ("application/json ,", True),
    ],
)
async def test_a_body_the_package_would_not_take_is_refused_in_the_proxys_shape(
    proxy: Any, content_type: str, taken: bool
) -> None:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": content_type}
    ping = b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}'
    r = await proxy.post("/mcp", data=ping, headers=headers)
    if taken:
        assert r.status == 200 and (await r.json())["result"] == {}
        return
    assert r.status == 415 and r.headers["X-Proxy-Error"] == "unsupported_media_type"
    error = (await r.json())["error"]  # the mcp package's own answer is plain text
    assert "Content-Type: application/json" in error["message"]
    assert repr(content_type) in error["message"]


def test_the_content_types_taken_are_the_mcp_packages() -> None:
    """`takes_json` against the installed package's own two checks: any type it takes, the
    proxy passes on; any it refuses in plain text, the proxy refuses in its JSON shape. The
    same bytes reach the proxy as aiohttp decodes them and the package as Starlette does."""
    security = TransportSecurityMiddleware()
    transport = StreamableHTTPServerTransport(mcp_session_id=None)

    class Request:
        def __init__(self, content_type: str) -> None:
            self.headers = {"content-type": content_type}

    values = [
        b"application/json",
        b"application/json; charset=utf-8",
        b"application/json;charset=UTF-8",
        b"application/json, text/plain",
        b"application/json ,",
        b"application/json\xa0",  # Latin-1's no-break space: space to the package
        b"APPLICATION/JSON",
        b"application/JSON",
        b"application/jsonx",
        b"application/json-seq",
        b"application/jsonl, application/json",
        b"text/plain, application/json",
        b"text/plain",
        b"",
        b"application/json\xc2\xa0",  # UTF-8's no-break space: not space to the package
        b"application/json\xe2\x80\x83",  # UTF-8's em space
        b"application/json\xff",
    ]
    for raw in values:
        seen = raw.decode("latin-1")  # as Starlette reads the header
        package = security._validate_content_type(seen) and transport._check_content_type(
            Request(seen)  # type: ignore[arg-type]
        )
        assert takes_json(raw.decode("utf-8", "surrogateescape")) == package, raw
    taken = [v for v in values if takes_json(v.decode("utf-8", "surrogateescape"))]
    assert taken == values[:6] + values[10:11]


async def test_a_remote_peer_is_refused_unless_allow_remote(
    vendor: FakeVendor, aiohttp_server: Any, remote_address: str
) -> None:
    raw = providers(f"{vendor.url}/tavily", f"{vendor.url}/brave")
    url = await serve_at(aiohttp_server, raw, remote_address)  # we connect from that address
    async with httpx.AsyncClient(trust_env=False) as http:
        r = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert r.status_code == 403
    assert r.headers["X-Proxy-Error"] == "forbidden"
    error = r.json()["error"]
    assert error["type"] == "forbidden"
    assert f"this request came from {remote_address}" in error["message"]
    assert "mcp_server.allow_remote: true" in error["message"]
    with pytest.raises(BaseExceptionGroup) as refused:  # from the client's task group
        async with session(url):
            pass
    assert status_error(refused.value).response.status_code == 403

    raw["mcp_server"] = {"allow_remote": True}
    url = await serve_at(aiohttp_server, raw, remote_address)
    async with session(url) as mcp:
        result = await mcp.call_tool(TOOL_NAME, {"query": QUERY})
    assert result.isError is False and result.structuredContent is not None


async def test_with_clients_a_known_token_is_required_and_names_the_caller(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    raw = providers(
        f"{vendor.url}/tavily",
        f"{vendor.url}/brave",
        clients={"agent": {"token": TOKEN, "daily_requests": 1}},
    )
    proxy = await start_proxy(raw)
    for headers in ({}, {"Authorization": "Bearer not-the-token-of-anyone-here"}):
        ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        r = await proxy.post("/mcp", json=ping, headers=headers)
        assert r.status == 401
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert (await r.json())["error"]["type"] == "unauthorized"
    with structlog.testing.capture_logs() as logs:
        async with session(mcp_url(proxy), TOKEN) as mcp:
            tools = await mcp.list_tools()  # initialize and list_tools spend no quota
            first = await mcp.call_tool(TOOL_NAME, {"query": QUERY})
            second = await mcp.call_tool(TOOL_NAME, {"query": QUERY})
    assert [t.name for t in tools.tools] == [TOOL_NAME, "fetch_page"]
    assert first.isError is False
    assert second.isError is True
    assert text_of(second).startswith("client 'agent' has used its daily quota of 1 requests")
    assert vendor.count() == 1
    assert "Authorization" not in vendor.last.headers or TOKEN not in str(vendor.last.headers)
    lines = [e for e in logs if e["event"] == "request" and e["route"] == "mcp"]
    assert [e["rpc"] for e in lines] == [
        "initialize",
        "notifications/initialized",
        "tools/list",
        "tools/call",
        "tools/call",
    ]
    assert lines[3]["tool"] == TOOL_NAME and lines[3]["providers"] == ["tavily"]
    assert lines[3]["attempts"] == 1 and lines[3]["error"] is None
    assert lines[4]["error"] == "quota_exceeded"
    assert TOKEN not in repr(logs)


async def test_a_rebound_host_or_a_foreign_page_is_refused_on_loopback(proxy: Any) -> None:
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    r = await proxy.post("/mcp", json=ping, headers={"Host": "attacker.example:8080"})
    assert r.status == 403
    assert "names host 'attacker.example'" in (await r.json())["error"]["message"]
    r = await proxy.post("/mcp", json=ping, headers={"Origin": "https://attacker.example"})
    assert r.status == 403
    assert "browser pages from other sites" in (await r.json())["error"]["message"]
    accept = {"Accept": "application/json, text/event-stream"}
    r = await proxy.post("/mcp", json=ping, headers={"Origin": "http://localhost:6274", **accept})
    assert r.status == 200 and (await r.json())["result"] == {}


def test_the_access_rule() -> None:
    """`refusal` alone, for peers a test machine cannot always be (IPv6, IPv4-mapped)."""
    local = McpServerConfig()
    remote = McpServerConfig(allow_remote=True)
    at = {"host": "127.0.0.1:8080", "origin": None, "tokens": False}

    def refused(config: McpServerConfig, remote_ip: str, **kw: Any) -> str | None:
        err = refusal(config, remote=remote_ip, **{**at, **kw})
        return None if err is None else err.message

    for peer in ("127.0.0.1", "127.8.0.1", "::1", "::ffff:127.0.0.1"):
        assert refused(local, peer) is None, peer
    assert refused(local, "::1", host="[::1]:8080") is None
    assert refused(local, "::1", host="localhost") is None
    for peer in ("10.0.0.5", "::ffff:10.0.0.5", "2001:db8::1", ""):
        assert "serves this machine only" in (refused(local, peer) or ""), peer
        assert refused(remote, peer, host="search-proxy.svc:8080") is None
        assert refused(local, peer, tokens=True) is None  # the token is checked next
    assert "names host 'evil.example'" in (refused(local, "127.0.0.1", host="evil.example") or "")
    for origin in ("https://evil.example", "null", "http://127.0.0.1.evil.example:80"):
        for config in (local, remote):
            assert "browser pages" in (refused(config, "127.0.0.1", origin=origin) or "")
        assert refused(local, "127.0.0.1", origin=origin, tokens=True) is not None
    assert refused(local, "127.0.0.1", origin="http://[::1]:5173") is None


async def test_other_methods_get_405_and_a_large_body_413(
    start_proxy: Any, vendor: FakeVendor
) -> None:
    raw = providers(f"{vendor.url}/tavily", f"{vendor.url}/brave")
    raw["server"] = {"max_body_bytes": "1KiB"}
    proxy = await start_proxy(raw)
    for method in ("GET", "DELETE", "PUT"):
        r = await proxy.request(method, "/mcp")
        assert r.status == 405 and r.headers["Allow"] == "POST"
        assert "send JSON-RPC messages with POST" in (await r.json())["error"]["message"]
    big = {"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"pad": "x" * 2000}}
    r = await proxy.post("/mcp", json=big)
    assert r.status == 413 and (await r.json())["error"]["type"] == "body_too_large"
    r = await proxy.post(
        "/mcp/",
        json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
        headers={"Accept": "application/json"},
    )
    assert r.status == 200  # the trailing-slash form some clients write


async def test_off_without_search_providers_and_says_how_to_turn_it_on(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    proxy = await start_proxy({"routes": {"plain": route(vendor.url, "/plain")}})
    r = await proxy.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert r.status == 404
    message = (await r.json())["error"]["message"]
    assert "MCP server is off" in message and "a route with a search section" in message


async def test_a_custom_path(vendor: FakeVendor, start_proxy: Any) -> None:
    raw = providers(f"{vendor.url}/tavily", f"{vendor.url}/brave", mcp_server={"path": "/tools"})
    proxy = await start_proxy(raw)
    async with session(str(proxy.make_url("/tools"))) as mcp:
        result = await mcp.call_tool(TOOL_NAME, {"query": QUERY})
    assert result.isError is False
    r = await proxy.post("/mcp", json={})  # not served there: no route prefix matches
    assert r.status == 404 and (await r.json())["error"]["type"] == "no_route"


# ---------------------------------------------------------------------------------------------
# Config


def test_mcp_server_defaults_and_round_trip() -> None:
    with_search = providers("http://a.example", "http://b.example")
    config = parse_config(with_search, {})
    assert config.mcp_server == McpServerConfig(enabled=True, path="/mcp", allow_remote=False)
    assert parse_config(as_document(config), {}) == config
    plain = parse_config({"routes": {"p": route("http://a.example", "/p")}}, {})
    assert plain.mcp_server.enabled is False
    assert parse_config(as_document(plain), {}) == plain
    custom = parse_config({**with_search, "mcp_server": {"path": "/agents/mcp"}}, {})
    assert custom.mcp_server.path == "/agents/mcp"
    # Off, a route may have the path.
    taken = {"routes": {"m": route("http://a.example", "/mcp", search={"vendor": "tavily"})}}
    off = parse_config({**taken, "mcp_server": {"enabled": False}}, {})
    assert off.mcp_server.enabled is False


@pytest.mark.parametrize(
    ("section", "path", "reason"),
    [
        ("yes", "mcp_server", "expected a mapping"),
        ({"enabled": "sometimes"}, "mcp_server.enabled", "expected true or false"),
        ({"allow_remote": 1}, "mcp_server.allow_remote", "expected true or false"),
        ({"path": "mcp"}, "mcp_server.path", "expected a path like /mcp"),
        ({"path": "/mcp/"}, "mcp_server.path", "expected a path like /mcp"),
        ({"path": "/"}, "mcp_server.path", "expected a path like /mcp"),
        ({"path": 5}, "mcp_server.path", "expected a non-empty string"),
        ({"path": "/v1"}, "mcp_server.path", "is under /v1"),
        ({"path": "/v1/mcp"}, "mcp_server.path", "is under /v1"),
        ({"path": "/admin/mcp"}, "mcp_server.path", "collides with the proxy's own /admin"),
        ({"path": "/healthz"}, "mcp_server.path", "collides with the proxy's own /healthz"),
        ({"path": "/metrics"}, "mcp_server.path", "collides with the proxy's own /metrics"),
        ({"path": "/a b"}, "mcp_server.path", "cannot appear in a path prefix"),
        ({"path": "/tavily"}, "mcp_server.path", "collides with routes.tavily.prefix"),
        ({"path": "/brave/mcp"}, "mcp_server.path", "collides with routes.brave.prefix"),
        ({"call_timeout": "0s"}, "mcp_server.call_timeout", "above 0 and at most 600s"),
        ({"call_timeout": "1h"}, "mcp_server.call_timeout", "above 0 and at most 600s"),
        (
            {"port": 8090},
            "mcp_server.port",
            "unknown key (allowed: enabled, path, allow_remote, call_timeout)",
        ),
    ],
)
def test_bad_mcp_server_values_name_the_yaml_path(section: Any, path: str, reason: str) -> None:
    raw = providers("http://a.example", "http://b.example", mcp_server=section)
    with pytest.raises(ConfigErrors) as caught:
        parse_config(raw, {})
    assert [e.path for e in caught.value.errors] == [path]
    assert reason in caught.value.errors[0].reason


def test_a_route_at_the_default_path_or_nothing_to_search_are_errors() -> None:
    taken = {"routes": {"m": route("http://a.example", "/mcp/tavily", search={"vendor": "tavily"})}}
    with pytest.raises(ConfigErrors) as caught:
        parse_config(taken, {})
    assert str(caught.value) == (
        "mcp_server.path: '/mcp' collides with routes.m.prefix ('/mcp/tavily'): set "
        "mcp_server.path to another path, or mcp_server.enabled: false"
    )
    plain = {"routes": {"p": route("http://a.example", "/p")}, "mcp_server": {"enabled": True}}
    with pytest.raises(ConfigErrors) as caught:
        parse_config(plain, {})
    assert caught.value.path == "mcp_server.enabled"
    assert "needs a search provider" in caught.value.reason

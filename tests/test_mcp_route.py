"""MCP routes end to end: the official mcp client -> the proxy -> a FastMCP server on loopback
that speaks like Tavily's remote MCP server (testkit/fakemcp.py), all real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import aiohttp
import httpx
import pytest
import structlog
from aiohttp import web
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import McpError
from mcp.types import CallToolResult, TextContent
from yarl import URL

from policies.core.clock import ManualClock
from policies.core.memory import parse_cost
from policies.mcp.offline import MAX_CARD_BYTES
from proxy.app import STATE
from testkit.fakemcp import FakeMcp, serve_fake_mcp
from testkit.waiting import eventually
from tests.conftest import route

Start = Callable[..., Awaitable[Any]]


@pytest.fixture
async def fake() -> AsyncIterator[FakeMcp]:
    server = FakeMcp()
    async with serve_fake_mcp(server):
        yield server


def mcp_route(fake: FakeMcp, **policies: Any) -> dict[str, Any]:
    origin = str(URL(fake.url).origin())
    body = route(origin, "/tmcp", **{"mcp": {"server": "tavily"}, **policies})
    body["timeouts"] = policies.get(
        "timeouts", {"connect": "1s", "per_try": "2s", "idle": "5s", "total": "10s"}
    )
    return {"routes": {"tmcp": body}}


async def start(start_proxy: Start, fake: FakeMcp, clock: Any = None, **policies: Any) -> str:
    proxy = await start_proxy(mcp_route(fake, **policies), clock=clock)
    return str(proxy.make_url("/tmcp/mcp"))


@asynccontextmanager
async def connect(
    url: str, token: str | None = None, headers: dict[str, str] | None = None
) -> AsyncIterator[tuple[ClientSession, Any]]:
    """An initialized official MCP client session; a hang becomes a timeout error."""
    headers = dict(headers or {})
    if token:
        headers["Authorization"] = f"Bearer {token}"
    async with (
        httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(30, read=300)) as http,
        streamable_http_client(url, http_client=http) as (read, write, session_id),
        ClientSession(read, write, read_timeout_seconds=timedelta(seconds=15)) as session,
    ):
        await session.initialize()
        yield session, session_id


def session_headers(session_id: str) -> dict[str, str]:
    """What an MCP client sends with a request of its session, for raw requests in it."""
    return {
        "Mcp-Session-Id": session_id,
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-06-18",
    }


def results_of(result: CallToolResult) -> list[dict[str, Any]]:
    assert not result.isError, result.content
    first = result.content[0]
    assert isinstance(first, TextContent)
    found: list[dict[str, Any]] = json.loads(first.text)["results"]
    return found


def text_of(result: CallToolResult) -> str:
    first = result.content[0]
    assert isinstance(first, TextContent)
    return first.text


async def test_initialize_list_and_parallel_tool_calls(start_proxy: Start, fake: FakeMcp) -> None:
    url = await start(start_proxy, fake, cache={"ttl": "60s"})
    async with connect(url) as (session, _):
        tools = await session.list_tools()
        assert {t.name for t in tools.tools} == {"tavily_search", "tavily_extract"}
        queries = [f"topic number {i}" for i in range(10)]
        answers = await asyncio.gather(
            *(session.call_tool("tavily_search", {"query": q}) for q in queries)
        )
    for query, answer in zip(queries, answers, strict=True):
        found = results_of(answer)  # each call got its own answer, under its own id
        assert found and all("topic-number" in r["url"] for r in found)
        assert json.loads(text_of(answer))["query"] == query
    assert sorted(c.arguments["query"] for c in fake.calls) == sorted(queries)
    # Every attempt went upstream under an id of the proxy's own, each a different one.
    ids = [c.request_id for c in fake.calls]
    assert all(isinstance(i, str) and i.startswith("sp-") for i in ids) and len(set(ids)) == 10


async def test_progress_arrives_live(start_proxy: Start, fake: FakeMcp) -> None:
    fake.progress_gaps = [0.3, 0.3, 0.3]
    url = await start(start_proxy, fake, cache={"ttl": "60s"}, retry={"attempts": 2})
    received: list[float] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        received.append(time.monotonic())

    async with connect(url) as (session, _):
        answer = await session.call_tool(
            "tavily_search", {"query": "live progress"}, progress_callback=on_progress
        )
    assert results_of(answer)
    sent = [p.at for p in fake.progress]
    assert len(received) == len(sent) == 3
    lags = [got - at for got, at in zip(received, sent, strict=True)]
    assert all(0 <= lag < 0.1 for lag in lags), lags  # relayed as sent, not at the end


@pytest.mark.parametrize("tool", ["tavily_search", "tavily_extract"])
async def test_a_call_silent_for_twice_per_try_completes(
    start_proxy: Start, fake: FakeMcp, tool: str
) -> None:
    """per_try bounds the wait for the answer to start; the silence inside it is idle's."""
    fake.silent = 1.0
    timeouts = {"connect": "1s", "per_try": "500ms", "idle": "3s", "total": "10s"}
    # tavily_extract is left out of idempotent_tools here: it passes straight through.
    url = await start(
        start_proxy,
        fake,
        timeouts=timeouts,
        mcp={"server": "tavily", "idempotent_tools": ["tavily_search"]},
    )
    arguments = {"query": "slow one"} if tool == "tavily_search" else {"urls": ["https://a.b/"]}
    async with connect(url) as (session, _):
        started = time.monotonic()
        answer = await session.call_tool(tool, arguments)
    assert not answer.isError and text_of(answer).startswith("{")
    assert time.monotonic() - started >= 1.0
    assert len(fake.calls) == 1  # not cut and retried


async def test_a_stream_silent_past_idle_ends_with_the_proxys_message(
    start_proxy: Start, fake: FakeMcp
) -> None:
    fake.progress_gaps = [0.1]
    fake.silent = 2.0
    timeouts = {"connect": "1s", "per_try": "1s", "idle": "500ms", "total": "10s"}
    url = await start(start_proxy, fake, timeouts=timeouts)
    async with connect(url) as (session, _):
        answer = await session.call_tool(
            "tavily_search", {"query": "never ends"}, progress_callback=_ignore
        )
        assert answer.isError  # a tool error the LLM reads, not a hang
        assert "timeouts.idle" in text_of(answer)
        # The session survives: the next call works.
        fake.silent = 0
        assert results_of(await session.call_tool("tavily_search", {"query": "next"}))


async def test_passthrough_request_cut_mid_stream_gets_a_jsonrpc_error(
    start_proxy: Start, fake: FakeMcp
) -> None:
    fake.progress_gaps = [0.1]
    fake.silent = 2.0
    timeouts = {"connect": "1s", "per_try": "1s", "idle": "500ms", "total": "10s"}
    url = await start(
        start_proxy, fake, timeouts=timeouts, mcp={"server": "tavily", "idempotent_tools": []}
    )
    async with connect(url) as (session, _):
        with pytest.raises(McpError, match=r"timeouts\.idle"):
            await session.call_tool("tavily_search", {"query": "q"}, progress_callback=_ignore)


async def _ignore(progress: float, total: float | None, message: str | None) -> None:
    return None


async def test_sessions_stay_apart_and_delete_closes(start_proxy: Start, fake: FakeMcp) -> None:
    url = await start(start_proxy, fake, cache={"ttl": "60s"})
    async with connect(url, "key-a") as (a, a_id):
        async with connect(url, "key-b") as (b, b_id):
            assert a_id() and b_id() and a_id() != b_id()
            assert fake.initializes == 2  # no initialize came from the cache
            await a.call_tool("tavily_search", {"query": "shared words"})
            await b.call_tool("tavily_search", {"query": "shared words"})
            assert len(fake.calls) == 2  # another key: never the other caller's entry
            assert {c.session_id for c in fake.calls} == {a_id(), b_id()}
        gone = b_id()
        assert fake.deletes == 1
        assert results_of(await a.call_tool("tavily_search", {"query": "still here"}))
    assert fake.deletes == 2
    # The deleted session is gone upstream, and the proxy says so as the server did.
    async with httpx.AsyncClient() as http:
        answer = await http.post(
            url,
            json={"jsonrpc": "2.0", "id": 9, "method": "tools/list"},
            headers={"Mcp-Session-Id": gone, "Accept": "application/json, text/event-stream"},
        )
    assert answer.status_code == 404


async def test_cached_result_replayed_under_each_callers_id(
    start_proxy: Start, fake: FakeMcp
) -> None:
    url = await start(start_proxy, fake, cache={"ttl": "60s"})
    async with connect(url, "key-a") as (first, _):
        await first.list_tools()  # a few requests, so the ids of the two sessions differ
        original = await first.call_tool("tavily_search", {"query": "cache me"})
    async with connect(url, "key-a") as (second, _):
        again = await second.call_tool("tavily_search", {"query": "cache me"})
        extract = await second.call_tool("tavily_extract", {"urls": ["https://a.b/"]})
    assert len(fake.calls) == 2  # the search once, the extract once
    assert text_of(again) == text_of(original)
    assert "a.b" in text_of(extract)  # another tool, another entry


async def test_transient_failures_are_retried(start_proxy: Start, fake: FakeMcp) -> None:
    """30% of tool calls fail transiently (HTTP 503, JSON-RPC -32603, a tool error saying
    "temporarily unavailable"); 10 agents in parallel still get >= 97% answered."""
    fake.fail_rate, fake.fail_mode = 0.3, "mixed"
    retry = {
        "attempts": 4,
        "on": ["5xx", "429", "timeout", "connect_error", "reset"],
        "backoff": {"initial": "10ms", "max": "50ms"},
        "budget": {"ratio": 1.0, "min_per_s": 50},  # the default budget would shed retries
    }
    url = await start(start_proxy, fake, retry=retry)

    async def agent(n: int) -> int:
        ok = 0
        async with connect(url) as (session, _):
            for i in range(10):
                try:
                    answer = await session.call_tool("tavily_search", {"query": f"agent {n} q {i}"})
                except McpError:
                    # Every attempt failed and the last was the server's own JSON-RPC error,
                    # passed on as it came: the client raises it. Not answered, as a tool error
                    # would not be.
                    continue
                ok += not answer.isError and bool(results_of(answer))
        return ok

    answered = sum(await asyncio.gather(*(agent(n) for n in range(10))))
    assert fake.failures >= 20  # the faults happened
    assert answered >= 97, f"{answered}/100 answered"


async def test_the_log_line_names_the_tool_and_the_error(start_proxy: Start, fake: FakeMcp) -> None:
    fake.fail_rate, fake.fail_mode = 1.0, "http_503"
    url = await start(start_proxy, fake, retry={"attempts": 2, "backoff": {"initial": "10ms"}})
    async with connect(url) as (session, _):
        with structlog.testing.capture_logs() as logs:
            answer = await session.call_tool("tavily_search", {"query": "q"})
    assert answer.isError
    [line] = [e for e in logs if e.get("rpc") == "tools/call tavily_search"]
    assert line["status"] == 200 and line["error"] == "upstream_invalid_response"
    assert line["attempts"] == 2 and line["retries"] == ["5xx"]


async def test_a_failure_that_is_not_transient_reaches_the_agent(
    start_proxy: Start, fake: FakeMcp
) -> None:
    fake.fail_first, fake.fail_mode = 1, "tool_error"
    url = await start(
        start_proxy,
        fake,
        retry={"attempts": 3},
        mcp={"server": "tavily", "transient_tool_errors": ["something else"]},
    )
    async with connect(url) as (session, _):
        answer = await session.call_tool("tavily_search", {"query": "q"})
    assert answer.isError and "temporarily unavailable" in text_of(answer)
    assert len(fake.calls) == 1  # the config says this error is final: no retry


async def test_stale_answers_when_the_server_is_down(start_proxy: Start, fake: FakeMcp) -> None:
    clock = ManualClock()
    url = await start(
        start_proxy,
        fake,
        clock=clock,
        cache={"ttl": "1m", "stale_ttl": "1h"},
        retry={"attempts": 2},
    )
    async with connect(url) as (session, _):
        warm = await session.call_tool("tavily_search", {"query": "remember this"})
        fake.fail_rate, fake.fail_mode = 1.0, "http_503"  # the server fails every tool call
        clock.advance(120)  # past ttl, inside stale_ttl
        stale = [await session.call_tool("tavily_search", {"query": "remember this"}) for _ in "ab"]
        fresh_failure = await session.call_tool("tavily_search", {"query": "never seen"})
    assert all(text_of(s) == text_of(warm) for s in stale)
    assert all((s.meta or {}).get("search-proxy/cache") == "stale" for s in stale)
    assert not (warm.meta or {}).get("search-proxy/cache")
    assert fresh_failure.isError and "503" in text_of(fresh_failure)
    meta = fresh_failure.meta or {}
    assert meta.get("search-proxy/error", {}).get("attempts") == 2


async def test_server_down_initialize_is_a_jsonrpc_error(start_proxy: Start, fake: FakeMcp) -> None:
    url = await start(start_proxy, fake)
    await fake.stop()
    async with (
        streamable_http_client(url) as (read, write, _),
        ClientSession(read, write, read_timeout_seconds=timedelta(seconds=10)) as session,
    ):
        with pytest.raises(McpError, match="cannot connect"):
            await session.initialize()


async def test_empty_search_is_retried_with_a_simpler_query(
    start_proxy: Start, fake: FakeMcp
) -> None:
    fake.empty_over_words = 3
    url = await start(start_proxy, fake)
    async with connect(url) as (session, _):
        answer = await session.call_tool(
            "tavily_search", {"query": "what is the latest stable python asyncio release"}
        )
    assert results_of(answer)
    sent = [c.arguments["query"] for c in fake.calls]
    assert len(sent) >= 2 and len(sent[-1].split()) <= 3
    assert sent[0] == "what is the latest stable python asyncio release"
    assert (answer.meta or {})["search-proxy/query_used"] == sent[-1]  # the agent can see it


async def test_shipped_tavily_mcp_route_as_the_readme_points_at_it(aiohttp_client: Any) -> None:
    """config.yaml's tavily-mcp route with only its origin swapped, used as README shows:
    the key from TAVILY_API_KEY reaches the server, the agent's never needs to."""
    import dataclasses
    from types import MappingProxyType

    from proxy.app import build_app
    from tests.test_shipped_config import SHIPPED, load_config

    server = FakeMcp(path="/mcp/", api_key="tvly-proxy-key", empty_over_words=4)
    async with serve_fake_mcp(server) as endpoint:
        config = load_config(SHIPPED, env={"TAVILY_API_KEY": "tvly-proxy-key"})
        routes = dict(config.routes)
        origin = str(URL(endpoint).origin())
        routes["tavily-mcp"] = dataclasses.replace(routes["tavily-mcp"], upstream=origin)
        config = dataclasses.replace(config, routes=MappingProxyType(routes))
        proxy = await aiohttp_client(build_app(config))
        url = str(proxy.make_url("/tavily-mcp/mcp/"))
        async with connect(url) as (session, _):  # no key of the agent's own
            answer = await session.call_tool(
                "tavily_search", {"query": "how do I stream responses with aiohttp web"}
            )
            again = await session.call_tool(
                "tavily_search", {"query": "how do I stream responses with aiohttp web"}
            )
    assert results_of(answer) and text_of(again) == text_of(answer)
    assert {c.authorization for c in server.calls} == {"Bearer tvly-proxy-key"}
    queries = [c.arguments["query"] for c in server.calls]
    assert len(queries) == 2 and len(queries[1].split()) <= 4  # simplified once, then cached


async def test_parallel_calls_with_one_x_request_id_keep_their_own_answers(
    start_proxy: Start, fake: FakeMcp
) -> None:
    """The agent's X-Request-Id names its requests in our logs, never the upstream's ids."""
    fake.silent = 0.2  # all three in flight together
    url = await start(start_proxy, fake, cache={"ttl": "60s"})
    async with connect(url, headers={"X-Request-Id": "trace-abc123"}) as (session, _):
        queries = ["alpha one", "bravo two", "charlie three"]
        answers = await asyncio.gather(
            *(session.call_tool("tavily_search", {"query": q}) for q in queries)
        )
        again = await session.call_tool("tavily_search", {"query": "charlie three"})
    for query, answer in zip(queries, answers, strict=True):
        assert json.loads(text_of(answer))["query"] == query
    assert json.loads(text_of(again))["query"] == "charlie three"  # the right entry cached


async def test_odd_tool_names_and_task_calls_pass_through(
    start_proxy: Start, fake: FakeMcp
) -> None:
    url = await start(start_proxy, fake, cache={"ttl": "60s"})
    async with connect(url) as (_, session_id):
        headers = session_headers(session_id())
        async with httpx.AsyncClient(timeout=10) as http:
            odd = await http.post(
                url,
                headers=headers,
                json={"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": ["x"]}},
            )
            tasked = [
                await http.post(
                    url,
                    headers=headers,
                    json={
                        "jsonrpc": "2.0",
                        "id": 8 + i,
                        "method": "tools/call",
                        "params": {
                            "name": "tavily_search",
                            "arguments": {"query": "q"},
                            "task": {},
                        },
                    },
                )
                for i in range(2)
            ]
    assert odd.status_code < 500 and "X-Proxy-Error" not in odd.headers  # the server's answer
    assert all(t.status_code == 200 for t in tasked)
    # A call with more than name and arguments is never cached: both reached the server.
    assert [c.tool for c in fake.calls].count("tavily_search") == 2


async def test_a_streamed_tool_call_that_fails_is_logged_with_its_error(
    start_proxy: Start, fake: FakeMcp
) -> None:
    fake.progress_gaps = [0.1]
    fake.silent = 2.0
    timeouts = {"connect": "1s", "per_try": "1s", "idle": "500ms", "total": "10s"}
    url = await start(start_proxy, fake, timeouts=timeouts)
    async with connect(url) as (session, _):
        with structlog.testing.capture_logs() as logs:
            answer = await session.call_tool(
                "tavily_search", {"query": "q"}, progress_callback=_ignore
            )
    assert answer.isError
    [line] = [e for e in logs if e.get("rpc") == "tools/call tavily_search"]
    assert line["status"] == 200 and line["error"] == "upstream_timeout"


async def test_a_cancelled_call_is_cancelled_upstream_too(
    start_proxy: Start, fake: FakeMcp
) -> None:
    """notifications/cancelled names the agent's id; the server knows the call by ours."""
    fake.silent = 5.0
    url = await start(
        start_proxy, fake, timeouts={"connect": "1s", "per_try": "2s", "total": "10s"}
    )
    async with connect(url) as (_, session_id):
        headers = session_headers(session_id())
        call = {
            "jsonrpc": "2.0",
            "id": 41,
            "method": "tools/call",
            "params": {"name": "tavily_search", "arguments": {"query": "slow"}},
        }
        cancel = {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": 41, "reason": "the user moved on"},
        }
        async with httpx.AsyncClient(timeout=10) as http:
            pending = asyncio.create_task(http.post(url, headers=headers, json=call))
            await eventually(lambda: len(fake.calls) == 1)
            started = time.monotonic()
            sent = await http.post(url, headers=headers, json=cancel)
            answer = await pending
    assert sent.status_code == 202
    assert time.monotonic() - started < 2  # not the 5 s the tool would take
    body = answer.text
    assert "cancelled" in body and '"id":41' in body.replace(" ", "")
    assert fake.cancelled == [fake.calls[0].request_id]  # the server got it under our id


async def test_an_agent_leaving_before_the_answer_begins_stops_the_call(
    aiohttp_client: Any,
) -> None:
    """Served as the process serves it (handler_cancellation off): a tool call whose agent
    went away is not run to its end (up to timeouts.total) for nobody."""
    from proxy.app import build_app
    from proxy.config import parse_config
    from tests.test_streams import ServedAs

    server = FakeMcp(json_response=True, silent=4.0)  # the answer begins only at the end
    async with serve_fake_mcp(server):
        raw = mcp_route(server, timeouts={"connect": "1s", "per_try": "8s", "total": "10s"})
        config = parse_config(raw, {})
        proxy = await aiohttp_client(ServedAs(build_app(config), "guarded", config.server))
        url = str(proxy.make_url("/tmcp/mcp"))
        async with connect(url) as (_, session_id):
            headers = session_headers(session_id())
            call = {
                "jsonrpc": "2.0",
                "id": 5,
                "method": "tools/call",
                "params": {"name": "tavily_search", "arguments": {"query": "gone"}},
            }
            with structlog.testing.capture_logs() as logs:
                async with httpx.AsyncClient(timeout=0.5) as http:
                    with pytest.raises(httpx.ReadTimeout):
                        await http.post(url, headers=headers, json=call)
                await eventually(
                    lambda: any(e.get("rpc") == "tools/call tavily_search" for e in logs)
                )
    [line] = [e for e in logs if e.get("rpc") == "tools/call tavily_search"]
    assert line["status"] == 499 and line["cut"] == "client_gone"
    assert line["duration_ms"] < 2500  # noticed within about a second, not after 4 s


async def test_a_passthrough_stream_cut_inside_an_event_still_answers_the_request(
    aiohttp_server: Any, start_proxy: Start
) -> None:
    """The upstream stops mid-event: the agent's client drops the unfinished event (a blank
    line ends it) and gets the JSON-RPC error for its request, rather than waiting for ever."""
    from aiohttp import web

    from policies.mcp import SseParser

    async def half_an_event(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/')
        await asyncio.Event().wait()  # silent until the test ends
        return response

    app = web.Application()
    app.router.add_post("/mcp", half_an_event)
    upstream = await aiohttp_server(app)
    raw = {
        "routes": {
            "tmcp": route(
                str(upstream.make_url("")).rstrip("/"),
                "/tmcp",
                timeouts={"connect": "1s", "per_try": "1s", "idle": "300ms", "total": "5s"},
                mcp={"idempotent_tools": []},
            )
        }
    }
    proxy = await start_proxy(raw)
    call = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "anything"}}
    async with proxy.post("/tmcp/mcp", json=call) as answer:
        body = b""
        with contextlib.suppress(aiohttp.ClientPayloadError):
            async for chunk in answer.content.iter_any():
                body += chunk
    events = SseParser().feed(body)
    last = json.loads(events[-1])
    assert last["id"] == 3 and "timeouts.idle" in last["error"]["message"]
    with pytest.raises(ValueError):
        json.loads(events[0])  # the unfinished event, ended: a client drops it


async def test_stale_answers_when_the_server_is_gone(start_proxy: Start, fake: FakeMcp) -> None:
    """The server stops (connections refused) after the cache was warmed: the agent's session
    goes on, and its repeated tool calls are answered stale."""
    clock = ManualClock()
    url = await start(
        start_proxy,
        fake,
        clock=clock,
        cache={"ttl": "1m", "stale_ttl": "1h"},
        retry={"attempts": 2},
    )
    async with connect(url) as (session, _):
        warm = await session.call_tool("tavily_search", {"query": "remember this"})
        await fake.stop()
        clock.advance(120)
        again = [await session.call_tool("tavily_search", {"query": "remember this"}) for _ in "ab"]
        unknown = await session.call_tool("tavily_search", {"query": "never asked"})
    assert all(text_of(a) == text_of(warm) for a in again)
    assert all((a.meta or {}).get("search-proxy/cache") == "stale" for a in again)
    assert unknown.isError and "cannot connect" in text_of(unknown)


# --- a server answering with one event of many small values --------------------------------


def pad_server(pad: bytes, progress: bytes = b"", notes: int = 0) -> web.Application:
    """An MCP server whose every result, sent as one SSE event, carries `pad`, after `notes`
    progress notifications each carrying `progress`."""

    async def answer(request: web.Request) -> web.StreamResponse:
        message = json.loads(await request.read())
        if "id" not in message:
            return web.Response(status=202)
        sent = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await sent.prepare(request)
        note = b'{"jsonrpc": "2.0", "method": "notifications/progress", "params": {"pad": ['
        for _ in range(notes):
            await sent.write(b"event: message\ndata: " + note + progress + b"]}}\n\n")
        result = b'{"tools": [], "content": [{"type": "text", "text": "x"}], "pad": [' + pad
        ident = json.dumps(message["id"]).encode()
        await sent.write(b'event: message\ndata: {"jsonrpc": "2.0", "id": ' + ident + b", ")
        await sent.write(b'"result": ' + result + b"]}}\n\n")
        return sent

    app = web.Application()
    app.router.add_post("/mcp", answer)
    return app


async def post_mcp(client: Any, message: dict[str, Any]) -> bytes:
    headers = {"Accept": "application/json, text/event-stream"}
    async with client.post("/m/mcp", json=message, headers=headers) as r:
        assert r.status == 200
        return await r.read()


async def test_a_tools_list_too_large_for_the_card_passes_and_is_not_kept(
    start_proxy: Start, aiohttp_server: Any
) -> None:
    # What the route keeps of its server's answers for sessions it opens itself lives as long
    # as the route: one that would parse past MAX_CARD_BYTES passes to the agent, not kept.
    # 340 KB of tiny objects: some 6 MB parsed.
    pad = b",".join([b'{"kept_by_card": [1]}'] * 16_000)
    assert len(pad) < MAX_CARD_BYTES < len(pad) + parse_cost(b"[" + pad + b"]")
    server = await aiohttp_server(pad_server(pad))
    client = await start_proxy({"routes": {"m": route(str(server.make_url("")), "/m", mcp={})}})
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    assert pad in await post_mcp(client, listing)
    assert not [o for o in gc.get_objects() if type(o) is dict and "kept_by_card" in o]


async def test_a_tool_calls_event_too_costly_to_parse_is_a_tool_error(
    start_proxy: Start, aiohttp_server: Any
) -> None:
    # 2 MiB of empty objects in one event parse to some 50 MiB: charged like a buffered answer,
    # past the whole budget it is not read.
    server = await aiohttp_server(pad_server(b",".join([b"{}"] * (2 * 1024 * 1024 // 3))))
    config = {
        "server": {"max_buffered_bytes": "16MiB"},
        "routes": {"m": route(str(server.make_url("")), "/m", mcp={"idempotent_tools": ["s"]})},
    }
    client = await start_proxy(config)
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "s"}}
    answer = json.loads(await post_mcp(client, call))
    assert answer["id"] == 7 and answer["result"]["isError"] is True
    assert "server.max_buffered_bytes" in answer["result"]["content"][0]["text"]
    assert client.app[STATE].memory.used == 0


async def test_a_tool_calls_progress_events_are_charged_one_at_a_time(
    start_proxy: Start, aiohttp_client: Any, aiohttp_server: Any
) -> None:
    # 20 notifications of some 10 MiB each once parsed: each is let go once passed on, so
    # together they never pass the 32 MiB budget that all of them at once would.
    tiny = b",".join([b"{}"] * (300 * 1024 // 3))
    server = await aiohttp_server(pad_server(b"1", progress=tiny, notes=20))
    mcp = {"idempotent_tools": ["s"]}
    client = await start_proxy({"routes": {"m": route(str(server.make_url("")), "/m", mcp=mcp)}})
    call = {"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {"name": "s"}}
    answer = json.loads((await post_mcp(client, call)).split(b"data: ")[-1])
    assert answer["id"] == 8 and "isError" not in answer["result"], answer
    assert client.app[STATE].memory.used == 0

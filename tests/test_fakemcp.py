"""Tests of the fake remote search MCP server (testkit/fakemcp.py), with the official mcp client
and no proxy in between."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import McpError
from mcp.types import TextContent

from testkit.fakemcp import FAIL_MESSAGE, FakeMcp, serve_fake_mcp
from testkit.fakevendor import expected_urls
from testkit.procs import Child
from testkit.waiting import eventually

KEY = {"Authorization": "Bearer tvly-test"}
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@asynccontextmanager
async def session(url: str, headers: dict[str, str] | None = None) -> AsyncIterator[ClientSession]:
    """An initialized official-client session on ``url``."""
    timeout = httpx.Timeout(10, read=10)
    async with httpx.AsyncClient(headers=headers or KEY, timeout=timeout) as http:
        async with streamable_http_client(url, http_client=http) as (read, write, _):
            async with ClientSession(read, write) as s:
                await s.initialize()
                yield s


def text_of(result: Any) -> str:
    assert len(result.content) == 1
    content = result.content[0]
    assert isinstance(content, TextContent)
    return content.text


async def test_initialize_list_tools_and_session_records() -> None:
    fake = FakeMcp()
    async with serve_fake_mcp(fake) as url:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/mcp") and fake.url == url
        async with session(url) as s:
            tools = await s.list_tools()
            assert {t.name for t in tools.tools} == {"tavily_search", "tavily_extract"}
            await eventually(lambda: fake.gets == 1)  # the standalone GET stream
            assert fake.initializes == 1 and len(fake.session_ids) == 1 and fake.deletes == 0
        assert fake.deletes == 1  # the client's DELETE on leaving
    assert fake.url is None


async def test_search_answers_tavily_json_text_and_records_the_call() -> None:
    fake = FakeMcp()
    async with serve_fake_mcp(fake) as url, session(url) as s:
        result = await s.call_tool("tavily_search", {"query": "hello world", "max_results": 2})
        assert not result.isError and result.structuredContent is None
        body = json.loads(text_of(result))
        assert body["query"] == "hello world" and body["response_time"] == 0.01
        assert [r["url"] for r in body["results"]] == expected_urls("hello world", 2)
        assert set(body["results"][0]) == {"url", "title", "content", "score"}
        default = json.loads(text_of(await s.call_tool("tavily_search", {"query": "hello world"})))
        assert [r["url"] for r in default["results"]] == expected_urls("hello world")  # 3

        extract = await s.call_tool("tavily_extract", {"urls": ["https://a.example/x"]})
        raw = json.loads(text_of(extract))["results"]
        assert raw == [
            {"url": "https://a.example/x", "raw_content": "Content of https://a.example/x."}
        ]

    call = fake.calls[0]
    assert (call.tool, call.arguments) == (
        "tavily_search",
        {"query": "hello world", "max_results": 2},
    )
    assert call.request_id == 1 and call.status == 200 and call.failure is None
    assert call.authorization == "Bearer tvly-test" and call.session_id in fake.session_ids
    assert [c.tool for c in fake.calls] == ["tavily_search", "tavily_search", "tavily_extract"]


async def test_long_queries_get_empty_results() -> None:
    fake = FakeMcp(empty_over_words=3)
    async with serve_fake_mcp(fake) as url, session(url) as s:
        long = await s.call_tool("tavily_search", {"query": "what is the best search api"})
        assert json.loads(text_of(long))["results"] == []
        short = await s.call_tool("tavily_search", {"query": "best search api"})
        assert len(json.loads(text_of(short))["results"]) == 3


async def test_progress_arrives_live_then_silence() -> None:
    fake = FakeMcp(progress_gaps=[0.15, 0.15, 0.15], silent=0.3)
    received: list[tuple[float, float | None, float]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        received.append((progress, total, time.monotonic()))

    async with serve_fake_mcp(fake) as url, session(url) as s:
        start = time.monotonic()
        result = await s.call_tool("tavily_search", {"query": "q"}, progress_callback=on_progress)
        elapsed = time.monotonic() - start
    assert not result.isError and elapsed >= 0.75
    assert [(p, t) for p, t, _ in received] == [(1, 3), (2, 3), (3, 3)]
    assert [(p.request_id, p.progress, p.total) for p in fake.progress] == [
        (str(fake.calls[0].request_id), i, 3) for i in (1, 2, 3)
    ]
    for (_, _, got), sent in zip(received, fake.progress, strict=True):
        assert 0 <= got - sent.at < 0.1
    assert start + 0.75 <= received[-1][2] + 0.3 <= start + elapsed + 0.01  # silence after


async def test_fail_first_tool_error_is_an_error_result() -> None:
    fake = FakeMcp(fail_first=1, fail_mode="tool_error")
    async with serve_fake_mcp(fake) as url, session(url) as s:
        failed = await s.call_tool("tavily_search", {"query": "q"})
        assert failed.isError and "temporarily unavailable" in text_of(failed)
        assert not (await s.call_tool("tavily_search", {"query": "q"})).isError
    assert [(c.status, c.failure) for c in fake.calls] == [(200, "tool_error"), (200, None)]
    assert fake.failures == 1


async def test_fail_first_jsonrpc_error_raises_mcp_error_and_session_lives() -> None:
    fake = FakeMcp(fail_first=1, fail_mode="jsonrpc_error")
    async with serve_fake_mcp(fake) as url, session(url) as s:
        with pytest.raises(McpError) as raised:
            await s.call_tool("tavily_search", {"query": "q"})
        assert raised.value.error.code == -32603 and raised.value.error.message == FAIL_MESSAGE
        assert not (await s.call_tool("tavily_search", {"query": "q"})).isError
    assert [(c.status, c.failure) for c in fake.calls] == [(200, "jsonrpc_error"), (200, None)]


async def test_fail_first_http_503_kills_the_client_transport() -> None:
    """The mcp client raises HTTPStatusError inside its transport's task group: the pending
    call_tool is cancelled and the client context exits with an ExceptionGroup; no DELETE."""
    fake = FakeMcp(fail_first=1, fail_mode="http_503")
    async with serve_fake_mcp(fake) as url:
        with pytest.raises(ExceptionGroup) as raised:
            async with session(url) as s:
                await s.call_tool("tavily_search", {"query": "q"})
        matched, _ = raised.value.split(httpx.HTTPStatusError)
        assert matched is not None
        errors = [e for e in matched.exceptions if isinstance(e, httpx.HTTPStatusError)]
        assert [e.response.status_code for e in errors] == [503]
    assert [(c.status, c.failure) for c in fake.calls] == [(503, "http_503")]
    assert fake.failures == 1 and fake.deletes == 0


async def raw_calls(url: str, n: int) -> list[str]:
    """Initialize over plain httpx, then make n tools/call; each call's outcome in a word."""
    async with httpx.AsyncClient(headers={**ACCEPT, **KEY}, timeout=10) as http:
        init = {"protocolVersion": "2025-06-18", "capabilities": {}}
        init["clientInfo"] = {"name": "raw", "version": "0"}
        r = await http.post(
            url, json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init}
        )
        headers = {"Mcp-Session-Id": r.headers["mcp-session-id"]}
        note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        assert (await http.post(url, json=note, headers=headers)).status_code == 202
        outcomes = []
        for i in range(1, n + 1):
            params = {"name": "tavily_search", "arguments": {"query": f"q {i}"}}
            rpc = {"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": params}
            r = await http.post(url, json=rpc, headers=headers)
            if r.status_code != 200:
                outcomes.append(str(r.status_code))
                continue
            answer = r.json()
            assert answer["id"] == i
            is_error = "error" in answer or answer["result"]["isError"]
            outcomes.append("error" if "error" in answer else "isError" if is_error else "ok")
        return outcomes


async def test_fail_rate_is_seeded_and_mixed_uses_every_mode() -> None:
    runs = []
    for _ in range(2):
        fake = FakeMcp(seed=3, fail_rate=0.5, fail_mode="mixed", json_response=True)
        async with serve_fake_mcp(fake) as url:
            runs.append(await raw_calls(url, 30))
        assert fake.failures == sum(o != "ok" for o in runs[-1])
    assert runs[0] == runs[1]
    assert set(runs[0]) == {"ok", "503", "error", "isError"}
    assert 5 <= runs[0].count("ok") <= 25


async def test_api_key_required_when_set() -> None:
    fake = FakeMcp(api_key="tvly-test")
    async with serve_fake_mcp(fake) as url:
        async with httpx.AsyncClient(headers=ACCEPT) as http:
            assert (await http.post(url, json={"jsonrpc": "2.0", "id": 0})).status_code == 401
        async with session(url) as s:
            assert not (await s.call_tool("tavily_search", {"query": "q"})).isError


async def test_stop_takes_the_server_down_and_it_can_come_back() -> None:
    fake = FakeMcp(silent=5.0)
    async with serve_fake_mcp(fake) as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        async with httpx.AsyncClient(headers={**ACCEPT, **KEY}, timeout=5) as http:
            init = {"protocolVersion": "2025-06-18", "capabilities": {}}
            init["clientInfo"] = {"name": "raw", "version": "0"}
            rpc = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init}
            sid = (await http.post(url, json=rpc)).headers["mcp-session-id"]
            params = {"name": "tavily_search", "arguments": {"query": "q"}}
            call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}
            async with http.stream("POST", url, json=call, headers={"Mcp-Session-Id": sid}) as r:
                assert r.status_code == 200  # SSE headers sent, the tool is silent
                start = time.monotonic()
                await fake.stop()
                with pytest.raises(httpx.TransportError):  # the stream is cut
                    await r.aread()
                assert time.monotonic() - start < 1.0
            with pytest.raises(httpx.ConnectError):
                await http.post(url, json=rpc)
    fake.silent = 0.0
    async with serve_fake_mcp(fake, port=port) as again, session(again) as s:
        assert again == url
        assert not (await s.call_tool("tavily_search", {"query": "q"})).isError


@pytest.mark.parametrize("json_response", [False, True])
async def test_as_a_process_it_exits_on_sigterm_with_streams_open(json_response: bool) -> None:
    """A client's GET stream and a tool call silent for 30 s hold connections open: SIGTERM
    still ends the process within its graceful shutdown (1 s), with exit code 0."""
    flags = ["--json-response"] if json_response else []
    child = Child(
        "fakemcp",
        [sys.executable, "-m", "testkit.fakemcp", "--port", "0", "--silent", "30", *flags],
        pipe_stdout=True,
    )
    try:
        url = f"http://127.0.0.1:{child.read_port(20)}/mcp"
        async with httpx.AsyncClient(headers={**ACCEPT, **KEY}, timeout=10) as http:
            init = {"protocolVersion": "2025-06-18", "capabilities": {}}
            init["clientInfo"] = {"name": "raw", "version": "0"}
            rpc = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init}
            in_session = {
                "Mcp-Session-Id": (await http.post(url, json=rpc)).headers["mcp-session-id"]
            }
            ready = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            await http.post(url, json=ready, headers=in_session)
            params = {"name": "tavily_search", "arguments": {"query": "q"}}
            call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}
            silent = asyncio.create_task(http.post(url, json=call, headers=in_session))
            get = {**in_session, "Accept": "text/event-stream"}
            async with http.stream("GET", url, headers=get) as stream:
                assert stream.status_code == 200
                child.proc.send_signal(signal.SIGTERM)
                await eventually(lambda: not child.alive(), within=5)
            with pytest.raises(httpx.TransportError):
                await silent
        assert child.proc.returncode == 0
    finally:
        child.kill()

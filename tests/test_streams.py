"""Streamed answers (SSE, NDJSON) through a real proxy in front of a real streaming upstream on
loopback: their own timeouts (timeouts.idle between chunks, timeouts.stream in all, neither
per_try nor total), what the agent sees when the proxy cuts one, and what the log line and
metrics say about it."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestServer

from policies.core.clock import ManualClock
from policies.core.flow import Flow, Reply
from proxy.app import STATE, build_app
from proxy.config import ConfigError, ServerConfig, parse_config
from proxy.guard import GuardedRunner
from tests.conftest import route


class StreamingUpstream:
    """A vendor streaming events with scripted gaps; `hung_up` is set when the proxy closes
    the connection before the stream ended.

    Query: `type` (sse, ndjson), `gaps` (seconds before each event after the first), `every`
    (with no gaps: an event every so many seconds, endlessly), `linger` (seconds between the
    last event and the end), `partial` (the first event is sent without its closing blank
    line), `head` (seconds before the response headers), `json_stall` (a buffered JSON answer
    whose body stalls that long half-way).
    """

    def __init__(self) -> None:
        self.hung_up = asyncio.Event()
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        if "json_stall" in q:
            return await self._json(request, float(q["json_stall"]))
        await asyncio.sleep(float(q.get("head", 0)))
        kind = q.get("type", "sse")
        ctype = "text/event-stream" if kind == "sse" else "application/x-ndjson"
        resp = web.StreamResponse(headers={"Content-Type": ctype})
        await resp.prepare(request)
        gaps = [float(g) for g in q.get("gaps", "").split(",") if g]
        every = float(q.get("every", 0))
        try:
            first = event(0, kind)
            await resp.write(first[:-1] if "partial" in q else first)
            i = 1
            while i <= len(gaps) or every:
                await self._wait(request, gaps[i - 1] if i <= len(gaps) else every)
                await resp.write(event(i, kind))
                i += 1
            await self._wait(request, float(q.get("linger", 0)))
            await resp.write_eof()
        except ConnectionError:
            self.hung_up.set()  # returned, not raised: this server logs nothing either
        except asyncio.CancelledError:
            self.hung_up.set()  # the test server cancels a handler whose client left
            raise
        return resp

    async def _json(self, request: web.Request, stall: float) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        try:
            await resp.write(b'{"results": [')
            await self._wait(request, stall)
            await resp.write(b"]}")
            await resp.write_eof()
        except ConnectionError:
            self.hung_up.set()
        except asyncio.CancelledError:
            self.hung_up.set()
            raise
        return resp

    async def _wait(self, request: web.Request, seconds: float) -> None:
        """Sleep, noticing at once when the proxy hangs up."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while True:
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the proxy hung up")
            if loop.time() >= end:
                return
            await asyncio.sleep(min(0.02, end - loop.time()))


def event(i: int, kind: str = "sse") -> bytes:
    if kind == "sse":
        return b'id: %d\nevent: progress\ndata: {"step": %d}\n\n' % (i, i)
    return b'{"step": %d}\n' % i


@pytest.fixture
async def upstream(aiohttp_server: Any) -> StreamingUpstream:
    fake = StreamingUpstream()
    server = await aiohttp_server(fake.app())
    fake.url = str(server.make_url("")).rstrip("/")
    return fake


@pytest.fixture(autouse=True)
def aiohttp_quiet(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """No path here may make aiohttp log its bare "Error handling request" (the test server's
    plain protocol logs it, with a traceback, for any exception a handler lets out)."""
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    yield
    noisy = [r.getMessage() for r in caplog.records if "Error handling request" in r.getMessage()]
    assert not noisy, noisy


@pytest.fixture
def access_log() -> Iterator[list[dict[str, Any]]]:
    with structlog.testing.capture_logs() as logs:
        yield logs


async def request_line(logs: list[dict[str, Any]], within: float = 3.0) -> dict[str, Any]:
    """The proxy's access-log line of the one request the test made, once it is written."""
    async with asyncio.timeout(within):
        while True:
            lines = [e for e in logs if e["event"] == "request" and e.get("route") == "v"]
            if lines:
                assert len(lines) == 1, lines
                return lines[0]
            await asyncio.sleep(0.01)


class ServedAs(TestServer):
    """The proxy app served as the process serves it (`guarded`: GuardedRunner, aiohttp's
    handler_cancellation off), or by aiohttp's plain runner with handler_cancellation off
    (`plain`: an exception a handler lets out is logged as "Error handling request" even
    mid-answer). aiohttp's TestServer itself turns handler_cancellation on."""

    def __init__(self, app: web.Application, mode: str, limits: ServerConfig) -> None:
        super().__init__(app)
        self.mode = mode
        self.limits = limits

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        kwargs["handler_cancellation"] = False
        if self.mode == "guarded":
            return GuardedRunner(self.app, self.limits, **kwargs)
        return web.AppRunner(self.app, **kwargs)


@pytest.fixture(params=["test", "plain", "guarded"])
def serve(request: pytest.FixtureRequest, aiohttp_client: Any) -> Any:
    """Start a proxy in each way agents' connections can be handled; returns (client, mode)."""

    async def start(raw: dict[str, Any]) -> tuple[Any, str]:
        mode: str = request.param
        config = parse_config(raw, {})
        if mode == "test":  # aiohttp's own TestServer: handler_cancellation on
            return await aiohttp_client(build_app(config)), mode
        return await aiohttp_client(ServedAs(build_app(config), mode, config.server)), mode

    return start


def proxy_config(upstream: StreamingUpstream, **timeouts: str) -> dict[str, Any]:
    times = {"connect": "1s", "per_try": "500ms", "total": "1s", **timeouts}
    return {"routes": {"v": route(upstream.url, "/v", timeouts=times)}}


async def read_all(r: aiohttp.ClientResponse) -> tuple[bytes, bool]:
    """Everything the agent receives, and whether the answer ended properly (its final chunk)
    rather than with the connection closing before it."""
    got = b""
    try:
        async with asyncio.timeout(5):
            async for chunk in r.content.iter_any():
                got += chunk
    except aiohttp.ClientPayloadError:
        return got, False
    return got, True


def cuts(client: Any, reason: str) -> float:
    registry = client.app[STATE].metrics.registry
    value = registry.get_sample_value(
        "search_proxy_stream_cuts_total", {"route": "v", "reason": reason}
    )
    return value or 0.0


def error_event(body: bytes) -> dict[str, Any]:
    """The final `error` event of an SSE body; it must be the last thing in it."""
    head, sep, tail = body.rpartition(b"event: error\ndata: ")
    assert sep, body
    assert head == b"" or head.endswith(b"\n\n")
    assert tail.endswith(b"\n\n") and tail.count(b"\n") == 2, tail
    return json.loads(tail)["error"]  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------
# What bounds a stream: idle and stream, not per_try and total


async def test_a_gap_past_per_try_and_total_but_within_idle_streams_through_whole(
    upstream, start_proxy, access_log
):
    client = await start_proxy(proxy_config(upstream, idle="10s"))
    r = await client.get("/v/sse?gaps=1.2")  # past per_try (0.5 s) and total (1 s)
    assert r.status == 200
    body, ended = await read_all(r)
    assert ended and body == event(0) + event(1)
    line = await request_line(access_log)
    assert (line["status"], line["cut"], line["bytes"]) == (200, None, len(body))
    assert cuts(client, "upstream_timeout") == 0


async def test_per_try_still_bounds_the_wait_for_response_headers(upstream, start_proxy):
    client = await start_proxy(proxy_config(upstream, idle="10s"))
    r = await client.get("/v/sse?head=1.2")
    assert r.status == 504
    error = (await r.json())["error"]
    assert error["type"] == "upstream_timeout" and "500ms" in error["message"]


async def test_per_try_still_bounds_a_buffered_body(upstream, start_proxy):
    """Without sock_read, the attempt's own deadline is what stops a stalling JSON body."""
    client = await start_proxy(proxy_config(upstream, idle="10s"))
    r = await client.get("/v/search?json_stall=1.5")
    assert r.status == 504
    assert (await r.json())["error"]["type"] == "upstream_timeout"
    await asyncio.wait_for(upstream.hung_up.wait(), 2)


# ---------------------------------------------------------------------------------------------
# A stream the proxy cuts: what the agent sees, the log line, the metric


async def test_a_gap_past_idle_ends_with_an_sse_error_event_and_a_closed_connection(
    upstream, start_proxy, access_log
):
    client = await start_proxy(proxy_config(upstream, idle="300ms"))
    r = await client.get("/v/sse?gaps=5")
    assert r.status == 200
    body, ended = await read_all(r)
    assert not ended  # the connection closed before the final chunk: a cut the agent sees
    assert body.startswith(event(0))
    error = error_event(body[len(event(0)) :])
    assert error["type"] == "upstream_timeout"
    assert "sent nothing for 300ms mid-stream (timeouts.idle)" in error["message"]
    assert error["message"].startswith("v: ")
    line = await request_line(access_log)
    assert (line["status"], line["cut"]) == (200, "upstream_timeout")
    assert line["bytes"] == len(body) > len(event(0))
    assert cuts(client, "upstream_timeout") == 1
    await asyncio.wait_for(upstream.hung_up.wait(), 2)  # the upstream was let go at once


async def test_a_stream_running_past_timeouts_stream_is_cut(upstream, start_proxy, access_log):
    client = await start_proxy(proxy_config(upstream, idle="500ms", stream="800ms"))
    r = await client.get("/v/sse?every=0.1")  # never silent, never ending
    started = asyncio.get_running_loop().time()
    body, ended = await read_all(r)
    took = asyncio.get_running_loop().time() - started
    assert not ended and 0.7 < took < 2.0
    events, _, _ = body.rpartition(b"event: error")
    assert events.count(b"event: progress") >= 4  # it ran, and was not cut as silent
    error = error_event(body)
    assert error["type"] == "deadline_exceeded"
    assert "still running after 800ms (timeouts.stream)" in error["message"]
    line = await request_line(access_log)
    assert (line["status"], line["cut"]) == (200, "deadline_exceeded")
    assert cuts(client, "deadline_exceeded") == 1
    await asyncio.wait_for(upstream.hung_up.wait(), 2)


async def test_the_stream_limit_is_measured_on_the_injected_clock(
    upstream, start_proxy, access_log
):
    """The default timeouts.stream (1h), without waiting an hour: the proxy's clock moves."""
    clock = ManualClock()
    config = {"routes": {"v": route(upstream.url, "/v")}}  # default idle and stream
    client = await start_proxy(config, clock=clock)
    r = await client.get("/v/sse?every=0.2")
    assert await r.content.readuntil(b"\n\n") == event(0)
    clock.advance(3600)
    body, ended = await read_all(r)
    assert not ended
    assert error_event(body)["message"].startswith(
        "v: the streamed answer was still running after 1h (timeouts.stream)"
    )
    assert (await request_line(access_log))["cut"] == "deadline_exceeded"


async def test_a_cut_ndjson_stream_just_closes(upstream, start_proxy, access_log):
    client = await start_proxy(proxy_config(upstream, idle="300ms"))
    r = await client.get("/v/x?type=ndjson&gaps=5")
    assert r.headers["Content-Type"].startswith("application/x-ndjson")
    body, ended = await read_all(r)
    assert not ended and body == event(0, "ndjson")  # no event: NDJSON has no way to say it
    line = await request_line(access_log)
    assert (line["status"], line["cut"], line["bytes"]) == (200, "upstream_timeout", len(body))
    assert cuts(client, "upstream_timeout") == 1


async def test_an_sse_stream_cut_inside_an_event_gets_no_error_event(
    upstream, start_proxy, access_log
):
    """A tail written after half an event would merge into it: the agent drops an unfinished
    event when the connection ends, so ending it there is the clean cut."""
    client = await start_proxy(proxy_config(upstream, idle="300ms"))
    r = await client.get("/v/sse?partial=1&gaps=5")
    body, ended = await read_all(r)
    assert not ended and body == event(0)[:-1]
    assert (await request_line(access_log))["cut"] == "upstream_timeout"


async def test_the_replys_cut_tail_ends_a_cut_stream_instead_of_the_default(
    upstream, start_proxy, access_log
):
    """A layer that knows the stream's protocol (MCP: a JSON-RPC error for the pending call)
    sets Reply.cut_tail; here a policy standing in for it wraps the route's chain."""
    client = await start_proxy(proxy_config(upstream, idle="300ms"))
    v = client.app[STATE].routes["v"]
    inner = v.handler
    seen: list[Exception] = []

    def tail(err: Exception) -> bytes:
        seen.append(err)
        return b'event: message\ndata: {"jsonrpc": "2.0", "id": 7, "error": {}}\n\n'

    async def with_tail(flow: Flow) -> Reply:
        reply = await inner(flow)
        reply.cut_tail = tail
        return reply

    v.handler = with_tail
    r = await client.get("/v/sse?gaps=5")
    body, ended = await read_all(r)
    assert not ended
    assert body == event(0) + b'event: message\ndata: {"jsonrpc": "2.0", "id": 7, "error": {}}\n\n'
    assert [type(e).__name__ for e in seen] == ["UpstreamTimeout"]
    assert "timeouts.idle" in str(seen[0])
    line = await request_line(access_log)
    assert (line["cut"], line["bytes"]) == ("upstream_timeout", len(body))


# ---------------------------------------------------------------------------------------------
# The agent's side


async def test_an_agent_closing_after_the_last_event_is_logged_200(upstream, serve, access_log):
    """An MCP client closes once it has the answer's event; the upstream ends its stream a
    moment later and the proxy's final chunk finds the connection gone: logged 200 (not 499),
    not a cut, and nothing for aiohttp to log (the autouse fixture checks). With aiohttp's
    handler_cancellation on, the handler is cancelled while it still waits for the upstream's
    end: then the agent did leave before the stream ended, and the line says client_gone."""
    client, mode = await serve(proxy_config(upstream, idle="10s"))
    r = await client.get("/v/sse?gaps=0.05&linger=0.4")
    got = await r.content.readexactly(len(event(0) + event(1)))
    assert got == event(0) + event(1)
    r.close()  # the agent's connection closes
    line = await request_line(access_log)
    assert (line["status"], line["bytes"]) == (200, len(got))
    if mode == "test":
        assert line["cut"] == "client_gone"
    else:
        assert line["cut"] is None
        assert cuts(client, "client_gone") == 0


async def test_an_agent_leaving_mid_stream_keeps_the_status_sent_and_is_counted(
    upstream, serve, access_log
):
    client, _ = await serve(proxy_config(upstream, idle="10s"))
    r = await client.get("/v/sse?every=0.05")
    assert await r.content.readuntil(b"\n\n") == event(0)
    r.close()
    line = await request_line(access_log)
    assert (line["status"], line["cut"]) == (200, "client_gone")
    assert line["bytes"] >= len(event(0))
    assert cuts(client, "client_gone") == 1
    await asyncio.wait_for(upstream.hung_up.wait(), 2)  # the upstream was let go


async def test_an_agent_leaving_during_a_long_gap_lets_the_upstream_go_without_waiting_for_it(
    upstream, serve, access_log
):
    """No next chunk comes to find the connection gone: the proxy notices by itself within
    about a second, not after timeouts.idle (5 minutes here)."""
    client, _ = await serve(proxy_config(upstream, idle="5m"))
    r = await client.get("/v/sse?gaps=30")
    assert await r.content.readuntil(b"\n\n") == event(0)
    r.close()
    line = await request_line(access_log, within=3)
    assert (line["status"], line["cut"], line["bytes"]) == (200, "client_gone", len(event(0)))
    await asyncio.wait_for(upstream.hung_up.wait(), 1)
    assert cuts(client, "client_gone") == 1


async def test_a_whole_answer_logs_its_body_bytes(upstream, start_proxy, access_log):
    client = await start_proxy(proxy_config(upstream))
    r = await client.get("/v/search?json_stall=0")
    assert r.status == 200
    body = await r.read()
    assert (await request_line(access_log))["bytes"] == len(body) == len(b'{"results": []}')


# ---------------------------------------------------------------------------------------------
# Config


def timeouts_of(raw: dict[str, Any]) -> Any:
    config = parse_config({"routes": {"v": {"prefix": "/v", "upstream": "http://x", **raw}}}, {})
    return config.routes["v"].timeouts


def config_error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        timeouts_of(raw)
    return str(caught.value)


@pytest.mark.unit
def test_idle_and_stream_default_to_5m_and_1h_and_parse_durations():
    t = timeouts_of({})
    assert (t.idle, t.stream) == (300.0, 3600.0)
    t = timeouts_of({"timeouts": {"idle": "45s", "stream": "2h"}})
    assert (t.idle, t.stream) == (45.0, 7200.0)
    assert timeouts_of({"timeouts": {"idle": "10s", "stream": "10s"}}).stream == 10.0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("timeouts", "message"),
    [
        ({"idle": "0s"}, "routes.v.timeouts.idle: expected a duration above 0"),
        ({"stream": 0}, "routes.v.timeouts.stream: expected a duration above 0"),
        ({"idle": "soon"}, 'routes.v.timeouts.idle: expected a duration like 10s, got "soon"'),
        ({"stream": "-1s"}, "routes.v.timeouts.stream: expected a duration like 10s"),
        (
            {"idle": "10m", "stream": "5m"},
            "routes.v.timeouts.stream: must be at least timeouts.idle (600s)",
        ),
        ({"stream": "1m"}, "routes.v.timeouts.stream: must be at least timeouts.idle (300s)"),
    ],
)
def test_idle_and_stream_out_of_range_are_refused_naming_the_path(timeouts, message):
    assert config_error({"timeouts": timeouts}).startswith(message)

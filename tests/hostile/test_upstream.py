"""Broken and hostile upstreams, served raw from a socket on loopback: every way an exchange can
fail is a structured answer (retried as the route says, counted, answered stale when it can),
never a 500; answers past `max_response_bytes` are cut while they inflate; a full connection
pool is reported as such; JSON nested past any sane depth is handled on both sides."""

from __future__ import annotations

import asyncio
import json
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import streams

from policies.core.clock import ManualClock
from proxy.app import STATE
from proxy.bodies import MAX_JSON_DEPTH
from proxy.config import ConfigError, parse_config
from proxy.outbound import MAX_INTERIM
from testkit.fakevendor import FakeVendor
from tests.conftest import route

MiB = 1024 * 1024
OK_BODY = b'{"results": [{"title": "t", "url": "https://example.com/", "content": "c"}]}'
Writer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"


def http(
    body: bytes = OK_BODY,
    *headers: bytes,
    status: bytes = b"HTTP/1.1 200 OK",
    length: int | None = None,
) -> bytes:
    """A raw response: status line, Content-Type JSON, the headers given, Content-Length."""
    declared = len(body) if length is None else length
    lines = [status, b"Content-Type: application/json", *headers]
    lines.append(b"Content-Length: %d" % declared)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def gzip_of(data: bytes) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: the gzip container
    return packer.compress(data) + packer.flush()


OK = http()
BROKEN: dict[str, bytes] = {
    "invalid chunk size": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\n" + OK_BODY + b"\r\n0\r\n\r\n"
    ),
    "garbage status line": b"GARBAGE FROM A CONFUSED PEER\r\n\r\n" + OK_BODY,
    "body shorter than its Content-Length": http(OK_BODY, length=len(OK_BODY) + 500),
    "body longer than its Content-Length": http(OK_BODY, length=10),
    "a 10 KB header line": http(OK_BODY, b"X-Big: " + b"a" * 10_240),
    "5,000 headers": http(OK_BODY, *(b"X-H%d: v" % i for i in range(5000))),
    "a corrupt gzip body": http(
        gzip_of(OK_BODY)[:12] + b"\x00" * 40, b"Content-Encoding: gzip", length=52
    ),
    # RFC 9110 15: a status outside 100-599 is invalid (clients cannot all parse 0 or 99).
    "status 099": http(status=b"HTTP/1.1 099 Odd"),
    "status 600": http(status=b"HTTP/1.1 600 Odd"),
    "a 101 nobody asked for": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
    # aiohttp reads the chunks and leaves the gzip: it would go on compressed and unlabelled.
    "a gzip transfer coding": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: gzip, chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n"
        % (len(gzip_of(OK_BODY)), gzip_of(OK_BODY))
    ),
    "nine interim answers": EARLY_HINTS * (MAX_INTERIM + 1) + http(),
    "chunked, then gzip on a second line": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n"
        % (len(gzip_of(OK_BODY)), gzip_of(OK_BODY))
    ),
    # aiohttp takes chunked from the last coding: this body would be read to the close, chunk
    # sizes and all.
    "chunked, then identity": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked, identity\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n"
        % (len(OK_BODY), OK_BODY)
    ),
    # A coding aiohttp does not decode: labelled, the agent's client would decode what the echo
    # guard could not read; unlabelled, it would be compressed bytes sent as JSON.
    "an x-gzip body": http(gzip_of(OK_BODY), b"Content-Encoding: x-gzip"),
    "gzip twice, on two lines": http(
        gzip_of(gzip_of(OK_BODY)), b"Content-Encoding: gzip", b"Content-Encoding: gzip"
    ),
    "gzip twice, on one line": http(gzip_of(gzip_of(OK_BODY)), b"Content-Encoding: gzip, gzip"),
}
# A body cut short is the connection ending early; everything else is not HTTP at all.
ERROR_TYPE = dict.fromkeys(BROKEN, "upstream_invalid_response") | {
    "body shorter than its Content-Length": "upstream_unreachable"
}
RETRY_RESETS = {"attempts": 3, "on": ["reset"], "backoff": {"initial": "1ms", "max": "1ms"}}


class RawUpstream:
    """An HTTP peer answering each request with scripted raw bytes (or a writer coroutine),
    then closing the connection; `default` answers once the script runs out. `hung_up` is set
    when the proxy closes a connection before the answer was all written (or, with `linger`,
    at any time after it)."""

    def __init__(self) -> None:
        self.script: deque[bytes | Writer] = deque()
        self.default: bytes | Writer = OK
        self.requests = 0
        self.hung_up = asyncio.Event()
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    await reader.readexactly(int(value))
            self.requests += 1
            answer = self.script.popleft() if self.script else self.default
            if isinstance(answer, bytes):
                writer.write(answer)
                await writer.drain()
            else:
                await answer(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.hung_up.set()
        finally:
            writer.close()


@pytest.fixture
async def upstream() -> AsyncIterator[RawUpstream]:
    peer = RawUpstream()
    await peer.start()
    yield peer
    await peer.close()


def attempts_counted(client: Any, route_name: str, outcome: str) -> float:
    registry = client.app[STATE].metrics.registry
    labels = {"route": route_name, "outcome": outcome}
    return registry.get_sample_value("search_proxy_upstream_attempts_total", labels) or 0.0


# ---------------------------------------------------------------------------------------------
# Broken answers


@pytest.mark.parametrize("case", list(BROKEN))
async def test_a_broken_answer_is_a_structured_502_retried_as_a_reset(
    case: str, upstream: RawUpstream, start_proxy: Any
) -> None:
    upstream.default = BROKEN[case]
    client = await start_proxy({"routes": {"v": route(upstream.url, "/v", retry=RETRY_RESETS)}})
    r = await client.post("/v/search", json={"query": "q"})
    assert r.status == 502
    assert r.headers["X-Proxy-Error"] == ERROR_TYPE[case]
    assert r.headers["X-Proxy-Attempts"] == "3"
    error = (await r.json())["error"]
    assert error["type"] == ERROR_TYPE[case] and error["attempts"] == 3
    assert error["message"].startswith("v: the upstream") and "\n" not in error["message"]
    assert upstream.requests == 3
    assert attempts_counted(client, "v", "reset") == 3


@pytest.mark.parametrize("case", list(BROKEN))
async def test_a_broken_answer_is_not_retried_when_the_route_does_not_retry_resets(
    case: str, upstream: RawUpstream, start_proxy: Any
) -> None:
    upstream.default = BROKEN[case]
    retry = {**RETRY_RESETS, "on": ["5xx", "timeout"]}
    client = await start_proxy({"routes": {"v": route(upstream.url, "/v", retry=retry)}})
    r = await client.post("/v/search", json={"query": "q"})
    assert (r.status, r.headers["X-Proxy-Attempts"], upstream.requests) == (502, "1", 1)
    assert attempts_counted(client, "v", "reset") == 1


@pytest.mark.parametrize("case", list(BROKEN))
async def test_a_broken_answer_is_answered_stale_when_an_entry_exists(
    case: str, upstream: RawUpstream, start_proxy: Any
) -> None:
    clock = ManualClock()
    cache = {"ttl": "10m", "stale_ttl": "1h"}
    raw = {"routes": {"v": route(upstream.url, "/v", retry=RETRY_RESETS, cache=cache)}}
    client = await start_proxy(raw, clock=clock)
    first = await client.post("/v/search", json={"query": "q"})
    assert first.status == 200 and await first.read() == OK_BODY
    clock.advance(11 * 60)
    upstream.default = BROKEN[case]
    r = await client.post("/v/search", json={"query": "q"})
    assert r.status == 200 and await r.read() == OK_BODY
    assert r.headers["X-Cache"] == "STALE"
    status = r.headers["Cache-Status"]
    assert "fwd=stale" in status and status.endswith(f"detail={ERROR_TYPE[case]}")
    assert upstream.requests == 1 + 3


async def test_a_broken_answer_on_a_search_route_speaks_the_vendors_error_shape(
    upstream: RawUpstream, start_proxy: Any
) -> None:
    upstream.default = BROKEN["garbage status line"]
    raw = {"routes": {"tavily": route(upstream.url, "/tavily", search={"vendor": "tavily"})}}
    client = await start_proxy(raw)
    r = await client.post("/tavily/search", json={"query": "q"})
    assert r.status == 502 and r.headers["X-Proxy-Error"] == "upstream_invalid_response"
    body = await r.json()
    assert body["search_proxy"]["type"] == "upstream_invalid_response"
    assert "broken HTTP response" in body["detail"]["error"]


async def test_interim_answers_up_to_the_bound_are_read_past(
    upstream: RawUpstream, start_proxy: Any
) -> None:
    upstream.default = EARLY_HINTS * MAX_INTERIM + http()
    client = await start_proxy({"routes": {"v": route(upstream.url, "/v")}})
    r = await client.post("/v/search", json={"query": "q"})
    assert r.status == 200 and await r.read() == OK_BODY


async def test_a_flood_of_interim_answers_is_refused_and_no_more_of_it_read(
    upstream: RawUpstream, start_proxy: Any
) -> None:
    sent = [0]

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        chunk = EARLY_HINTS * 1000  # 60 KB of heads
        while sent[0] < 256 * MiB:  # the proxy read on until per_try: hundreds of MB held
            writer.write(chunk)
            await writer.drain()
            sent[0] += len(chunk)

    upstream.default = flood
    client = await start_proxy({"routes": {"v": route(upstream.url, "/v")}})
    r = await client.post("/v/search", json={"query": "q"})
    assert r.status == 502 and r.headers["X-Proxy-Error"] == "upstream_invalid_response"
    message = (await r.json())["error"]["message"]
    assert f"more than {MAX_INTERIM} interim (1xx) answers" in message
    await asyncio.wait_for(upstream.hung_up.wait(), 5)
    # What the proxy took before it hung up: one read's worth of heads, and the sockets' buffers.
    assert sent[0] < 16 * MiB


async def test_a_decoded_body_goes_on_without_its_content_encoding(
    upstream: RawUpstream, start_proxy: Any
) -> None:
    upstream.default = http(gzip_of(OK_BODY), b"Content-Encoding: gzip")
    client = await start_proxy({"routes": {"v": route(upstream.url, "/v")}})
    r = await client.post("/v/search", json={"query": "q"}, auto_decompress=False)
    assert r.status == 200 and "Content-Encoding" not in r.headers
    assert await r.read() == OK_BODY


@pytest.mark.parametrize("status", [b"304 Not Modified", b"204 No Content"])
async def test_a_bodiless_answer_declaring_a_large_length_passes(
    status: bytes, upstream: RawUpstream, start_proxy: Any
) -> None:
    # A 304's Content-Length is the size the 200 would have (RFC 9110 8.6): no body follows.
    upstream.default = b'HTTP/1.1 %s\r\nETag: "v1"\r\nContent-Length: 2000000\r\n\r\n' % status
    raw = {"routes": {"v": route(upstream.url, "/v", max_response_bytes="1KiB")}}
    client = await start_proxy(raw)
    r = await client.get("/v/page", headers={"If-None-Match": '"v1"'})
    assert r.status == int(status[:3]) and r.headers["ETag"] == '"v1"'
    assert await r.read() == b""


async def test_a_header_with_a_control_character_is_dropped_and_the_answer_passes(
    upstream: RawUpstream, start_proxy: Any
) -> None:
    upstream.default = http(OK_BODY, b"X-Bad: a\x01b", b"X-Good: fine")
    client = await start_proxy({"routes": {"v": route(upstream.url, "/v")}})
    r = await client.post("/v/search", json={"query": "q"})
    assert r.status == 200 and await r.read() == OK_BODY
    assert "X-Bad" not in r.headers and r.headers["X-Good"] == "fine"


async def test_a_retry_after_of_five_thousand_digits_is_a_structured_429(
    upstream: RawUpstream, start_proxy: Any
) -> None:
    upstream.default = http(b"{}", b"Retry-After: " + b"9" * 5000, status=b"HTTP/1.1 429 Slow")
    retry = {**RETRY_RESETS, "on": [429]}
    client = await start_proxy({"routes": {"v": route(upstream.url, "/v", retry=retry)}})
    r = await client.post("/v/search", json={"query": "q"})
    assert r.status == 429 and r.headers["X-Proxy-Error"] == "upstream_rate_limited"
    assert r.headers["Retry-After"] == str(2**31)  # RFC 9111 §1.2.2's stand-in for "too large"


# ---------------------------------------------------------------------------------------------
# Response size: cut while inflating


@pytest.mark.parametrize(
    ("value", "parsed"), [("2MiB", 2 * MiB), (1024, 1024), ("0", None), ("big", None)]
)
def test_max_response_bytes_is_a_size_of_at_least_one_byte(value: Any, parsed: int | None) -> None:
    raw = {"routes": {"v": route("http://vendor.test", "/v", max_response_bytes=value)}}
    if parsed is None:
        with pytest.raises(ConfigError, match=r"routes\.v\.max_response_bytes: expected"):
            parse_config(raw, {})
    else:
        assert parse_config(raw, {}).routes["v"].max_response_bytes == parsed


@pytest.fixture(scope="module")
def gzip_bomb() -> bytes:
    """200 MiB of zeros, gzipped to about 200 KB, built without holding the 200 MiB."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(MiB)
    parts = [packer.compress(zeros) for _ in range(200)]
    return b"".join(parts) + packer.flush()


@pytest.fixture
def inflated(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every byte fed to an aiohttp StreamReader in this test: for the proxy's upstream
    responses, the body as decoded (inflated) by aiohttp, i.e. what it buffered for us."""
    fed = [0]
    original = streams.StreamReader.feed_data

    def feed_data(self: streams.StreamReader, data: bytes, *args: Any) -> None:
        fed[0] += len(data)
        original(self, data, *args)

    monkeypatch.setattr(streams.StreamReader, "feed_data", feed_data)
    return fed


async def test_a_gzip_bomb_is_cut_at_max_response_bytes_and_not_retried(
    upstream: RawUpstream, start_proxy: Any, gzip_bomb: bytes, inflated: list[int]
) -> None:
    assert len(gzip_bomb) < 300_000
    upstream.default = http(gzip_bomb, b"Content-Encoding: gzip")
    retry = {**RETRY_RESETS, "on": ["reset", "malformed", "5xx"]}
    client = await start_proxy({"routes": {"v": route(upstream.url, "/v", retry=retry)}})
    r = await client.post("/v/search", json={"query": "q"})
    assert r.status == 502 and r.headers["X-Proxy-Error"] == "upstream_too_large"
    error = (await r.json())["error"]
    assert "max_response_bytes of 8388608" in error["message"]  # the default, 8 MiB
    assert (error["attempts"], upstream.requests) == (1, 1)
    assert attempts_counted(client, "v", "malformed") == 1
    # The default limit is 8 MiB; aiohttp inflates at most a read-ahead beyond what we took.
    assert 8 * MiB < inflated[0] < 10 * MiB


async def test_a_declared_length_over_the_limit_is_refused_before_reading(
    upstream: RawUpstream, start_proxy: Any, inflated: list[int]
) -> None:
    big = b"[" + b"0," * (600 * 1024) + b"0]"
    upstream.default = http(big)
    raw = {"routes": {"v": route(upstream.url, "/v", max_response_bytes="1MiB")}}
    client = await start_proxy(raw)
    r = await client.post("/v/search", json={"query": "q"})
    assert r.status == 502 and r.headers["X-Proxy-Error"] == "upstream_too_large"
    assert f"is {len(big)} bytes" in (await r.json())["error"]["message"]
    assert inflated[0] < 512 * 1024  # what arrived with the headers at most, not the megabyte


async def test_a_chunked_json_answer_growing_past_the_limit_is_cut(
    upstream: RawUpstream, start_proxy: Any, inflated: list[int]
) -> None:
    async def endless_json(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"0," * 32 * 1024
        for _ in range(1000):  # 64 MiB if nobody stopped reading
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()

    upstream.default = endless_json
    raw = {"routes": {"v": route(upstream.url, "/v", max_response_bytes="1MiB")}}
    client = await start_proxy(raw)
    r = await client.post("/v/search", json={"query": "q"})
    assert r.status == 502 and r.headers["X-Proxy-Error"] == "upstream_too_large"
    await asyncio.wait_for(upstream.hung_up.wait(), 2)  # the proxy hung up on it
    assert inflated[0] < 2 * MiB


async def test_a_streamed_answer_past_the_limit_is_cut_and_the_upstream_closed(
    upstream: RawUpstream, start_proxy: Any, gzip_bomb: bytes, inflated: list[int]
) -> None:
    async def bomb_then_linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
            b"Content-Length: %d\r\n\r\n" % len(gzip_bomb) + gzip_bomb
        )
        await writer.drain()  # 200 KB: the kernel's buffers take it all
        if await reader.read() == b"":  # a keep-alive peer would say nothing and stay
            upstream.hung_up.set()

    upstream.default = bomb_then_linger
    raw = {"routes": {"v": route(upstream.url, "/v", max_response_bytes="1MiB")}}
    client = await start_proxy(raw)
    r = await client.get("/v/events")
    assert r.status == 200
    received = 0
    with pytest.raises(aiohttp.ClientPayloadError):  # the connection ends before the last chunk
        async with asyncio.timeout(5):
            async for chunk in r.content.iter_any():
                received += len(chunk)
    assert 0 < received <= MiB
    await asyncio.wait_for(upstream.hung_up.wait(), 2)
    # The proxy's read-ahead, and the test client's copy of what was relayed: a few MiB at most.
    assert inflated[0] < 4 * MiB


# ---------------------------------------------------------------------------------------------
# The connection pool


@pytest.mark.parametrize(
    ("server", "busy"),
    [
        (
            {"upstream_connections_per_host": 2},
            "all 2 connections to its upstream host are busy (waited 200ms for one); raise "
            "server.upstream_connections_per_host or retry in 1s",
        ),
        (
            {"upstream_connections": 2},
            "all 2 upstream connections of the proxy are busy (waited 200ms for one); raise "
            "server.upstream_connections or retry in 1s",
        ),
    ],
)
async def test_a_full_connection_pool_is_its_own_error_not_a_deadline(
    server: dict[str, int], busy: str, vendor: FakeVendor, start_proxy: Any
) -> None:
    vendor.latency(0.6)
    timeouts = {"connect": "200ms", "per_try": "5s", "total": "60s"}
    raw = {
        "server": server,
        "routes": {"v": route(vendor.url + "/tavily", "/v", timeouts=timeouts)},
    }
    client = await start_proxy(raw)
    replies = await asyncio.gather(
        *(client.post("/v/search", json={"query": f"q{i}"}) for i in range(5))
    )
    assert sorted(r.status for r in replies) == [200, 200, 503, 503, 503]
    for r in replies:
        if r.status != 503:
            continue
        assert r.headers["X-Proxy-Error"] == "upstream_pool_exhausted"
        assert r.headers["Retry-After"] == "1" and r.headers["X-Proxy-Attempts"] == "0"
        assert (await r.json())["error"]["message"] == f"v: {busy}"
    assert vendor.count() == 2
    assert attempts_counted(client, "v", "ok") == 2


async def test_requests_queue_for_a_pooled_connection_within_the_connect_timeout(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    vendor.latency(0.1)
    timeouts = {"connect": "2s", "per_try": "5s", "total": "10s"}
    raw = {
        "server": {"upstream_connections_per_host": 2},
        "routes": {"v": route(vendor.url + "/tavily", "/v", timeouts=timeouts)},
    }
    client = await start_proxy(raw)
    replies = await asyncio.gather(
        *(client.post("/v/search", json={"query": f"q{i}"}) for i in range(6))
    )
    assert [r.status for r in replies] == [200] * 6 and vendor.count() == 6


# ---------------------------------------------------------------------------------------------
# Deeply nested JSON


def nested_list(depth: int, inner: bytes = b"") -> bytes:
    return b"[" * depth + inner + b"]" * depth


async def test_a_request_body_nested_to_the_limit_is_forwarded_and_cached(
    upstream: RawUpstream, start_proxy: Any
) -> None:
    body = b'{"query":"x","a":' + nested_list(MAX_JSON_DEPTH - 1) + b"}"
    cache = {"ttl": "10m"}
    client = await start_proxy({"routes": {"v": route(upstream.url, "/v", cache=cache)}})
    headers = {"Content-Type": "application/json"}
    first = await client.post("/v/search", data=body, headers=headers)
    assert (first.status, first.headers["X-Cache"]) == (200, "MISS")
    again = await client.post("/v/search", data=body, headers=headers)
    assert (again.status, again.headers["X-Cache"]) == (200, "HIT")
    assert upstream.requests == 1


@pytest.mark.parametrize("depth", [300, 100_000])
async def test_a_request_body_nested_past_it_is_refused_before_the_vendor(
    depth: int, upstream: RawUpstream, start_proxy: Any
) -> None:
    body = b'{"query":"x","a":' + nested_list(depth) + b"}"
    client = await start_proxy({"routes": {"v": route(upstream.url, "/v")}})
    r = await client.post("/v/search", data=body, headers={"Content-Type": "application/json"})
    assert r.status == 400 and r.headers["X-Proxy-Error"] == "bad_request"
    assert upstream.requests == 0


async def test_a_deeply_nested_vendor_answer_is_malformed_not_a_500(
    upstream: RawUpstream, start_proxy: Any
) -> None:
    upstream.default = http(b'{"results": ' + nested_list(5000) + b"}")
    search = {"vendor": "tavily", "on_empty": "pass"}
    retry = {**RETRY_RESETS, "on": ["malformed"]}
    client = await start_proxy(
        {"routes": {"t": route(upstream.url, "/t", search=search, retry=retry)}}
    )
    r = await client.post("/t/search", json={"query": "q"})
    assert r.status == 502 and r.headers["X-Proxy-Error"] == "upstream_malformed"
    assert upstream.requests == 3 and attempts_counted(client, "t", "malformed") == 3


async def test_a_stream_past_its_size_limit_is_cut_and_logged_not_a_500(
    upstream: RawUpstream, start_proxy: Any
) -> None:
    """An event stream outgrowing max_response_bytes: the agent got its status and the first
    chunks under the limit, then the connection ends before the last chunk (a cut it sees)."""

    async def endless_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        event = b"data: " + b"x" * 1000 + b"\n\n"
        for _ in range(200):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()

    upstream.default = endless_stream
    client = await start_proxy(
        {"routes": {"mcp": route(upstream.url, "/mcp", max_response_bytes="16KiB")}}
    )
    r = await client.get("/mcp/events")
    assert r.status == 200
    got = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for chunk in r.content.iter_any():
            got += chunk
    # Never more than the limit of the vendor's bytes reaches the agent; the proxy's own final
    # `error` event says why the stream ended.
    relayed, _, tail = got.rpartition(b"event: error\ndata: ")
    assert len(relayed) <= 16 * 1024
    assert json.loads(tail)["error"]["type"] == "upstream_too_large"

"""The front (proxy/front.py) over raw sockets, on the proxy's own listener: route requests are
served there, everything else is handed to aiohttp's server with the bytes that came, and a
connection goes on working either way (keep-alive, pipelining, HTTP/1.0, a head or body
arriving in pieces, a body refused unread)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import make_mocked_request

from proxy.guard import ClientConnection, GuardedServer
from testkit.fakevendor import FakeVendor, Fault
from tests.conftest import route

OPEN_S = 5.0  # far past any answer here; a test that waits this long has failed


def one_route(vendor: FakeVendor, **server: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"routes": {"v": route(vendor.url, "/v")}}
    if server:
        raw["server"] = server
    return raw


def guard_of(client: Any) -> GuardedServer:
    guarded = client.server.runner.guarded
    assert isinstance(guarded, GuardedServer)
    return guarded


class Raw:
    """One raw connection to the proxy."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def to(cls, client: Any) -> Raw:
        return cls(*await asyncio.open_connection(client.host, client.port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self) -> tuple[int, dict[str, str], bytes]:
        """One whole answer: status, headers (lower-case names), body (by Content-Length)."""
        async with asyncio.timeout(OPEN_S):
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ")[1])
            headers = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return status, headers, body

    async def closed(self) -> bool:
        """Whether the proxy closes the connection (reads until it does)."""
        async with asyncio.timeout(OPEN_S):
            return await self.reader.read() == b""

    def close(self) -> None:
        self.writer.close()


def post(path: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    lines = [f"POST {path} HTTP/{version}", "Host: proxy", f"Content-Length: {len(body)}"]
    lines += extra
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def echoed(body: bytes) -> dict[str, Any]:
    return json.loads(body)  # the fake vendor's /echo: what it was sent


async def test_route_requests_are_served_by_the_front_and_kept_alive(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    for i in range(3):
        sent = f'{{"query": "{i}"}}'
        await raw.send(post("/v/echo", sent.encode()))
        status, headers, body = await raw.answer()
        assert status == 200 and echoed(body)["body"] == sent
        assert "connection" not in headers  # HTTP/1.1 keep-alive: nothing to say
    guard = guard_of(client)
    assert len(guard.agents) == 1 and not guard.connections  # aiohttp's server saw none
    raw.close()


async def test_a_request_for_another_endpoint_hands_the_connection_to_aiohttp(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    await raw.send(post("/v/echo", b"{}"))
    assert (await raw.answer())[0] == 200
    await raw.send(b"GET /healthz HTTP/1.1\r\nHost: proxy\r\n\r\n")
    status, _, body = await raw.answer()
    assert status == 200 and json.loads(body) == {"status": "ok"}
    guard = guard_of(client)
    assert not guard.agents and len(guard.connections) == 1
    assert isinstance(guard.connections[0], ClientConnection)
    # aiohttp serves the rest of the connection, route requests too.
    await raw.send(post("/v/echo", b'{"a": 1}'))
    status, _, body = await raw.answer()
    assert status == 200 and echoed(body)["body"] == '{"a": 1}'
    assert guard.open == 1  # one connection, counted once through the hand-over
    raw.close()


async def test_pipelined_requests_are_answered_in_order(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    await raw.send(post("/v/echo", b"1") + post("/v/echo", b"22") + post("/v/echo", b"333"))
    bodies = [echoed((await raw.answer())[2])["body"] for _ in range(3)]
    assert bodies == ["1", "22", "333"]
    raw.close()


async def test_a_pipelined_request_for_aiohttp_waits_for_the_answer_before_it(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    await raw.send(post("/v/echo", b"1") + b"GET /healthz HTTP/1.1\r\nHost: p\r\n\r\n")
    first, second = await raw.answer(), await raw.answer()
    assert echoed(first[2])["body"] == "1"
    assert json.loads(second[2]) == {"status": "ok"}
    raw.close()


async def test_a_head_and_body_arriving_byte_by_byte_are_served(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    for byte in post("/v/echo", b'{"query": "slow"}'):
        await raw.send(bytes([byte]))
    status, _, body = await raw.answer()
    assert status == 200 and echoed(body)["body"] == '{"query": "slow"}'
    assert len(guard_of(client).agents) == 1  # the front's, all along
    raw.close()


@pytest.mark.parametrize(
    ("request_bytes", "reason"),
    [
        (
            b"POST /v/echo HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"4\r\nab{}\r\n0\r\n\r\n",
            "a chunked body",
        ),
        (
            b"POST /v/echo HTTP/1.1\r\nHost: p\r\nExpect: 100-continue\r\n"
            b"Content-Length: 4\r\n\r\nab{}",
            "a 100-continue body",
        ),
    ],
)
async def test_bodies_the_front_does_not_frame_are_served_by_aiohttp(
    vendor, start_proxy, request_bytes: bytes, reason: str
):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    await raw.send(request_bytes)
    status, _, body = await raw.answer()
    if status == 100:  # aiohttp's interim answer to Expect, then the real one
        status, _, body = await raw.answer()
    assert status == 200, reason
    assert echoed(body)["body"] == "ab{}", reason
    assert not guard_of(client).agents, reason
    raw.close()


@pytest.mark.parametrize("path", ["/v/echo", "/v1/search", "/healthz"])
async def test_an_expect_the_proxy_cannot_meet_is_a_json_417(vendor, start_proxy, path: str):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    await raw.send(post(path, b"{}", "Expect: 200-ok"))
    status, headers, body = await raw.answer()
    error = json.loads(body)["error"]
    assert status == 417 and headers["x-proxy-error"] == "expectation_failed"
    assert error["type"] == "expectation_failed" and "'200-ok'" in error["message"]
    assert vendor.count() == 0
    raw.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        post("/admin/reload", b"{}", "Expect: 200-ok"),
        b"GET /admin/status HTTP/1.1\r\nHost: p\r\nExpect: 200-ok\r\n\r\n",
    ],
)
async def test_an_expect_the_admin_listener_cannot_meet_is_a_json_417(
    vendor, start_proxy, admin_of, request_bytes: bytes
):
    listener = await admin_of(await start_proxy(one_route(vendor)))
    raw = await Raw.to(listener)
    await raw.send(request_bytes)
    status, headers, body = await raw.answer()
    assert status == 417 and headers["x-proxy-error"] == "expectation_failed"
    assert json.loads(body)["error"]["type"] == "expectation_failed"
    raw.close()


async def test_http_1_0_keeps_the_connection_only_when_asked(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    await raw.send(post("/v/echo", b"{}", "Connection: keep-alive", version="1.0"))
    status, headers, _ = await raw.answer()
    assert status == 200 and headers["connection"] == "keep-alive"
    await raw.send(post("/v/echo", b"{}", version="1.0"))
    status, headers, _ = await raw.answer()
    assert status == 200 and "connection" not in headers  # HTTP/1.0: closes by default
    assert await raw.closed()


async def test_connection_close_is_said_and_done(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    await raw.send(post("/v/echo", b"{}", "Connection: close"))
    status, headers, _ = await raw.answer()
    assert status == 200 and headers["connection"] == "close"
    assert await raw.closed()


async def test_head_requests_get_no_body(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    await raw.send(b"HEAD /v/echo HTTP/1.1\r\nHost: p\r\n\r\n")
    head = await raw.reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 ")
    await raw.send(post("/v/echo", b'{"after": "head"}'))  # no stray body bytes before it
    status, _, body = await raw.answer()
    assert status == 200 and echoed(body)["body"] == '{"after": "head"}'
    raw.close()


async def test_a_body_over_the_limit_gets_413_and_the_connection_closes_after_it(
    vendor, start_proxy
):
    client = await start_proxy(one_route(vendor, max_body_bytes="1KiB"))
    raw = await Raw.to(client)
    head = b"POST /v/echo HTTP/1.1\r\nHost: p\r\nContent-Length: 200000\r\n\r\n"
    await raw.send(head + b"x" * 1000)  # the answer comes before the rest of the body
    status, headers, body = await raw.answer()
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["type"] == "body_too_large"
    await raw.send(b"x" * 199_000)  # read and dropped while the proxy lingers
    assert await raw.closed()
    assert vendor.count() == 0


async def test_a_stalled_body_gets_408_and_the_connection_closes(vendor, start_proxy):
    client = await start_proxy(one_route(vendor, body_timeout="200ms"))
    raw = await Raw.to(client)
    await raw.send(b"POST /v/echo HTTP/1.1\r\nHost: p\r\nContent-Length: 10\r\n\r\n12345")
    status, headers, body = await raw.answer()
    assert status == 408 and json.loads(body)["error"]["type"] == "request_timeout"
    assert headers["connection"] == "close"
    assert await raw.closed()
    assert vendor.count() == 0


async def test_a_malformed_head_gets_aiohttp_json_400(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    await raw.send(b"POST /v/echo HTTP/1.1\r\nHost: p\r\nBad Header: x\r\n\r\n")
    status, _, body = await raw.answer()
    assert status == 400 and json.loads(body)["error"]["type"] == "bad_request"
    assert vendor.count() == 0


async def test_an_idle_kept_alive_connection_closes_after_the_keepalive_timeout(
    vendor, start_proxy
):
    client = await start_proxy(one_route(vendor, client_keepalive_timeout="200ms"))
    raw = await Raw.to(client)
    await raw.send(post("/v/echo", b"{}"))
    assert (await raw.answer())[0] == 200
    assert await raw.closed()  # nothing sent after the answer: closed by the proxy
    assert guard_of(client).open == 0


async def test_the_request_id_and_forwarded_headers_reach_the_vendor(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    await raw.send(post("/v/echo", b"{}", "X-Request-Id: front-1", "X-Forwarded-For: 10.0.0.1"))
    status, headers, _ = await raw.answer()
    assert status == 200 and headers["x-request-id"] == "front-1"
    sent = vendor.last.headers
    assert sent["X-Request-Id"] == "front-1"
    assert sent["X-Forwarded-For"] == "10.0.0.1, 127.0.0.1"
    assert sent["X-Forwarded-Host"] == "proxy" and sent["X-Forwarded-Proto"] == "http"
    raw.close()


async def test_the_access_line_shows_the_path_and_query_the_request_was_routed_by(
    vendor, start_proxy
):
    """Percent-decoded as aiohttp decodes them. A fragment (no client sends one) runs from the
    first '#' to the end, a '?' in it included: neither logged nor sent to the vendor."""
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    targets = {  # target: (logged path, logged query, what the vendor is sent)
        "/v/echo": ("/v/echo", None, "/echo"),
        "/v/echo/a+b;c=d?q=%41": ("/v/echo/a+b;c=d", "q=A", "/echo/a+b;c=d?q=%41"),
        "/v/echo/a%20b%3Bc?x=1": ("/v/echo/a b;c", "x=1", "/echo/a%20b%3Bc?x=1"),
        "/v/echo/%C3%BC#f": ("/v/echo/ü", None, "/echo/%C3%BC"),
        "/v/echo/a?c=1#d": ("/v/echo/a", "c=1", "/echo/a?c=1"),
        "/v/echo/a#b?c=1#d": ("/v/echo/a", None, "/echo/a"),
    }
    sent = []
    with structlog.testing.capture_logs() as logs:
        for target in targets:
            await raw.send(post(target, b"{}"))
            status, _, body = await raw.answer()
            assert status == 200, (target, body)
            sent.append(echoed(body)["raw_path"])
    shown = [(line["path"], line["query"]) for line in logs if line["event"] == "request"]
    logged_and_sent = [(*logged, upstream) for logged, upstream in zip(shown, sent, strict=True)]
    assert logged_and_sent == list(targets.values())
    plain = [target for target in targets if "#" not in target]
    assert [path for path, _ in shown[: len(plain)]] == [
        make_mocked_request("POST", target).path for target in plain
    ]
    raw.close()


async def test_pipelined_requests_outlasting_the_keepalive_timeout_are_all_answered(
    vendor, start_proxy
):
    # The idle timer armed after the first answer must not close the connection while the
    # pipelined second request is being served.
    client = await start_proxy(one_route(vendor, client_keepalive_timeout="200ms"))
    vendor.script(Fault.ok(), Fault.hang(0.6))
    raw = await Raw.to(client)
    await raw.send(post("/v/echo", b"1") + post("/v/echo", b"2"))
    first, second = await raw.answer(), await raw.answer()
    assert echoed(first[2])["body"] == "1" and echoed(second[2])["body"] == "2"
    raw.close()


async def test_a_connection_handed_over_after_pipelining_keeps_no_timer_of_the_front(
    vendor, start_proxy
):
    client = await start_proxy(one_route(vendor, client_keepalive_timeout="300ms"))
    raw = await Raw.to(client)
    await raw.send(post("/v/echo", b"1") + post("/v/echo", b"2"))
    await raw.answer(), await raw.answer()
    await raw.send(b"GET /healthz HTTP/1.1\r\nHost: p\r\n\r\n")  # aiohttp's from here
    assert (await raw.answer())[0] == 200
    for _ in range(3):  # requests a little apart, each within aiohttp's keep-alive
        await asyncio.sleep(0.2)
        await raw.send(post("/v/echo", b"3"))
        assert (await raw.answer())[0] == 200
    raw.close()


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v/echo HTTP/1.1\r\nHost: p\r\nX-Big: " + b"a" * 12_000 + b"\r\n",
        b"POST /v/echo HTTP/1.1\r\nHost: p\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)),
        b"POST /v/echo HTTP/1.1\r\nHost: p\r\nContent-Type: a/b\r\nContent-Type: c/d\r\n",
        b"POST /v/echo HTTP/1.1\r\nHost: p\r\nHost: q\r\n",
    ],
    ids=["long field", "many headers", "two content types", "two hosts"],
)
async def test_heads_past_aiohttps_limits_get_its_400_and_reach_no_vendor(
    vendor, start_proxy, head: bytes
):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    await raw.send(head + b"Content-Length: 2\r\n\r\n{}")
    status, _, body = await raw.answer()
    assert status == 400 and json.loads(body)["error"]["type"] == "bad_request"
    assert vendor.count() == 0
    raw.close()


async def test_a_head_with_bare_lf_line_ends_is_answered_at_once(vendor, start_proxy):
    client = await start_proxy(one_route(vendor, header_timeout="30s"))
    raw = await Raw.to(client)
    await raw.send(b"GET /v/echo HTTP/1.1\nHost: p\n\n")
    async with asyncio.timeout(2):  # not after header_timeout
        status, _, _ = await raw.answer()
    assert status == 400 and vendor.count() == 0
    raw.close()


async def test_header_values_reach_the_vendor_without_trailing_whitespace(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    await raw.send(post("/v/echo", b"{}", "X-Trail: abc \t "))
    assert (await raw.answer())[0] == 200
    assert vendor.last.headers["X-Trail"] == "abc"
    raw.close()


async def test_a_204_carries_no_content_length(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    vendor.script(Fault.status(204, b""))
    raw = await Raw.to(client)
    await raw.send(post("/v/echo", b"{}"))
    head = await raw.reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 204 ") and b"content-length" not in head.lower()
    await raw.send(post("/v/echo", b'{"next": 1}'))  # the connection is still in step
    status, _, body = await raw.answer()
    assert status == 200 and echoed(body)["body"] == '{"next": 1}'
    raw.close()


@pytest.mark.parametrize("expect", ["", "Expect: 100-continue\r\n"], ids=["front", "aiohttp"])
async def test_a_streamed_answer_to_http10_ends_by_closing_the_connection(
    vendor, start_proxy, expect
):
    # HTTP/1.0 has no chunks: an answer without a Content-Length ends only when the connection
    # closes, so it must close, whatever keep-alive the request asked for. A request pipelined
    # behind it would otherwise have its answer read as more of the stream.
    client = await start_proxy(one_route(vendor))
    raw = await Raw.to(client)
    first = f"GET /v/sse HTTP/1.0\r\nConnection: keep-alive\r\n{expect}\r\n"
    await raw.send(first.encode() + b"GET /v/echo HTTP/1.0\r\n\r\n")
    async with asyncio.timeout(OPEN_S):
        everything = await raw.reader.read(-1)  # until the proxy closes: well before OPEN_S
    head, _, body = everything.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"content-length" not in head.lower()
    assert b"event: message" in body and b"HTTP/1." not in body  # the second request unanswered
    raw.close()

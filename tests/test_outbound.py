"""The upstream connection pool (proxy/outbound.py) against real servers on loopback: a raw
asyncio server that counts connections and answers scripted bytes, and aiohttp over TLS."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from proxy.app import STATE
from proxy.outbound import ConnectFailed, HeaderInjection, Origin, VendorPool, request_head
from testkit.certs import tls_files
from tests.conftest import route

BODY = b'{"results": []}'
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n" + BODY


@dataclass
class Server:
    """A loopback HTTP/1.1 server: each request (head and Content-Length body) is answered with
    `answers(request_head)`; it counts connections and keeps what it read."""

    answers: Callable[[bytes], bytes] = lambda head: OK
    connections: int = 0
    heads: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    asked: asyncio.Event = field(default_factory=asyncio.Event)  # a whole request arrived
    transports: list[asyncio.Transport] = field(default_factory=list)
    port: int = 0

    def protocol(self) -> asyncio.Protocol:
        server = self

        class Conn(asyncio.Protocol):
            def __init__(self) -> None:
                self.buffer = b""

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                server.connections += 1
                self.transport = transport
                server.transports.append(transport)  # type: ignore[arg-type]

            def data_received(self, data: bytes) -> None:
                self.buffer += data
                while b"\r\n\r\n" in self.buffer:
                    head, _, rest = self.buffer.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    if len(rest) < length:
                        return
                    self.buffer = rest[length:]
                    server.heads.append(head)
                    server.asked.set()
                    self.transport.write(server.answers(head))  # type: ignore[attr-defined]

            def connection_lost(self, exc: BaseException | None) -> None:
                server.closed.set()

        return Conn()


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    srv = Server()
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(srv.protocol, "127.0.0.1", 0)
    srv.port = listener.sockets[0].getsockname()[1]
    yield srv
    listener.close()
    for transport in srv.transports:
        transport.close()


@pytest.fixture
async def pool() -> AsyncIterator[VendorPool]:
    vendors = VendorPool(16, 8, keepalive_timeout=15.0)
    yield vendors
    vendors.close()


async def post(pool: VendorPool, origin: Origin, body: bytes = b"{}", method: str = "POST"):
    head = request_head(
        method, "/search", origin, [("Content-Type", "application/json")], len(body)
    )
    return await pool.send(origin, method, head, body, 5.0)


def origin_of(server: Server) -> Origin:
    return Origin.of(URL(f"http://127.0.0.1:{server.port}"))


async def test_sequential_requests_share_one_connection(server: Server, pool: VendorPool):
    origin = origin_of(server)
    for _ in range(5):
        answer = await post(pool, origin)
        assert answer.status == 200 and await answer.read() == BODY
    assert server.connections == 1 and len(server.heads) == 5
    assert pool.idle_connections == 1


async def test_concurrent_requests_open_one_connection_each(server: Server, pool: VendorPool):
    origin = origin_of(server)
    answers = await asyncio.gather(*(post(pool, origin) for _ in range(3)))
    assert [await a.read() for a in answers] == [BODY] * 3
    assert server.connections == 3 and pool.idle_connections == 3


async def test_an_answer_saying_connection_close_is_not_reused(server: Server, pool: VendorPool):
    server.answers = lambda head: OK.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
    origin = origin_of(server)
    for _ in range(2):
        answer = await post(pool, origin)
        assert await answer.read() == BODY
    assert server.connections == 2 and pool.idle_connections == 0


async def test_a_body_left_unread_closes_its_connection(server: Server, pool: VendorPool):
    big = b"x" * 200_000
    server.answers = lambda head: b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big
    origin = origin_of(server)
    answer = await post(pool, origin)
    await answer.content.read(10)
    answer.release()  # before its end: the rest would be read by the next request
    assert pool.idle_connections == 0
    await asyncio.wait_for(server.closed.wait(), 5)
    assert await (await post(pool, origin)).read() == big
    assert server.connections == 2


async def test_a_connection_the_upstream_closed_while_idle_is_not_used(
    server: Server, pool: VendorPool
):
    origin = origin_of(server)
    assert await (await post(pool, origin)).read() == BODY
    server.transports[0].close()
    for _ in range(100):  # the pool hears of it when the loop delivers the close
        if pool.idle_connections == 0:
            break
        await asyncio.sleep(0.01)
    assert pool.idle_connections == 0
    assert await (await post(pool, origin)).read() == BODY
    assert server.connections == 2


async def test_idle_connections_close_after_keepalive_timeout(server: Server):
    vendors = VendorPool(16, 8, keepalive_timeout=0.2)
    try:
        assert await (await post(vendors, origin_of(server))).read() == BODY
        assert vendors.idle_connections == 1
        await asyncio.wait_for(server.closed.wait(), 5)  # the pool closed it, not the server
        assert vendors.idle_connections == 0 and vendors.open_connections == 0
    finally:
        vendors.close()


async def test_keepalive_timeout_zero_never_reuses(server: Server):
    vendors = VendorPool(16, 8, keepalive_timeout=0)
    try:
        for _ in range(2):
            assert await (await post(vendors, origin_of(server))).read() == BODY
        assert server.connections == 2
    finally:
        vendors.close()


async def test_interim_answers_are_skipped(server: Server, pool: VendorPool):
    server.answers = lambda head: b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n" + OK
    answer = await post(pool, origin_of(server))
    assert answer.status == 200 and await answer.read() == BODY


async def test_head_answers_have_no_body_and_keep_the_connection(server: Server, pool: VendorPool):
    server.answers = lambda head: (
        b"HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n" if head.startswith(b"HEAD") else OK
    )
    origin = origin_of(server)
    answer = await post(pool, origin, b"", method="HEAD")
    assert answer.status == 200 and answer.content_length == 15 and await answer.read() == b""
    assert await (await post(pool, origin)).read() == BODY
    assert server.connections == 1


async def test_gzip_bodies_are_inflated(server: Server, pool: VendorPool):
    import gzip

    packed = gzip.compress(BODY)
    server.answers = lambda head: (
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(packed)
        + packed
    )
    answer = await post(pool, origin_of(server))
    assert await answer.read() == BODY


async def test_a_broken_status_line_is_an_http_error(server: Server, pool: VendorPool):
    server.answers = lambda head: b"HTTP/1.1 2x0 Nope\r\n\r\n"
    with pytest.raises(HttpProcessingError):
        await post(pool, origin_of(server))
    assert pool.idle_connections == 0


async def test_the_request_head_is_what_the_route_prepared(server: Server, pool: VendorPool):
    origin = origin_of(server)
    answer = await post(pool, origin, b'{"query": "a"}')
    await answer.read()
    head = server.heads[0].decode()
    assert head.splitlines() == [
        "POST /search HTTP/1.1",
        f"Host: 127.0.0.1:{server.port}",
        "Content-Type: application/json",
        "Accept: */*",
        "Accept-Encoding: gzip, deflate",
        "Content-Length: 14",
    ]


def test_host_headers_leave_out_default_ports_and_bracket_ipv6():
    assert Origin.of(URL("https://api.tavily.com:443")).host_header == "api.tavily.com"
    assert Origin.of(URL("http://example.com")).host_header == "example.com"
    assert Origin.of(URL("http://[::1]:8080")).host_header == "[::1]:8080"
    assert Origin.of(URL("https://example.com:8443")).host_header == "example.com:8443"


def test_bodiless_methods_send_no_length_and_post_says_zero():
    origin = Origin.of(URL("http://h"))
    assert b"Content-Length" not in request_head("GET", "/", origin, [], 0)
    assert b"Content-Length: 0\r\n" in request_head("POST", "/", origin, [], 0)
    assert b"Content-Type: application/octet-stream" in request_head("PUT", "/", origin, [], 3)
    mine = request_head("GET", "/", origin, [("accept-encoding", "identity")], 0)
    assert b"Accept-Encoding: gzip" not in mine and b"accept-encoding: identity" in mine


@pytest.mark.parametrize(
    "headers", [[("X-A", "1\r\nX-Injected: 2")], [("X-A\nB", "1")], [("X-A", "1\n")]]
)
def test_a_header_holding_cr_or_lf_is_refused(headers: list[tuple[str, str]]):
    with pytest.raises(HeaderInjection):
        request_head("GET", "/", Origin.of(URL("http://h")), headers, 0)


async def test_a_refused_connect_says_so(pool: VendorPool):
    probe = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    with pytest.raises(ConnectFailed) as caught:
        await post(pool, Origin.of(URL(f"http://127.0.0.1:{port}")))
    assert caught.value.kind == "refused" and isinstance(caught.value.os_error, OSError)


async def test_host_names_are_resolved_once_within_the_ttl(server: Server):
    asked: list[str] = []

    async def resolve(host: str, port: int) -> list[tuple[object, ...]]:
        asked.append(host)
        loop = asyncio.get_running_loop()
        return await loop.getaddrinfo("127.0.0.1", port)

    vendors = VendorPool(16, 8, keepalive_timeout=0, resolve=resolve)
    try:
        origin = Origin.of(URL(f"http://vendor.test:{server.port}"))
        for _ in range(3):
            assert await (await post(vendors, origin)).read() == BODY
        assert asked == ["vendor.test"] and server.connections == 3
        assert server.heads[0].splitlines()[1] == f"Host: vendor.test:{server.port}".encode()
    finally:
        vendors.close()


@pytest.fixture
async def tls_vendor() -> AsyncIterator[int]:
    files = tls_files()

    async def search(request: web.Request) -> web.Response:
        return web.json_response({"results": [], "sni": request.host})

    app = web.Application()
    app.router.add_post("/search", search)
    runner = web.AppRunner(app)
    await runner.setup()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.cert, files.key)
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    yield runner.addresses[0][1]
    await runner.cleanup()


async def test_https_upstreams_verify_the_certificate_and_reuse_connections(tls_vendor: int):
    trusted = ssl.create_default_context(cafile=tls_files().ca)
    vendors = VendorPool(16, 8, keepalive_timeout=15.0, ssl_context=trusted)
    try:
        origin = Origin.of(URL(f"https://localhost:{tls_vendor}"))
        for _ in range(3):
            answer = await post(vendors, origin)
            assert answer.status == 200
            assert (await answer.read()).startswith(b'{"results": []')
        assert vendors.open_connections == 1
    finally:
        vendors.close()


async def test_an_untrusted_certificate_fails_the_connect_as_tls(tls_vendor: int):
    vendors = VendorPool(16, 8, keepalive_timeout=15.0)  # the system's CAs: not the test CA
    try:
        with pytest.raises(ConnectFailed) as caught:
            await post(vendors, Origin.of(URL(f"https://localhost:{tls_vendor}")))
        assert caught.value.kind == "tls_certificate"
    finally:
        vendors.close()


async def test_a_proxy_with_https_routes_builds_the_tls_context_before_any_request(
    start_proxy: Any, tls_contexts_built: list[ssl.SSLContext]
):
    # Built at start-up (or reload), not in the first request to an https vendor.
    built = tls_contexts_built
    await start_proxy({"routes": {"plain": route("http://127.0.0.1:9", "/plain")}})
    assert built == []  # no https vendor, no context
    client = await start_proxy({"routes": {"t": route("https://api.tavily.com", "/t")}})
    assert len(built) == 1
    assert client.app[STATE].vendors.tls() is built[0]
    assert len(built) == 1


async def test_cancelling_a_request_closes_its_connection(server: Server, pool: VendorPool):
    server.answers = lambda head: b""  # never answers
    task = asyncio.create_task(post(pool, origin_of(server)))
    await asyncio.wait_for(server.asked.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(server.closed.wait(), 5)
    assert pool.idle_connections == 0 and pool.open_connections == 0


async def test_a_connection_lost_mid_body_is_a_payload_error(server: Server, pool: VendorPool):
    def cut(head: bytes) -> bytes:
        asyncio.get_running_loop().call_soon(server.transports[-1].close)
        return b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10

    server.answers = cut
    answer = await post(pool, origin_of(server))
    with pytest.raises(aiohttp.ClientPayloadError):
        await answer.read()

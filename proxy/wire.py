"""HTTP/1.1 on the agents' side of the front (proxy/front.py): a route request's head read into
the request the envelope reads, a whole answer's head written as aiohttp's StreamResponse would
write it (in one piece), and the limit on how long an agent may take to read what is written.

A head the front does not take raises `NotOurs`: aiohttp's server then reads it, bytes and all,
and answers it as it always did (its limits, its JSON errors).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import httptools
from aiohttp import web
from aiohttp.helpers import must_be_empty_body, rfc822_formatted_time, should_remove_content_length
from aiohttp.http import SERVER_SOFTWARE, HttpVersion, HttpVersion10, HttpVersion11
from aiohttp.http_parser import SINGLETON_HEADERS
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from policies.core.errors import seconds_text
from proxy.routing import target_parts

if TYPE_CHECKING:
    from proxy.front import AgentConnection
    from proxy.pipeline import Route
    from proxy.replay import Replays
    from proxy.routing import Router

# A head past these goes to aiohttp, whose limits answer it (its 400 says which).
MAX_HEAD_BYTES = 16 * 1024
WRITE_AT_ONCE = 16 * 1024  # a head and a body up to this are joined into one write
MAX_LINE_BYTES = 8190  # aiohttp's max_line_size and max_field_size
MAX_HEADERS = 128  # aiohttp's max_headers
# What a route takes natively; any other method (CONNECT, TRACE ...) goes to aiohttp's path.
NATIVE_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_VERSIONS = {b"HTTP/1.1": HttpVersion11, b"HTTP/1.0": HttpVersion10}
# Request headers that send the request to aiohttp's path: its framing or its protocol is not
# the front's (a chunked body, a 100-continue wait, a protocol switch).
_HANDED = frozenset({"transfer-encoding", "expect", "upgrade"})


class NotOurs(Exception):
    """The request is not the front's: aiohttp's server takes it, bytes and all."""


class AgentRequest:
    """A route request as the envelope and proxy_request read it: the attributes of aiohttp's
    Request they use, and what aiohttp's StreamResponse needs to stream an answer through
    this connection."""

    __slots__ = (
        "_url",
        "_writer",
        "app",
        "body",
        "content_length",
        "headers",
        "hit",
        "keep_alive",
        "method",
        "protocol",
        "raw_path",
        "version",
    )

    def __init__(
        self,
        protocol: AgentConnection,
        app: web.Application,
        method: str,
        raw_path: str,
        version: HttpVersion,
        headers: CIMultiDictProxy[str],
        content_length: int | None,
        keep_alive: bool,
    ) -> None:
        self.protocol = protocol
        self.app = app
        self.method = method
        self.raw_path = raw_path
        self.version = version
        self.headers = headers
        self.content_length = content_length
        self.keep_alive = keep_alive
        self._url: URL | None = None
        self._writer: StreamWriter | None = None
        self.body: bytes | None = None  # once read
        # Set by the route's handler when a fresh cache hit answered (the route's replays and
        # the hit's cache key and entry): the answer written is remembered for a replay.
        self.hit: tuple[Replays, tuple[str, Any]] | None = None

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.protocol.transport

    @property
    def remote(self) -> str | None:
        return self.protocol.remote

    @property
    def scheme(self) -> str:
        return "http"

    @property
    def url(self) -> URL:
        """The target as it is routed (`target_parts`), built as aiohttp's parser builds it;
        asked only for the access line."""
        if self._url is None:
            path, query = target_parts(self.raw_path)
            self._url = URL.build(path=path, query_string=query, encoded=True)
        return self._url

    @property
    def path(self) -> str:
        """The path, percent-decoded (as aiohttp's Request.path); one with nothing to decode
        is the target's own, without building the URL."""
        if self._url is None:
            path = target_parts(self.raw_path)[0]
            if "%" not in path:
                return path
        return self.url.path

    @property
    def query_string(self) -> str:
        """The query, percent-decoded (as aiohttp's Request.query_string); "" for a target
        without one, without building the URL."""
        if self._url is None and "?" not in self.raw_path:
            return ""
        return self.url.query_string

    async def read(self) -> bytes:
        """The whole body (its length is bounded by the handler before it asks)."""
        self.body = await self.protocol.body()
        return self.body

    # What aiohttp's StreamResponse.prepare() asks of a request it streams an answer to.
    @property
    def _payload_writer(self) -> StreamWriter:
        if self._writer is None:
            self._writer = StreamWriter(self.protocol, self.protocol.loop)
        return self._writer

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        return None

    def began_answer(self) -> bool:
        """Whether any of a streamed answer was written already."""
        return self._writer is not None and self._writer.output_size > 0


class _HeadReader:
    """llhttp's callbacks while one head is parsed: its headers, and whether it keeps the
    connection (read when the headers end: once the message is complete, llhttp's flags are
    the next message's)."""

    __slots__ = ("headers", "keep_alive", "parser")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive: bool | None = None
        self.parser = httptools.HttpRequestParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.parser.should_upgrade():
            raise NotOurs
        self.keep_alive = self.parser.should_keep_alive()


def read_head(
    head: bytes, protocol: AgentConnection, app: web.Application, router: Router[Route] | None
) -> tuple[AgentRequest, Route]:
    """The request a head (up to and with its blank line) asks, and the route of `router` it
    goes to, if the front takes it; else NotOurs."""
    line_end = head.find(b"\r\n")
    parts = head[:line_end].split(b" ")
    if len(parts) != 3 or line_end > MAX_LINE_BYTES:
        raise NotOurs
    method_b, target_b, version_b = parts
    version = _VERSIONS.get(version_b)
    method = method_b.decode("ascii", "replace")
    if version is None or method not in NATIVE_METHODS or not target_b.startswith(b"/"):
        raise NotOurs
    target = target_b.decode("utf-8", "surrogateescape")
    route = router.find(target.partition("?")[0]) if router is not None else None
    if route is None or route.config.has("mcp"):
        raise NotOurs  # the proxy's own endpoints, a 404, an MCP route
    reader = _HeadReader()
    try:
        reader.parser.feed_data(head)
    except httptools.HttpParserError:
        raise NotOurs from None
    if reader.keep_alive is None or len(reader.headers) > MAX_HEADERS:
        raise NotOurs  # not a whole head by llhttp's reading, or too many headers
    headers: CIMultiDict[str] = CIMultiDict()
    length: int | None = None
    for name_b, value_b in reader.headers:
        if len(name_b) + len(value_b) > MAX_LINE_BYTES:
            raise NotOurs  # aiohttp's limit on a field: its 400 says which
        name = name_b.decode("ascii", "surrogateescape")
        lower = name.lower()
        if lower in _HANDED or (lower in SINGLETON_HEADERS and name in headers):
            raise NotOurs  # aiohttp's parser refuses a second Host, Content-Type ...
        value = value_b.rstrip(b" \t").decode("utf-8", "surrogateescape")
        if lower == "content-length":
            if not value.isdigit() or not value.isascii():
                raise NotOurs  # aiohttp's parser refuses it in its words
            length = int(value)
        headers.add(name, value)
    request = AgentRequest(
        protocol, app, method, target, version, CIMultiDictProxy(headers), length, reader.keep_alive
    )
    return request, route


def connection_value(version: HttpVersion, keep_alive: bool) -> str | None:
    """The Connection header an answer says (None: none needed), as aiohttp's does."""
    if keep_alive:
        return "keep-alive" if version == HttpVersion10 else None
    return "close" if version == HttpVersion11 else None


def answer_head(
    request: AgentRequest, response: web.Response, body: bytes, keep_alive: bool
) -> tuple[bytes, bool]:
    """The head of a whole answer, and whether its body goes out (not for HEAD, 204, 304):
    the framing and default headers aiohttp's Response.prepare() adds, put in its headers."""
    method, status = request.method, response.status
    headers = response.headers
    if "Content-Length" in headers:
        if should_remove_content_length(method, status):
            del headers["Content-Length"]
    elif body or (status != 304 and method != "HEAD"):
        headers["Content-Length"] = str(len(body))
    empty = must_be_empty_body(method, status)
    if empty:
        headers.popall("Transfer-Encoding", None)
        if should_remove_content_length(method, status):
            headers.popall("Content-Length", None)
    elif body and "Content-Type" not in headers:
        headers["Content-Type"] = "application/octet-stream"
    if "Date" not in headers:
        headers["Date"] = rfc822_formatted_time()
    if "Server" not in headers:
        headers["Server"] = SERVER_SOFTWARE
    connection = None
    if "Connection" not in headers:
        connection = connection_value(request.version, keep_alive)
    head = response_head(request.version, status, response.reason, headers.items(), connection)
    return head, not empty and bool(body)


def response_head(
    version: HttpVersion,
    status: int,
    reason: str,
    headers: Iterable[tuple[str, str]],
    connection: str | None = None,
) -> bytes:
    """Status line, headers (and `Connection: connection`, when given) and the blank line."""
    lines = [f"HTTP/{version[0]}.{version[1]} {status} {reason}\r\n"]
    lines += [f"{name}: {value}\r\n" for name, value in headers]
    if connection is not None:
        lines.append(f"Connection: {connection}\r\n")
    lines.append("\r\n")
    head = "".join(lines)
    # Every header the proxy writes is checked before (config, the vendor's by
    # response_headers); a CR or LF that slipped through would split the answer.
    if head.count("\n") != len(lines) or head.count("\r") != len(lines):
        raise ValueError("a response header holds CR or LF")
    return head.encode("utf-8", "surrogateescape")


class SendTimeout(ConnectionResetError):
    """The agent read nothing of its answer for server.send_timeout; its connection is dropped."""


class Cuttable(Protocol):
    """An agent's connection as the send limit sees it."""

    cut: str | None
    transport: asyncio.Transport | None

    @property
    def writing_paused(self) -> bool: ...


async def drain_in_time(
    conn: Cuttable, drain: Callable[[], Awaitable[None]], send_timeout: float
) -> None:
    """`drain` (the protocol's wait for the agent to read), at most send_timeout: then the
    connection is dropped with what it buffered (`SendTimeout`), so a slow reader holds at most
    the transport's write buffer."""
    if not conn.writing_paused or conn.transport is None:
        await drain()
        return
    try:
        async with asyncio.timeout(send_timeout):
            await drain()
    except TimeoutError:
        conn.cut = "send_timeout"
        if conn.transport is not None:
            conn.transport.abort()  # close() would wait for the agent to read the buffer
        raise SendTimeout(f"the agent read nothing for {seconds_text(send_timeout)}") from None


async def prepare_stream(response: web.StreamResponse, request: web.BaseRequest) -> None:
    """Prepare a streamed answer. Without a Content-Length, an HTTP/1.0 answer (which has no
    chunks) ends only when the connection closes: it closes after this one. aiohttp's
    prepare() writes such a head without keep-alive but leaves the connection open, so the
    next answer would be read as more of this body."""
    if request.version < HttpVersion11 and "Content-Length" not in response.headers:
        response.force_close()
    await response.prepare(request)

"""The proxy's connections to its upstreams: pooled HTTP/1.1 keep-alive connections per origin,
request heads written here, answers read by aiohttp's own response protocol.

aiohttp's ClientSession spends most of a forwarded request's time on what a proxy does not use:
a URL object, a ClientRequest with its payload and auto-headers, a ClientResponse, cookie
jar, tracing and timer contexts, the connector's key lookups, a task to write the body
(`bench/core.py`: the bare forwarder spends about half its CPU there). Here a request is one
head built from strings the route prepared, one write, and aiohttp's `ResponseHandler` on the
connection: its C parser, its decompression (inflated only as fast as the body is read), its
framing checks and its exceptions, so every way an answer can be broken is caught exactly as
before (proxy/forward.py maps them to our errors).

What the pool guarantees: connections per origin are reused last-in first-out and closed once
idle for `keepalive_timeout` (0: never reused); host names are resolved at most every
DNS_TTL_S; the connect (resolution, TCP, TLS) has the caller's timeout. How many connections
may be busy at once is proxy/pool.py's (`PoolSlots`), held by the caller around each request.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohappyeyeballs
from aiohttp.client_proto import ResponseHandler
from aiohttp.http import RawResponseMessage
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader
from multidict import CIMultiDictProxy
from yarl import URL

from proxy.pool import PoolSlots
from proxy.wire import WRITE_AT_ONCE

# A host's addresses as loop.getaddrinfo gives them: (family, type, proto, canonname, address).
AddrInfo = tuple[Any, ...]
Resolve = Callable[[str, int], Awaitable[list[AddrInfo]]]
DNS_TTL_S = 300.0  # how long a host name's addresses are used before asking again
HAPPY_EYEBALLS_S = 0.25  # an address that has not connected by then gets the next one tried too
READ_BUFSIZE = 16 * 1024  # the parser's read limit: what of a body is buffered before pausing
# Interim (1xx) answers read past before the real one: 100 Continue, 103 Early Hints (which a
# server may send more than once). More is no vendor answering but a peer flooding us: aiohttp
# parses every head a read holds and queues each until it is read (it pauses for bodies only),
# so `send` refuses the next one and drops the connection with what was queued.
MAX_INTERIM = 8
# A request of these methods carries no body unless it has one; any other says Content-Length: 0
# when empty (as aiohttp did: some servers refuse a POST without a length).
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# Headers the proxy writes itself on every request unless the route's request has them.
_DEFAULTS = (
    ("accept", "Accept: */*\r\n"),
    ("accept-encoding", "Accept-Encoding: gzip, deflate\r\n"),
)


class ConnectFailed(Exception):
    """No connection to the origin: `kind` is "timeout", "dns", "tls_certificate", "tls" or
    "refused" (any other socket error); `os_error` is the cause where there is one."""

    def __init__(self, kind: str, os_error: OSError | None = None) -> None:
        super().__init__(kind)
        self.kind = kind
        self.os_error = os_error


class HeaderInjection(ValueError):
    """A header name or value holds CR or LF: written, it would split the request."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a route's requests go: scheme, host, port, and the Host header it gets."""

    scheme: str
    host: str
    port: int
    tls: bool
    host_header: str

    @classmethod
    def of(cls, url: URL) -> Origin:
        """The origin of an http(s) `url`; its Host header as aiohttp wrote it (an IPv6
        literal bracketed, the scheme's default port left out)."""
        host, port = url.raw_host, url.port
        if host is None or port is None:
            raise ValueError(f"{url} names no host and port")
        return cls(
            url.scheme, host, port, url.scheme == "https", url.host_port_subcomponent or host
        )


def request_head(
    method: str, target: str, origin: Origin, headers: Iterable[tuple[str, str]], body_len: int
) -> bytes:
    """The request line and headers of one request: `headers` as given (the route's outbound
    headers, never Host, Content-Length or the framing), then what the proxy owns."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {origin.host_header}\r\n"]
    seen: set[str] = set()
    for name, value in headers:
        lines.append(f"{name}: {value}\r\n")
        seen.add(name.lower())
    for name, line in _DEFAULTS:
        if name not in seen:
            lines.append(line)
    if body_len or method not in _BODILESS:
        if body_len and "content-type" not in seen:
            lines.append("Content-Type: application/octet-stream\r\n")
        lines.append(f"Content-Length: {body_len}\r\n")
    lines.append("\r\n")
    head = "".join(lines)
    # Two CRLFs end the head; any other CR or LF came from a name or value (the agent's header
    # parser and config refuse them, so this only stops a bug from splitting a request).
    if head.count("\n") != len(lines) + 1 or head.count("\r") != len(lines) + 1:
        raise HeaderInjection("a header name or value holds CR or LF")
    return head.encode("utf-8", "surrogateescape")


def _not_final(code: int) -> str:
    """Why an answer with status `code` is no answer to the request (RFC 9110 15: a status
    outside 100-599 is invalid; a 101 switches to a protocol the proxy never asked for)."""
    if code == 101:
        return "a 101 Switching Protocols the proxy did not ask for"
    if 100 <= code <= 199:
        return f"more than {MAX_INTERIM} interim (1xx) answers before the answer"
    return f"status {code}, outside 100-599"


def _codings(values: list[str]) -> list[str]:
    """The codings a Transfer-Encoding or Content-Encoding names, every line of it, in order,
    lower case, identity left out (it changes nothing)."""
    found = (c.strip().lower() for value in values for c in value.split(","))
    return [c for c in found if c not in ("", "identity")]


def _check_codings(name: str, values: list[str], read: str | None) -> None:
    """Refuse an answer whose `name` header (every line of it) names codings other than
    exactly the one aiohttp's parser `read` (None: none). Transfer-Encoding: aiohttp reads
    chunks and no coding besides (`gzip, chunked` would go on still compressed, unlabelled),
    and takes chunked from the last coding only (`chunked, identity` is read to the close,
    chunk sizes and all). Content-Encoding: a coding it does not decode (`x-gzip`) or more
    than one (`gzip` twice: it decodes one) would go on past the echo guard unread."""
    if _codings(values) != ([read] if read else []):
        shown = ", ".join(values)[:60]
        raise HttpProcessingError(
            message=f"{name} {shown!r}: the proxy reads chunks, gzip or deflate, each once"
        )


class Answer:
    """One upstream answer: status, headers and the body as aiohttp's StreamReader (`content`).
    The connection goes back to the pool once the body is read to its end (or `release()` after
    it is), and is closed by `close()` or a `release()` before the end."""

    __slots__ = ("_conn", "content", "headers", "method", "status")

    def __init__(
        self,
        conn: VendorConnection,
        message: RawResponseMessage,
        content: StreamReader,
        method: str,
    ) -> None:
        self._conn: VendorConnection | None = conn
        self.status: int = message.code
        self.headers: CIMultiDictProxy[str] = message.headers
        self.content = content
        self.method = method
        if content.is_eof():
            self._done()
        else:
            content.on_eof(self._done)

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            return None  # aiohttp's parser refuses a bad one before here

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters; aiohttp's default when absent."""
        value = self.headers.get("Content-Type")
        if value is None:
            return "application/octet-stream"
        return value.partition(";")[0].strip().lower()

    async def read(self) -> bytes:
        """The whole (decoded) body; the connection is back in the pool after it."""
        body = await self.content.read()
        self._done()
        return body

    def release(self) -> None:
        """Done with the answer: its connection is reused if the body was read to the end and
        the upstream keeps it alive, else closed."""
        self._done()

    def close(self) -> None:
        """Drop the connection now, whatever was read (a cancelled or refused answer)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _done(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.pool.give_back(conn)


class VendorConnection(ResponseHandler):
    """aiohttp's response protocol, on a connection owned by a `VendorPool`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: VendorPool, origin: Origin) -> None:
        super().__init__(loop)
        self.pool = pool
        self.origin = origin
        self.idle_since = 0.0
        self.idle = False  # in the pool, between requests

    def data_received(self, data: bytes) -> None:
        if self.idle and data:  # (b"": a reader resuming the parser)
            # Bytes nobody asked for: whatever they are, they must never be read as the next
            # request's answer (it could be another agent's). This holds while the connection
            # sits idle; a stray answer that arrives after it was taken again is, to HTTP/1.1,
            # the new request's answer, and no client can tell the two apart.
            self.close()
            return
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self.pool.gone(self)


class VendorPool:
    """Keep-alive connections to the upstreams, by origin, and the slots (`slots`) that bound
    how many are busy at once: `limit` in all, `limit_per_host` to one origin (0: no bound)."""

    def __init__(
        self,
        limit: int,
        limit_per_host: int,
        keepalive_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
        resolve: Resolve | None = None,
    ) -> None:
        """`resolve` replaces the system's DNS (tests)."""
        self._loop = asyncio.get_running_loop()
        self.slots = PoolSlots(limit, limit_per_host)
        self.keepalive_timeout = keepalive_timeout
        self._ssl = ssl_context
        self._idle: dict[Origin, deque[VendorConnection]] = {}
        self._live: set[VendorConnection] = set()
        self._resolver = resolve or self._getaddrinfo
        self._dns: dict[tuple[str, int], tuple[float, list[AddrInfo]]] = {}
        self._lookups: dict[tuple[str, int], asyncio.Task[list[AddrInfo]]] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._live)

    @property
    def idle_connections(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    async def send(
        self,
        origin: Origin,
        method: str,
        head: bytes,
        body: bytes,
        connect_timeout: float | None,
    ) -> Answer:
        """Send one request on a pooled (or new) connection and read its answer's head.

        Raises ConnectFailed when no connection can be made; after that, what aiohttp's
        protocol raises: HttpProcessingError for an answer that is not HTTP, a
        ClientConnectionError (ServerDisconnectedError, ClientOSError ...) when the connection
        ends before a whole head. Cancelled, the connection is closed."""
        conn = self._take(origin)
        if conn is None:
            conn = await self._connect(origin, connect_timeout)
        # read_until_eof: an answer with neither a length nor chunks ends when the upstream
        # closes (HTTP/1.0, `Connection: close`); read to then, as aiohttp's session did.
        conn.set_response_params(
            skip_payload=method == "HEAD",
            read_until_eof=True,
            read_bufsize=READ_BUFSIZE,
            auto_decompress=True,
        )
        transport = conn.transport
        assert transport is not None  # taken connected
        try:
            if len(body) <= WRITE_AT_ONCE:
                transport.write(head + body if body else head)
            else:
                transport.writelines((head, body))  # no copy of a large body
            interim = 0
            while True:
                message, payload = await conn.read()
                code = message.code
                if 200 <= code <= 599:
                    break
                # 1xx interim answers (100 Continue, 103 Early Hints) precede the real one.
                if not 100 <= code <= 199 or code == 101 or interim == MAX_INTERIM:
                    raise HttpProcessingError(message=_not_final(code))
                interim += 1
            headers = message.headers
            if "Transfer-Encoding" in headers:
                framing = "chunked" if message.chunked else None
                _check_codings("Transfer-Encoding", headers.getall("Transfer-Encoding"), framing)
            if "Content-Encoding" in headers:
                coding = message.compression  # what aiohttp decodes the body from
                _check_codings("Content-Encoding", headers.getall("Content-Encoding"), coding)
        except BaseException:
            conn.close()
            raise
        return Answer(conn, message, payload, method)

    def _take(self, origin: Origin) -> VendorConnection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        oldest_kept = self._loop.time() - self.keepalive_timeout
        while idle:
            conn = idle.pop()  # the most recently used: the likeliest still open upstream
            conn.idle = False
            if conn.is_connected() and not conn.should_close and conn.idle_since > oldest_kept:
                return conn
            conn.close()
        return None

    def give_back(self, conn: VendorConnection) -> None:
        """A connection whose answer is done: kept for the next request to its origin, or
        closed when it cannot serve one (the upstream closes it, the body was not read to its
        end, reuse is off)."""
        if (
            self._closed
            or self.keepalive_timeout <= 0
            or conn.should_close
            or not conn.is_connected()
        ):
            conn.close()
            return
        conn.idle_since = self._loop.time()
        conn.idle = True
        self._idle.setdefault(conn.origin, deque()).append(conn)
        if self._sweep is None:
            self._sweep = self._loop.call_later(self.keepalive_timeout, self._sweep_idle)

    def gone(self, conn: VendorConnection) -> None:
        """The connection closed (either side): forget it."""
        self._live.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle:
            try:
                idle.remove(conn)
            except ValueError:
                pass

    def _sweep_idle(self) -> None:
        """Close connections idle for keepalive_timeout; again later while any are idle."""
        self._sweep = None
        oldest_kept = self._loop.time() - self.keepalive_timeout
        for idle in list(self._idle.values()):
            while idle and idle[0].idle_since <= oldest_kept:
                idle.popleft().close()
        if any(self._idle.values()):
            self._sweep = self._loop.call_later(self.keepalive_timeout, self._sweep_idle)

    async def _connect(self, origin: Origin, within: float | None) -> VendorConnection:
        try:
            async with asyncio.timeout(within):
                return await self._open(origin)
        except TimeoutError:
            raise ConnectFailed("timeout") from None

    async def _open(self, origin: Origin) -> VendorConnection:
        addresses = await self._resolve(origin.host, origin.port)
        try:
            # The addresses in turn, the next one started while one is slow (RFC 8305), as
            # aiohttp's connector does: one address that drops SYNs does not stall them all.
            sock = await aiohappyeyeballs.start_connection(
                addresses, happy_eyeballs_delay=HAPPY_EYEBALLS_S, interleave=1, loop=self._loop
            )
        except OSError as exc:
            raise ConnectFailed("refused", exc) from None
        tls = self.tls() if origin.tls else None
        try:
            _, conn = await self._loop.create_connection(
                lambda: VendorConnection(self._loop, self, origin),
                sock=sock,
                ssl=tls,
                # A host name's trailing dot is no part of the name its certificate carries.
                server_hostname=origin.host.rstrip(".") if tls is not None else None,
            )
        except ssl.SSLCertVerificationError as exc:
            sock.close()
            raise ConnectFailed("tls_certificate", exc) from None
        except ssl.SSLError as exc:
            sock.close()
            raise ConnectFailed("tls", exc) from None
        except OSError as exc:  # reset during the handshake
            sock.close()
            raise ConnectFailed("refused", exc) from None
        except BaseException:
            sock.close()
            raise
        if self._closed:
            conn.close()
            raise ConnectFailed("refused", ConnectionRefusedError("the proxy is stopping"))
        self._live.add(conn)
        return conn

    async def _getaddrinfo(self, host: str, port: int) -> list[AddrInfo]:
        return await self._loop.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_ADDRCONFIG
        )

    async def _resolve(self, host: str, port: int) -> list[AddrInfo]:
        """The host's addresses, from the cache while fresh (rotated at each use, so new
        connections spread over them); one lookup per host at a time, whoever waits on it."""
        key = (host, port)
        known = self._dns.get(key)
        if known is not None and known[0] > self._loop.time():
            found = known[1]
            if len(found) > 1:
                found.append(found.pop(0))
            return list(found)
        lookup = self._lookups.get(key)
        if lookup is None:
            lookup = self._lookups[key] = self._loop.create_task(self._lookup(host, port))
            lookup.add_done_callback(self._lookup_done)
        # A caller that gives up does not cancel the lookup the others wait on.
        return list(await asyncio.shield(lookup))

    def _lookup_done(self, lookup: asyncio.Task[list[AddrInfo]]) -> None:
        for key, running in list(self._lookups.items()):
            if running is lookup:
                del self._lookups[key]
        if not lookup.cancelled():
            lookup.exception()  # retrieved: every waiter may have given up

    async def _lookup(self, host: str, port: int) -> list[AddrInfo]:
        try:
            found = await self._resolver(host, port)
        except OSError as exc:
            raise ConnectFailed("dns", exc) from None
        found = [info for info in found if info[1] == socket.SOCK_STREAM]
        if not found:
            raise ConnectFailed("dns", socket.gaierror(socket.EAI_NONAME, "no address"))
        self._dns[(host, port)] = (self._loop.time() + DNS_TTL_S, list(found))
        return found

    def tls(self) -> ssl.SSLContext:
        """The upstreams' TLS context, built on first use. Building it loads the system's CA
        bundle, ~50 ms of CPU on OpenSSL 3 in which the loop serves nothing, so an `Upstream`
        to an https origin asks for it when its route is built: no request pays it."""
        if self._ssl is None:
            context = ssl.create_default_context()
            context.set_alpn_protocols(["http/1.1"])
            self._ssl = context
        return self._ssl

    def close(self) -> None:
        """Close every connection (at shutdown); answers still being read fail as closed."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._live):
            conn.close()
        self._idle.clear()
        for lookup in self._lookups.values():
            lookup.cancel()

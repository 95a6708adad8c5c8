"""Forwarding one attempt to a route's upstream over the process's pooled connections
(proxy/outbound.py).

The upstream URL is built from the route's configured scheme, host and port, never from the
request, so nothing a caller sends can steer a request to another host. Every way the exchange
can fail is translated here, at the boundary, into one of our error types.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import aiohttp
import structlog
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from policies import faults
from policies.backoff import attempt_timeout
from policies.core.clock import Clock
from policies.core.errors import (
    AnswerTooCostly,
    AttemptFailed,
    BadRequest,
    DeadlineExceeded,
    MemoryBudgetFull,
    OutOfTime,
    ProxyError,
    StreamCut,
    UpstreamInvalidResponse,
    UpstreamPoolExhausted,
    UpstreamTimeout,
    UpstreamTooLarge,
    UpstreamUnreachable,
    seconds_text,
)
from policies.core.flow import Flow, Reply
from policies.core.memory import Hold, holding, parse_cost
from policies.core.outcome import Outcome
from proxy.budget import giving_back, over_budget
from proxy.config import RouteConfig
from proxy.headers import response_headers
from proxy.logs import LEVEL
from proxy.outbound import Answer, ConnectFailed, HeaderInjection, Origin, VendorPool, request_head
from proxy.pool import PoolFull, Slot
from proxy.redact import redact_bytes
from proxy.redirects import FOLLOWED, MAX_HOPS, agent_location, on_upstream

log = structlog.get_logger("search_proxy")

# Never sent to a vendor, on any route: the agent's request for an injected fault
# (policies/faults.py reads it in the chain; a route without fault injection ignores it).
_NEVER_SENT = faults.HEADER
RELAY_BYTES = 64 * 1024  # the most of a streamed answer handed on at once
STREAM_TYPES = ("text/event-stream", "application/x-ndjson", "application/stream+json")
_NO_BODY = frozenset({204, 304})  # statuses whose answers never carry a body (RFC 9110 6.4.1)


# The most of an answer's head read (Envoy's max_response_headers_kb is 60): the parser takes
# 128 headers of 8 KiB, and a head lives, parsed and copied for the agent, as long as its answer
# (a stream's, up to timeouts.stream). With at most FEW_HEADERS it cannot come near, uncounted.
MAX_HEAD_BYTES = 64 * 1024
FEW_HEADERS = 8


def head_size(headers: CIMultiDictProxy[str]) -> int:
    return sum(len(name) + len(value) for name, value in headers.items())


def is_stream(resp: Answer) -> bool:
    """Stream event streams, and chunked bodies that are not JSON; buffer everything else.

    JSON answers are read whole so the cache and search recovery can inspect them.
    """
    ctype = resp.content_type
    if ctype in STREAM_TYPES:
        return True
    return resp.content_length is None and "json" not in ctype and resp.method != "HEAD"


def duration_text(seconds: float) -> str:
    """A duration as config spells it when it is whole minutes or hours (5m, 1h), else as
    `seconds_text` does (10s, 1.5s)."""
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and float(seconds / size).is_integer():
            return f"{int(seconds // size)}{unit}"
    return seconds_text(seconds)


def _one_line(text: str, limit: int = 100) -> str:
    """aiohttp's parser message as one short line (it spans lines and quotes the raw bytes)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


class Upstream:
    """The end of a route's chain: one HTTP attempt against the configured upstream."""

    def __init__(
        self,
        route: RouteConfig,
        vendors: VendorPool,
        clock: Clock,
        observe: Callable[[float], None] | None = None,
    ) -> None:
        base = URL(route.upstream)
        self.observe = observe
        self.route = route.name
        self.vendors = vendors
        self.clock = clock
        if base.host is None:
            raise ValueError(f"{route.name}: upstream {route.upstream!r} has no host")
        self.scheme, self.host, self.port = base.scheme, base.host, base.explicit_port
        self.origin = Origin.of(base)  # routes to one origin share its connections
        if self.origin.tls:
            vendors.tls()  # built with the route, not in the first request to an https vendor
        self.base_path = base.raw_path.rstrip("/")
        self.per_try = route.timeouts.per_try
        self.total = route.timeouts.total
        self.connect = route.timeouts.connect
        # No read timeout: an attempt's budget bounds the headers and a buffered body, and a
        # stream's gaps and age have limits of their own (timeouts.idle, timeouts.stream).
        self.idle = route.timeouts.idle
        self.stream_limit = route.timeouts.stream
        self.max_bytes = route.max_response_bytes
        self.slots = vendors.slots
        self.prefix = (route.prefix, route.strip_prefix)  # where Location points for the agent
        # An MCP client may not follow a redirect (or only within its origin): an MCP route
        # follows the upstream's own 307/308 itself.
        self.follow = route.has("mcp")

    def url(self, flow: Flow) -> URL:
        """The upstream URL for a flow: the route's origin, base path and the confined path."""
        path = self.base_path + flow.request.path
        return URL.build(
            scheme=self.scheme,
            host=self.host,
            port=self.port,
            path=path or "/",
            query_string=flow.request.query_string,
            encoded=True,
        )

    async def __call__(self, flow: Flow) -> Reply:
        hops = 0
        while True:
            reply = await self._once(flow)
            location = reply.headers.get("Location", "")
            target = on_upstream(location, self.url(flow), self.base_path) if location else None
            if target is None:
                return reply
            if not (self.follow and reply.status in FOLLOWED and hops < MAX_HOPS):
                # Not followed: the agent is sent to the route, never to the upstream itself.
                reply.headers["Location"] = agent_location(target, *self.prefix) or location
                return reply
            reply.discard()  # followed here, with the route's headers, to the same upstream
            hops += 1
            flow = flow.with_request(replace(flow.request, path=target[0], query_string=target[1]))

    async def _once(self, flow: Flow) -> Reply:
        budget = self._budget(flow)
        slot = await self._slot(flow, budget)
        started = self.clock.now()
        result: int | str = "cancelled"
        try:
            reply = await self._exchange(flow, self._budget(flow), slot)
            result = reply.status
            return reply
        except ProxyError as err:
            result = err.type
            raise
        finally:
            slot.release()  # a no-op once a streamed reply took it over
            # Each vendor call at debug: its route, method and status or failure, never its URL
            # (a query may carry a key) or headers. Not even built at other levels.
            if LEVEL.debug:
                log.debug(
                    "upstream_call",
                    request_id=flow.request.request_id,
                    route=self.route,
                    method=flow.request.method,
                    result=result,
                    ms=round((self.clock.now() - started) * 1000, 1),
                )

    def _budget(self, flow: Flow) -> float:
        """Seconds this attempt may take; OutOfTime when none are left."""
        budget = attempt_timeout(self.clock.now(), flow.context.deadline, self.per_try)
        if budget <= 0:
            before = max(0, flow.attempt - 1)
            raise OutOfTime(
                f"{self.route}: total deadline of {seconds_text(self.total)} exceeded after "
                f"{before} attempt(s); try again shortly",
                route=self.route,
                attempts=before,
            )
        return budget

    async def _slot(self, flow: Flow, budget: float) -> Slot:
        """Wait for room in the connection pool, at most the connect timeout."""
        wait = min(self.connect, budget)
        started = self.clock.now()
        try:
            return await self.slots.acquire(self.origin, wait)
        except PoolFull as full:
            if full.scope == "host":
                what = f"all {full.limit} connections to its upstream host are busy"
                setting = "server.upstream_connections_per_host"
            else:
                what = f"all {full.limit} upstream connections of the proxy are busy"
                setting = "server.upstream_connections"
            raise UpstreamPoolExhausted(
                f"{self.route}: {what} (waited {seconds_text(wait)} for one); "
                f"raise {setting} or retry in 1s",
                route=self.route,
                attempts=max(0, flow.attempt - 1),
                retry_after_s=1.0,
            ) from None
        finally:
            flow.trace.waited_seconds += self.clock.now() - started

    def target(self, flow: Flow) -> str:
        """The request target sent upstream: the route's base path, the confined path, the
        query (all as the agent encoded them)."""
        request = flow.request
        path = self.base_path + request.path or "/"
        return f"{path}?{request.query_string}" if request.query_string else path

    async def _exchange(self, flow: Flow, budget: float, slot: Slot) -> Reply:
        """One request and its answer; every failure leaves as one of our error types."""
        now = self.clock.now()
        request = flow.request
        resp: Answer | None = None
        try:
            async with asyncio.timeout(budget):
                outbound = request.headers
                if _NEVER_SENT in outbound:
                    outbound = outbound.copy()
                    outbound.popall(_NEVER_SENT)
                head = request_head(
                    request.method,
                    self.target(flow),
                    self.origin,
                    outbound.items(),
                    len(request.body),
                )
                resp = await self.vendors.send(
                    self.origin, request.method, head, request.body, self.connect
                )
                if len(resp.headers) > FEW_HEADERS and head_size(resp.headers) > MAX_HEAD_BYTES:
                    raise self._head_too_large(flow)
                headers = response_headers(resp.headers)
                # A HEAD's, a 204's or a 304's Content-Length is the size a body would have had.
                head_only = request.method == "HEAD"
                bodiless = head_only or resp.status in _NO_BODY
                declared = None if bodiless else resp.content_length
                if declared is not None and declared > self.max_bytes:
                    raise self._too_large(flow, declared)
                if is_stream(resp):
                    return self._streamed(flow, resp, headers, slot)
                hold = holding()
                # Of an answer of unknown length, at least a first read's worth must fit.
                reserved = declared or 0
                if hold is not None and not hold.take(reserved or RELAY_BYTES):
                    if "json" not in resp.content_type:  # nothing reads it: passed through
                        return self._streamed(flow, resp, headers, slot)
                    raise over_budget(self.route, flow.attempt, hold)
                body = await self._read(flow, resp, hold, reserved or RELAY_BYTES)
                held = len(body) + self._charge_parse(flow, body, hold)
                # Dropped (a retried or losing attempt), it gives its bytes back at once. A HEAD's
                # answer has no body to read: its status is all a classifier can go by.
                return Reply(
                    resp.status,
                    headers,
                    body,
                    release=giving_back(hold, held),
                    outcome=Outcome.of_status(resp.status) if head_only else None,
                )
        except (AttemptFailed, MemoryBudgetFull):
            if resp is not None:
                resp.close()
            raise
        except asyncio.CancelledError:
            # A hedge that lost, or an agent that left: close the half-read answer now, so its
            # connection leaves the pool at once instead of when the response is collected.
            if resp is not None:
                resp.close()
            raise
        except ConnectFailed as failed:
            raise self._connect_failed(flow, failed) from None
        except HeaderInjection:
            raise BadRequest(
                f"{self.route}: a header of this request holds a line break (CR or LF); send "
                "each header on one line",
                route=self.route,
            ) from None
        except TimeoutError:
            if resp is not None:
                resp.close()
            raise self._timeout(flow, budget) from None
        except HttpProcessingError as exc:
            # The answer's head is not valid HTTP (status line, headers, framing).
            raise self._broken(flow, exc) from None
        except aiohttp.ClientPayloadError as exc:
            # A body's broken framing or encoding (chunk size, gzip ...), or a body cut short
            # of its declared length.
            if resp is not None:
                resp.close()
            raise self._broken(flow, exc) from None
        except aiohttp.ClientError as exc:
            # After a connection was made (connect failures are caught above): disconnects,
            # resets while sending or reading (ClientConnectionResetError is no ClientOSError).
            if resp is not None:
                resp.close()
            raise UpstreamUnreachable(
                f"{self.route}: the upstream closed the connection before a complete answer "
                f"({type(exc).__name__}) {flow.attempt_text}; try again shortly",
                route=self.route,
                attempts=flow.attempt,
                outcome=Outcome.RESET,
            ) from None
        finally:
            elapsed = self.clock.now() - now
            flow.trace.upstream_seconds += elapsed
            if self.observe is not None:
                self.observe(elapsed)

    def _connect_failed(self, flow: Flow, failed: ConnectFailed) -> UpstreamUnreachable:
        """The error for a connection that could not be made, by why."""
        if failed.kind == "timeout":
            return self._no_connection(
                flow,
                f"cannot connect to the upstream within {seconds_text(self.connect)} "
                f"{flow.attempt_text}; try again shortly or use another provider",
                f"no connection within {seconds_text(self.connect)}",
            )
        if failed.kind == "dns":
            return self._no_connection(
                flow,
                f"the upstream's host name does not resolve ({_os_reason(failed.os_error)});"
                " this is the proxy's DNS or its route config, not a passing fault: retrying"
                " will not help; check the route's upstream and the proxy's DNS, or use another"
                " provider",
                "host name does not resolve",
                transient=False,
            )
        if failed.kind in ("tls_certificate", "tls"):
            what = "certificate not trusted" if failed.kind == "tls_certificate" else "TLS error"
            return self._no_connection(
                flow,
                f"the TLS handshake with the upstream failed ({what});"
                " retrying will not help; check the route's upstream scheme and port and the"
                " proxy's CA certificates, or use another provider",
                "TLS handshake failed",
                transient=False,
            )
        return UpstreamUnreachable(
            f"{self.route}: cannot connect to the upstream ({_os_reason(failed.os_error)}) "
            f"{flow.attempt_text}; try again shortly or use another provider",
            route=self.route,
            attempts=flow.attempt,
            outcome=Outcome.CONNECT_ERROR,
        )

    async def _read(self, flow: Flow, resp: Answer, hold: Hold | None, held: int) -> bytes:
        """The whole (decoded) body, read chunk by chunk and never past `max_bytes` nor past
        the memory budget (`hold`, of which `held` bytes are taken for it already).

        aiohttp inflates a compressed body only as fast as it is read, so stopping here also
        stops the inflating: a gzip bomb costs at most the limit.
        """
        if resp.content_length is not None and "Content-Encoding" not in resp.headers:
            # Its declared length, checked against the limit already, is all there is to read.
            return await resp.read()
        body = bytearray()
        try:
            async for chunk in resp.content.iter_any():
                size = len(body) + len(chunk)
                if size > self.max_bytes:
                    raise self._too_large(flow)
                if hold is not None and size > held:
                    if not hold.take(size - held):
                        raise over_budget(self.route, flow.attempt, hold)
                    held = size
                body += chunk
        except BaseException:
            # Nothing of it is kept: its bytes go now, not when the collector finds the frame
            # this exception's traceback keeps alive.
            body.clear()
            if hold is not None:
                hold.give(held)
            raise
        resp.release()
        if hold is not None and held > len(body):
            hold.give(held - len(body))  # less came than was set aside for it
        return bytes(body)

    def _charge_parse(self, flow: Flow, body: bytes, hold: Hold | None) -> int:
        """Charge `hold` what a large JSON answer will take once the policies parse it, beyond
        its bytes (held already), and return it: past the whole budget an AnswerTooCostly, past
        what is free now a MemoryBudgetFull."""
        cost = parse_cost(body) if hold is not None else 0
        if not cost or hold is None or hold.take(cost):
            return cost
        hold.give(len(body))
        need = len(body) + cost
        if need <= hold.budget.limit:
            raise over_budget(self.route, flow.attempt, hold)
        raise AnswerTooCostly(
            f"{self.route}: the upstream's answer of {len(body)} bytes would take some {need} "
            f"bytes of memory once read (it holds many small values), more than the memory "
            f"budget of {hold.budget.limit} bytes (server.max_buffered_bytes); it is not "
            "retried; ask for less (fewer results, shorter content), or raise "
            "server.max_buffered_bytes",
            route=self.route,
            attempts=flow.attempt,
        )

    def _streamed(
        self,
        flow: Flow,
        resp: Answer,
        headers: CIMultiDict[str],
        slot: Slot,
    ) -> Reply:
        """A reply passing the body through chunk by chunk; it owns the pool slot from here."""
        taken = slot.hand_over()

        def release() -> None:
            resp.release()
            taken.release()

        relay = self._relay(flow, resp, taken, self.clock.now())
        return Reply(resp.status, headers, stream=relay, release=release)

    async def _relay(
        self, flow: Flow, resp: Answer, slot: Slot, started: float
    ) -> AsyncIterator[bytes]:
        """The upstream body as it arrives, from `started` (the clock's time at its headers).

        It ends with StreamCut, the upstream closed, when the upstream breaks off, outgrows
        `max_bytes`, sends nothing for `idle` seconds, or is still sending `stream_limit`
        seconds after it started.
        """
        sent = 0
        try:
            while True:
                left = self.stream_limit - (self.clock.now() - started)
                if left <= 0:
                    raise StreamCut(self._stream_too_long(flow))
                try:
                    async with asyncio.timeout(min(self.idle, left)):
                        # A piece at a time: what the agent has not taken yet waits here,
                        # not in its transport's buffer as one large copy.
                        chunk = await resp.content.read(RELAY_BYTES)
                except TimeoutError:
                    if left <= self.idle:
                        raise StreamCut(self._stream_too_long(flow)) from None
                    raise StreamCut(self._stream_silent(flow)) from None
                if not chunk:
                    return
                sent += len(chunk)
                if sent > self.max_bytes:
                    raise StreamCut(self._too_large(flow))
                yield chunk
        except (HttpProcessingError, aiohttp.ClientPayloadError) as exc:
            raise StreamCut(self._broken(flow, exc)) from None
        except aiohttp.ClientError as exc:
            raise StreamCut(
                UpstreamUnreachable(
                    f"{self.route}: the upstream closed the connection mid-stream "
                    f"({type(exc).__name__}); the answer is incomplete: send the request again",
                    route=self.route,
                    attempts=flow.attempt,
                    outcome=Outcome.RESET,
                    reason="closed mid-stream",
                )
            ) from None
        finally:
            resp.close()  # a no-op for a body read to its end: the connection is back already
            slot.release()

    def _broken(
        self, flow: Flow, exc: HttpProcessingError | aiohttp.ClientPayloadError
    ) -> AttemptFailed:
        """The error for a response that is not valid HTTP, or a body cut short."""
        cause = exc.__cause__
        if isinstance(exc, HttpProcessingError):
            detail = exc.message
        elif isinstance(cause, HttpProcessingError):
            detail = cause.message
        else:
            detail = str(exc)
        detail = redact_bytes(detail)  # it may quote the vendor's bytes: a Set-Cookie, our key
        if isinstance(exc, aiohttp.ClientPayloadError) and not isinstance(
            cause, ContentEncodingError
        ):
            return UpstreamUnreachable(
                f"{self.route}: the upstream closed the connection before a complete answer "
                f"({_one_line(detail)}) {flow.attempt_text}; try again shortly",
                route=self.route,
                attempts=flow.attempt,
                outcome=Outcome.RESET,
            )
        return UpstreamInvalidResponse(
            f"{self.route}: the upstream sent a broken HTTP response ({_one_line(detail)}) "
            f"{flow.attempt_text}; try again shortly or use another provider",
            route=self.route,
            attempts=flow.attempt,
        )

    def _stream_silent(self, flow: Flow) -> UpstreamTimeout:
        idle = duration_text(self.idle)
        return UpstreamTimeout(
            f"{self.route}: the upstream sent nothing for {idle} mid-stream (timeouts.idle); "
            "the answer is incomplete: send the request again, or raise the route's "
            "timeouts.idle if the upstream pauses longer between events",
            route=self.route,
            attempts=flow.attempt,
            reason=f"silent for {idle} mid-stream",
        )

    def _stream_too_long(self, flow: Flow) -> DeadlineExceeded:
        limit = duration_text(self.stream_limit)
        return DeadlineExceeded(
            f"{self.route}: the streamed answer was still running after {limit} "
            "(timeouts.stream) and was cut; the answer is incomplete: ask for a shorter answer, "
            "or raise the route's timeouts.stream",
            route=self.route,
            attempts=flow.attempt,
            reason=f"stream ran past {limit}",
        )

    def _too_large(self, flow: Flow, declared: int | None = None) -> UpstreamTooLarge:
        what = f"is {declared} bytes, over" if declared is not None else "ran past"
        return UpstreamTooLarge(
            f"{self.route}: the upstream's answer {what} this route's max_response_bytes of "
            f"{self.max_bytes} (counted decompressed); it was not read further and is not "
            "retried; ask for fewer results, or raise the route's max_response_bytes",
            route=self.route,
            attempts=flow.attempt,
            reason=f"answered over {self.max_bytes} bytes",
        )

    def _head_too_large(self, flow: Flow) -> UpstreamInvalidResponse:
        """The error of an answer whose head is past MAX_HEAD_BYTES: not retried, since the
        same request gets the same head."""
        error = UpstreamInvalidResponse(
            f"{self.route}: the upstream's answer head is over {MAX_HEAD_BYTES} bytes, more "
            "than search-proxy reads; it is not retried, as the same request would get the "
            "same head; no search API sends such a head: check the route's upstream",
            route=self.route,
            attempts=flow.attempt,
        )
        error.transient = False
        return error

    def _no_connection(
        self, flow: Flow, what: str, reason: str, *, transient: bool = True
    ) -> UpstreamUnreachable:
        """No connection to the vendor was made: `what` says why and what to do."""
        return UpstreamUnreachable(
            f"{self.route}: {what}",
            route=self.route,
            attempts=flow.attempt,
            outcome=Outcome.CONNECT_ERROR,
            transient=transient,
            reason=reason,
        )

    def _timeout(self, flow: Flow, budget: float) -> Exception:
        if budget < self.per_try:
            return DeadlineExceeded(
                f"{self.route}: total deadline of {seconds_text(self.total)} exceeded "
                f"{flow.attempt_text}; try again shortly",
                route=self.route,
                attempts=flow.attempt,
            )
        return UpstreamTimeout(
            f"{self.route}: upstream timed out after {seconds_text(self.per_try)} "
            f"{flow.attempt_text}; try again shortly",
            route=self.route,
            attempts=flow.attempt,
            reason=f"timed out after {seconds_text(self.per_try)}",
        )


def _os_reason(error: OSError | None) -> str:
    """An OS error in words without the address it names ("Connection refused", never asyncio's
    "Connect call failed ('10.0.3.7', 8080)"): agents read it, and the route's name is enough."""
    if error is None:
        return "no address answered"
    if error.errno is not None and error.errno > 0:  # resolver errors count below 0
        return os.strerror(error.errno)
    return error.strerror or type(error).__name__

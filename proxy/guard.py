"""Limits on agents' connections, nginx-style: header, body, whole-request and send timeouts,
idle keep-alive, and caps on open connections in all and per peer address; the drain at
shutdown; and aiohttp's own protocol errors (a malformed request, an HTTP version we do not
speak) answered in our JSON shape.

aiohttp's server has none of these timeouts and answers malformed requests in plain text, so
`ClientConnection` subclasses its RequestHandler (the per-connection protocol) and
`GuardedServer` its Server (the protocol factory). They rely on internals of aiohttp 3.14:
RequestHandler's `_messages`, `_request_count`, `_request_in_progress`, `_lingering_time`,
`_reading_paused`/`_buffer_paused` and `_drain_helper`, and Server's `_kwargs`. pyproject.toml
pins aiohttp's minor, start-up refuses an aiohttp without them (proxy/internals.py), and
tests/hostile drives each limit against a real process.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Any, cast

import structlog
from aiohttp import web
from aiohttp.http import HttpVersion10, HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import InvalidURLError, LineTooLong, TransferEncodingError
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import ERROR as PARSE_FAILED
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from policies.core.errors import BadRequest, ProxyError
from policies.core.memory import HOLD, Hold, MemoryBudget
from proxy.access import new_request_id
from proxy.capacity import RECLAIMER, OverloadLog, peer_of, per_peer_limit
from proxy.config import ServerConfig
from proxy.dialects import error_response
from proxy.errors import (
    HttpVersionNotSupported,
    InternalError,
)
from proxy.front import ROUTE_HANDLER, AgentConnection
from proxy.limits import LimitAnswers, log_refusal
from proxy.redact import redact_text
from proxy.wire import drain_in_time

log = structlog.get_logger("search_proxy")

CUT_MARGIN_S = 0.5  # after shutdown_grace: how long a cut request has to answer and log itself
RECLAIM_AFTER = 512  # connections gone since the peak that make a flood worth reclaiming after
_SUPPORTED = (HttpVersion10, HttpVersion11)
_CLAIMED_VERSION = web.RequestKey("search_proxy_claimed_version", str)
# From the first quoted literal on: aiohttp quotes the bytes it could not parse (a header line,
# the request line with its query), as b'...' or '...', at a line's start or after a space, a
# colon, `=` or `(`: an apostrophe inside a word (llhttp's "can't") starts no literal.
_QUOTED = re.compile(r"""(?:^|(?<=[\s:=(]))b?['"].*$""")


def cut_reason(request: Any) -> str | None:
    """Why the proxy cut this request's connection ("shutdown", "send_timeout"), if it did."""
    conn = request.protocol
    return conn.cut if isinstance(conn, ClientConnection | AgentConnection) else None


def _problem(exc: BaseException | None, message: str | None) -> str:
    """aiohttp's parse error in a few words, without echoing the agent's bytes: not back to
    it, not into the log (they may hold an Authorization line or a key in the query)."""
    if isinstance(exc, LineTooLong):
        return "a request line or header field is too long"
    # Their messages are the agent's bytes themselves, unquoted (the request target; the
    # pure-Python parser's chunk-size line): said in our words instead.
    if isinstance(exc, InvalidURLError):
        return "an invalid request target"
    if isinstance(exc, TransferEncodingError):
        return "an invalid chunked body (a chunk's size or framing)"
    lines = [_QUOTED.sub("", line.strip()).rstrip(": ") for line in (message or "").splitlines()]
    text = ": ".join(line for line in lines if line and not line.startswith("^"))
    return redact_text(text[:200]) or "unparseable request"


class ClientConnection(RequestHandler):
    """One agent's connection: aiohttp's protocol plus the limits it lacks.

    - header_timeout: a new connection must deliver a whole request head within it, and so
      must a kept-alive one from the first byte of its next request (a partial head gets a
      JSON 408, an idle new connection is closed silently);
    - body_timeout: longest gap between two pieces of a request body; the handler's read fails
      with RequestTimeout (a JSON 408) and the connection closes after the answer;
    - request_timeout: the request line, headers and whole body must arrive within it, counted
      like header_timeout, so a body trickled in under body_timeout cannot hold a slot for ever
      (the same JSON 408, then the connection closes);
    - send_timeout: longest time one write may wait for the agent to read; then the connection
      is dropped with what it buffered (`SendTimeout`), so a slow reader holds at most the
      transport's write buffer;
    - client_keepalive_timeout: aiohttp's own idle keep-alive timer, given our value.
    """

    __slots__ = (
        "_admitted",
        "_body",
        "_body_deadline",
        "_body_timer",
        "_close_after_answer",
        "_guard",
        "_head_started",
        "_head_timer",
        "_peer",
        "_request_deadline",
        "cut",
        "hold",
    )

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._admitted = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # bytes of the awaited head have arrived
        self._body: StreamReader | None = None  # a request body still arriving
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_deadline = 0.0
        self._request_deadline = 0.0  # the request now arriving must be whole by then
        self._close_after_answer = False
        self._peer: str | None = None  # the address counted against max_connections_per_peer
        self.cut: str | None = None
        # What the request being handled holds of the memory budget (one at a time: aiohttp
        # handles a connection's requests in turn), given back once its answer is written.
        self.hold: Hold | None = None

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = peer_of(transport.get_extra_info("peername"))
        refusal = self._guard.admit(peer)
        if refusal is not None:
            # Over a cap: answer and close at once, before aiohttp sets anything up.
            tr = cast(asyncio.Transport, transport)
            tr.write(refusal)
            tr.close()
            return
        self.adopt(transport, peer, self._loop.time())

    def adopt(self, transport: asyncio.BaseTransport, peer: str | None, began: float) -> None:
        """Serve a connection admitted already (by the front, proxy/front.py, handing it over),
        whose awaited request began at `began` (loop time)."""
        self._admitted = True
        self._peer = peer
        super().connection_made(transport)
        self._request_deadline = began + self._guard.limits.request_timeout
        self._arm_head_timer(began)

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._guard.release(self._peer)
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        next_head: float | None = None  # when the next request on this connection began
        if data and self.transport is not None:
            if self._head_timer is not None:
                self._head_started = True
            elif self._between_requests():
                # The first bytes of the next request on a kept-alive connection: its head has
                # header_timeout, the whole of it request_timeout, from now (the head's timer
                # only if it is not whole in these bytes, as it usually is).
                next_head = self._loop.time()
                self._request_deadline = next_head + self._guard.limits.request_timeout
            elif self._body is not None:
                self._body_deadline = self._loop.time() + self._guard.limits.body_timeout
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:
            # A request head is complete; only the last one parsed may still have body to come.
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            self._head_started = False
            if self._messages and not self._messages[-1][1].is_eof():
                self._watch_body(self._messages[-1][1])
        elif next_head is not None:
            self._arm_head_timer(next_head)
            self._head_started = True  # not complete yet

    def _between_requests(self) -> bool:
        """No request is being handled or queued, and no request body is still arriving."""
        return (
            not self._request_in_progress
            and not self._messages
            and (self._body is None or self._body.is_eof())
        )

    # ------------------------------------------------------------------ timeouts

    def _arm_head_timer(self, began: float) -> None:
        """The head's timer, for a request that began at `began` (loop time)."""
        due = began + self._guard.answers.head_within
        self._head_timer = self._loop.call_at(due, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport is None or not self._between_requests():
            return
        if self._head_started:
            self._guard.answers.head_late(self.transport)
        self.force_close()

    def _watch_body(self, body: StreamReader) -> None:
        self._body = body
        now = self._loop.time()
        self._body_deadline = now + self._guard.limits.body_timeout
        if self._request_deadline <= now:
            # A pipelined request, whose first bytes came with the one before: from its head.
            self._request_deadline = now + self._guard.limits.request_timeout
        if self._body_timer is None:
            due = min(self._body_deadline, self._request_deadline)
            self._body_timer = self._loop.call_at(due, self._body_check)

    def _body_check(self) -> None:
        # Data pushes the deadline on without touching the timer; the timer re-arms lazily.
        self._body_timer = None
        body = self._body
        if body is None or body.is_eof() or self.transport is None:
            self._body = None
            return
        now = self._loop.time()
        # We paused reading (the handler has not read what came): not the agent stalling.
        self._body_deadline, self._request_deadline = self._guard.answers.body_deadlines(
            now,
            self._reading_paused or self._buffer_paused,
            self._body_deadline,
            self._request_deadline,
        )
        due = min(self._body_deadline, self._request_deadline)
        if now < due:
            self._body_timer = self._loop.call_at(due, self._body_check)
            return
        self._body = None
        if self._request_in_progress or self._messages:
            # A handler reads (or will read) this body: its read raises, it answers 408; then
            # close rather than linger for the rest of a body that is not coming.
            self._lingering_time = 0.0
            body.set_exception(
                self._guard.answers.body_late(whole_late=now >= self._request_deadline)
            )
        else:
            # Already answered; aiohttp is discarding the rest of the body: stop waiting for it.
            body.feed_eof()
            self.force_close()

    async def _drain_helper(self) -> None:
        await drain_in_time(self, super()._drain_helper, self._guard.limits.send_timeout)

    # ------------------------------------------------------------------ shutdown

    def close_when_done(self) -> None:
        """Close now if no request is being handled or queued, else right after its answer.

        Unlike aiohttp's close() (which at once ignores every further byte), the rest of a
        request body already on its way is still read.
        """
        if not self._request_in_progress and not self._messages:
            self.force_close()
        else:
            self._close_after_answer = True

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if self._close_after_answer:
            resp.force_close()  # Connection: close, and aiohttp closes once it is written
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self.release_hold()  # the answer is written (or the agent gone): its memory

    def release_hold(self) -> None:
        """Give back what the request being handled held of the memory budget."""
        hold, self.hold = self.hold, None
        if hold is not None:
            hold.close()

    # ------------------------------------------------------------------ aiohttp's errors

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a malformed request (400) or to an exception no handler caught
        (500), in our JSON shape instead of plain text; the connection closes after it."""
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was already being sent; cannot send an error")
        rid = new_request_id()
        err: ProxyError
        if 400 <= status < 500:
            err = BadRequest(
                f"malformed HTTP request: {_problem(exc, message)}; send a valid HTTP/1.1 request"
            )
            log_refusal(None, rid, err)
        else:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            err = InternalError(
                "the proxy failed on this request (a bug, logged with its traceback); try again"
            )
        response = error_response(err, rid)
        response.force_close()
        return response


class GuardedServer(web.Server):
    """aiohttp's low-level server with `ClientConnection` as its protocol, behind the front
    (proxy/front.py's AgentConnection) when the application has routes to serve there; it
    counts open connections, refuses past max_connections (and past max_connections_per_peer
    from one address), tracks requests in flight for the drain, and answers request lines of
    an HTTP version other than 1.0 and 1.1 with 505."""

    def __init__(
        self,
        plain: web.Server,
        limits: ServerConfig,
        overload: OverloadLog | None = None,
        budget: MemoryBudget | None = None,
        app: web.Application | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        # The front serves this application's routes (it has a route handler), or nobody.
        self.app = app if app is not None and ROUTE_HANDLER in app else None
        self.agents: set[AgentConnection] = set()  # the front's connections, open
        self.limits = limits
        self.budget = budget  # what requests' bodies may hold at once (None: not counted)
        self.overload = overload or OverloadLog(loop.time, loop.call_at, limits.max_connections)
        self.open = 0
        self.per_peer = per_peer_limit(limits)
        self._peers: Counter[str] = Counter()  # open connections by peer_of(address)
        self._peak = 0  # most connections open at once since the last reclaim
        self._app_handler = plain.request_handler
        self._app_request = plain.request_factory
        self._in_flight: dict[asyncio.Task[Any], ClientConnection | AgentConnection] = {}
        self.answers = LimitAnswers(limits, self.per_peer)
        # The options AppRunner gathered for the protocol (keep-alive, access log ...).
        super().__init__(
            self._handle,
            request_factory=self._request,
            handler_cancellation=plain.handler_cancellation,
            loop=loop,
            **plain._kwargs,
        )

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]
        # The listener's protocol factory: loop.create_server takes any protocol.
        if self.app is not None:
            return AgentConnection(self, self.app)
        return ClientConnection(self, loop=self._loop, **self._kwargs)

    def hand_over(
        self, transport: asyncio.Transport, peer: str | None, began: float, data: bytes
    ) -> None:
        """aiohttp serves a connection the front admitted, from the request that began at
        `began` on (`data`: what came of it so far)."""
        conn = ClientConnection(self, loop=self._loop, **self._kwargs)
        transport.set_protocol(conn)
        conn.adopt(transport, peer, began)
        if data:
            conn.data_received(data)

    def serving(self, task: asyncio.Task[Any], conn: AgentConnection) -> None:
        """A request the front serves is in flight (for the drain)."""
        self._in_flight[task] = conn

    def done_serving(self, task: asyncio.Task[Any]) -> None:
        del self._in_flight[task]

    def admit(self, peer: str | None) -> bytes | None:
        """Count a new connection from `peer` in (None), or refuse it: the answer to write
        before closing it (refusals are logged once per interval)."""
        if self.open >= self.limits.max_connections:
            self.overload.refused()
            return self.answers.refusal
        if peer is not None:
            if self._peers[peer] >= self.per_peer:
                self.overload.refused(per_peer=True)
                return self.answers.peer_refusal
            self._peers[peer] += 1
        self.open += 1
        self._peak = max(self._peak, self.open)
        return None

    def release(self, peer: str | None) -> None:
        if peer is not None:
            left = self._peers[peer] - 1
            if left > 0:
                self._peers[peer] = left
            else:
                del self._peers[peer]
        self.open -= 1
        if self._peak - self.open >= RECLAIM_AFTER and self.open <= self._peak // 2:
            # Most of a flood of connections has left: give its memory back. A flood needs
            # RECLAIM_AFTER connections gone, which bounds how often this asks by itself.
            RECLAIMER.soon("connections", every=0, peak_connections=self._peak, open=self.open)
            self._peak = self.open

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def _request(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: RequestHandler,
        writer: Any,
        task: asyncio.Task[None],
    ) -> BaseRequest:
        if message is PARSE_FAILED:
            # aiohttp's stand-in for a request it could not parse says HTTP/1.0: answer in 1.1.
            return self._app_request(
                message._replace(version=HttpVersion11), payload, protocol, writer, task
            )
        if message.version in _SUPPORTED:
            return self._app_request(message, payload, protocol, writer, task)
        # aiohttp answers in the version the request claimed: make it HTTP/1.1 and remember.
        claimed = f"HTTP/{message.version.major}.{message.version.minor}"
        message = message._replace(version=HttpVersion11, should_close=True)
        request = self._app_request(message, payload, protocol, writer, task)
        request[_CLAIMED_VERSION] = claimed
        return request

    async def _handle(self, request: BaseRequest) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        protocol = self._in_flight[task] = cast(ClientConnection, request.protocol)
        held = None
        if self.budget is not None:
            # Found by everything the handler (and the tasks it starts) runs, through HOLD.
            protocol.release_hold()  # a request before it always has, by its answer
            protocol.hold = hold = Hold(self.budget)
            held = HOLD.set(hold)
        try:
            claimed = request.get(_CLAIMED_VERSION)
            if claimed is not None:
                rid = new_request_id()
                err = HttpVersionNotSupported(
                    f"{claimed} is not supported: this proxy speaks HTTP/1.1 (and 1.0); "
                    "send the request over HTTP/1.1"
                )
                log_refusal(request, rid, err)
                response = error_response(err, rid)
                response.force_close()
                return response
            return await self._app_handler(request)
        except asyncio.CancelledError:
            protocol.release_hold()  # no answer will be written
            raise
        finally:
            del self._in_flight[task]
            if held is not None:
                HOLD.reset(held)

    async def drain(self, deadline: float) -> int:
        """Let requests in flight finish until `deadline` (loop time), then cut those still
        running: each learns why (`cut_reason`) and answers or logs itself as cut. Returns
        how many were cut."""
        while self._in_flight and (left := deadline - self._loop.time()) > 0:
            await asyncio.wait(set(self._in_flight), timeout=left)
        late = list(self._in_flight.items())
        for task, conn in late:
            conn.cut = "shutdown"
            task.cancel()
        if late:
            await asyncio.wait([task for task, _ in late], timeout=CUT_MARGIN_S)
        return len(late)


class GuardedRunner(web.AppRunner):
    """An AppRunner serving through a `GuardedServer` with these limits."""

    __slots__ = ("budget", "guarded", "limits", "overload")

    def __init__(
        self,
        app: web.Application,
        limits: ServerConfig,
        overload: OverloadLog | None = None,
        budget: MemoryBudget | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, keepalive_timeout=limits.client_keepalive_timeout, **kwargs)
        self.limits = limits
        self.overload = overload
        self.budget = budget
        self.guarded: GuardedServer | None = None

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        self.guarded = GuardedServer(plain, self.limits, self.overload, self.budget, self.app)
        return self.guarded

    async def stop_accepting(self) -> None:
        """Close the listening sockets and idle connections; busy ones close after answering."""
        for site in list(self.sites):
            await site.stop()
        if self.guarded is not None:
            for conn in self.guarded.connections:
                if isinstance(conn, ClientConnection):
                    conn.close_when_done()
            for agent in list(self.guarded.agents):
                agent.close_when_done()

    async def drain(self, deadline: float) -> int:
        """See `GuardedServer.drain`."""
        return await self.guarded.drain(deadline) if self.guarded is not None else 0

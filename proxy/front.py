"""The agents' listener below aiohttp's web layer: requests to a route (nearly all of the proxy's
traffic) are read, answered and kept alive here; every other request is handed, with the bytes
that came of it, to aiohttp's server (proxy/guard.py's ClientConnection), which serves the rest
of that connection.

aiohttp's server spends on each request what a route request does not need: a task to wait for
it and one to run it, a Request with its URL object, the Application's router and middleware,
and a StreamWriter that formats the head piece by piece. Here a route request is framed from
the bytes (a head up to its blank line, a body of its Content-Length), its head parsed by
llhttp (httptools), its handler run in one task, and a whole answer written in one go. What
this path does not take is aiohttp's: the proxy's own endpoints (/v1/search, /mcp, /metrics,
...), MCP routes, and anything out of the ordinary (a chunked or `Expect` body, an upgrade, an
HTTP version other than 1.0 and 1.1, a method no route takes, a head too large or malformed),
which aiohttp then answers as it always did, its JSON errors included. How heads are read and
written is proxy/wire.py's; what a replayed hit is, proxy/replay.py's.

The limits are the same as aiohttp's connections have (proxy/guard.py): the head within
header_timeout, the body without a gap of body_timeout and whole within request_timeout, each
write taken within send_timeout, idle keep-alive client_keepalive_timeout, and a body held
before its handler reads it (it charges the memory budget when it does) of at most
PREREAD_BYTES.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, cast

import structlog
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol

from policies.core.flow import Trace
from policies.core.memory import HOLD, Hold
from proxy.access import access_line, new_request_id, request_id, route_fields
from proxy.capacity import peer_of
from proxy.dialects import error_response
from proxy.errors import InternalError
from proxy.state import STATE
from proxy.wire import (
    MAX_HEAD_BYTES,
    WRITE_AT_ONCE,
    AgentRequest,
    NotOurs,
    answer_head,
    drain_in_time,
    read_head,
)

if TYPE_CHECKING:
    from proxy.guard import GuardedServer
    from proxy.pipeline import Route
    from proxy.replay import Replays

log = structlog.get_logger("search_proxy")

# The route handler (proxy/app.py's, in its envelope), set on the application it serves; an
# application without one (the admin listener's) is served by aiohttp alone.
RouteHandler = Callable[[Any], Awaitable[web.StreamResponse]]
ROUTE_HANDLER: Final[web.AppKey[RouteHandler]] = web.AppKey("route_handler")

PREREAD_BYTES = 64 * 1024  # of a body, read before its handler asks for it (then: paused)
PIPELINED_BYTES = 64 * 1024  # of the next requests, read while one is answered (then: paused)
LINGER_S = 10.0  # answered before its body came whole: how long the rest is read, then dropped
# A replayed hit's access-line fields: those of a hit the chain answered.
HIT_FIELDS = route_fields(Trace(cache="hit"))


class AgentConnection(BaseProtocol):
    """One agent's connection, serving its route requests until one is not (then handed to
    aiohttp's ClientConnection for good)."""

    __slots__ = (
        "_admitted",
        "_app",
        "_body_deadline",
        "_body_left",
        "_body_parts",
        "_body_timer",
        "_body_waiter",
        "_buffer",
        "_close_after",
        "_discarding",
        "_guard",
        "_head_began",
        "_head_due",
        "_idle_due",
        "_lingering",
        "_peer",
        "_preread",
        "_request_deadline",
        "_scanned",
        "_task",
        "_timer",
        "_timer_at",
        "cut",
        "hold",
        "remote",
    )

    def __init__(self, guard: GuardedServer, app: web.Application) -> None:
        super().__init__(guard.loop)
        self._guard = guard
        self._app = app
        self._buffer = bytearray()
        self._scanned = 0  # how much of the buffer was searched for a head's end
        self._admitted = False  # counted in the guard's connections (until handed over)
        self._peer: str | None = None  # counted against max_connections_per_peer
        self.remote: str | None = None
        # One timer for the head and idle limits, re-armed only when it fires early: most
        # requests come whole in one read and need none of their own (a loop timer costs a few
        # microseconds to set and cancel on uvloop).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._head_due = math.inf  # a request's head must be whole by then
        self._idle_due = math.inf  # a kept-alive connection closes then unless a request came
        self._body_timer: asyncio.TimerHandle | None = None
        self._head_began = 0.0  # when the awaited request began (loop time)
        self._request_deadline = 0.0  # by then it must have arrived whole
        self._body_deadline = 0.0
        self._task: asyncio.Task[None] | None = None  # the request being served
        self._body_parts: list[bytes] = []
        self._body_left = 0  # bytes of the body still to come
        self._body_waiter: asyncio.Future[None] | None = None
        self._preread = True  # the handler has not asked for the body yet
        self._discarding = False  # the body is refused unread: what comes is dropped
        self._lingering = False  # answered already: the rest of the body is read, then close
        self._close_after = False  # close once the request being served is answered
        self.cut: str | None = None
        self.hold: Hold | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        peer = peer_of(peername)
        refusal = self._guard.admit(peer)
        tr = cast(asyncio.Transport, transport)
        if refusal is not None:
            tr.write(refusal)
            tr.close()
            return
        super().connection_made(tr)
        self._admitted = True
        self._peer = peer
        self.remote = peername[0] if isinstance(peername, tuple | list) and peername else None
        self._guard.agents.add(self)
        self._expect_head(self._loop.time())
        self._arm(self._head_due)  # a connection that sends nothing closes then

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._admitted:  # else refused at accept: never counted
            self._admitted = False
            self._guard.agents.discard(self)
            self._guard.release(self._peer)
        self._cancel_timers()
        waiter, self._body_waiter = self._body_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the agent closed the connection"))
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._body_left:  # a body still coming (its request served, or lingered after)
            self._feed_body(data)
            return
        if self._task is not None:
            self._buffer += data  # the next request, pipelined: read once this one is done
            if len(self._buffer) > PIPELINED_BYTES and not self._buffer_paused:
                self._pause_reading_for_buffer()
            return
        if not self._buffer and self._idle_due < math.inf:
            # The first bytes of the next request on a kept-alive connection.
            self._expect_head(self._loop.time())
        self._buffer += data
        self._next_request()
        if self._task is None and self._buffer and self.transport is not None:
            self._arm(self._head_due)  # part of a head: due by header_timeout

    def eof_received(self) -> bool | None:
        return None  # as aiohttp's server: a half-closed connection closes

    # ------------------------------------------------------------------ requests

    def _next_request(self) -> None:
        """Start the requests whose heads are in the buffer (answering those a replay answers
        at once), or wait for the rest of one."""
        while self._buffer and self.transport is not None and self._task is None:
            if not self._start_request():
                return

    def _start_request(self) -> bool:
        """Start the request whose head is in the buffer; True when it was answered at once
        and the connection is ready for the next one."""
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n", max(0, self._scanned - 3))
        if end < 0:
            self._scanned = len(buffer)
            # Too long for a head, or lines ending in a bare LF (a head that never ends in
            # CRLF CRLF): aiohttp's parser answers it now rather than at header_timeout.
            if len(buffer) > MAX_HEAD_BYTES or buffer.count(b"\n") != buffer.count(b"\r\n"):
                self._hand_over()
            return False
        self._scanned = 0
        if end + 4 > MAX_HEAD_BYTES:
            self._hand_over()
            return False
        try:
            head = bytes(buffer[: end + 4])
            request, route = read_head(head, self, self._app, self._app[STATE].router)
        except NotOurs:
            self._hand_over()
            return False
        del buffer[: end + 4]
        self._head_due = math.inf
        length = request.content_length or 0
        if route.replays is not None and length <= len(buffer):
            answered = self._replay(request, route, route.replays)
            if answered is not None:  # the request is answered: never the chain's too
                return answered
        self._body_parts = []
        self._body_left = length
        self._preread = True
        self._discarding = length > self._guard.limits.max_body_bytes
        if length:
            self._body_deadline = self._loop.time() + self._guard.limits.body_timeout
            if buffer:
                rest = bytes(buffer)
                buffer.clear()
                self._feed_body(rest)
            if self._body_left:  # not all in yet: its limits need a timer
                self._watch_body()
        self._task = self._loop.create_task(self._serve(request))
        return False

    def _replay(self, request: AgentRequest, route: Route, replays: Replays) -> bool | None:
        """Answer a request whose body is all in the buffer from a remembered fresh hit, if
        one is (proxy/replay.py). None: not answered, the chain's to serve; True: answered,
        and the connection is ready for the next request; False: answered, and the connection
        closes or waits for the agent to read."""
        state = self._app[STATE]
        if not replays.remembering or state.clients is not None:
            return None
        length = request.content_length or 0
        with memoryview(self._buffer) as buffered:
            key = replays.remembered(request, bytes(buffered[:length]))
        if key is None:
            return None
        rid = request_id(request.headers)
        if any(text in rid for text in state.echo.texts):
            return None  # an id holding a secret: the chain's answer redacts it
        started = state.clock.now()
        answer = replays.answer(key, request, rid)
        if answer is None:
            return None
        del self._buffer[:length]
        status, data, written = answer
        assert self.transport is not None
        self.transport.write(data)
        elapsed = state.clock.now() - started
        route.metrics.observe(status, elapsed, elapsed)
        if state.log_requests:
            access_line(
                request, rid, route.name, status, elapsed, HIT_FIELDS,
                cut=None, written=written, error=None,
            )  # fmt: skip
        if not request.keep_alive or self._close_after:
            self._close()
            return False
        if self._paused:  # the agent is not reading: wait for it in a task, as any answer
            self._task = self._loop.create_task(self._drained())
            return False
        if self._buffer:
            self._expect_head(self._loop.time())
        else:
            self._go_idle(self._loop.time())
        return True

    async def _drained(self) -> None:
        """After a replayed answer the agent has not read yet: the next request once it has
        (within send_timeout, or the connection drops)."""
        try:
            await self._drain_helper()
        except ConnectionError:
            self._task = None
            return
        self._task = None
        if self._close_after:  # shutdown asked meanwhile
            self._close()
            return
        self._ready_for_next()

    # ------------------------------------------------------------------ the body

    def _feed_body(self, data: bytes) -> None:
        take = data[: self._body_left] if len(data) > self._body_left else data
        self._body_left -= len(take)
        if not self._discarding:
            self._body_parts.append(take)
        if len(take) < len(data):
            self._buffer += data[len(take) :]  # the next request's first bytes
        if self._body_left == 0:
            if self._lingering:  # after the answer: the body is all in, close
                self._close()
                return
            self._body_done()
            return
        self._body_deadline = self._loop.time() + self._guard.limits.body_timeout
        if self._preread and not self._discarding and not self._buffer_paused:
            if sum(map(len, self._body_parts)) >= PREREAD_BYTES:
                self._pause_reading_for_buffer()  # until the handler asks (and charges it)

    def _linger(self) -> None:
        """Answered before its body came whole (a 413, a refusal): read the rest and drop it,
        so the agent finishes sending and reads the answer, then close (as aiohttp's
        lingering close); at most LINGER_S."""
        self._discarding = self._lingering = True
        self._body_parts = []
        if self._buffer_paused:
            self._resume_reading_for_buffer()
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_timer = self._loop.call_later(LINGER_S, self._close)

    def _body_done(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        waiter, self._body_waiter = self._body_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def body(self) -> bytes:
        """The request's whole body, once it has come (RequestTimeout if it stalls)."""
        self._preread = False
        if self.transport is None:
            raise ConnectionResetError("the agent closed the connection")
        waiter = self._body_waiter
        if waiter is not None and waiter.done():  # it stalled before the handler asked
            self._body_waiter = None
            waiter.result()  # raises its RequestTimeout
        if self._buffer_paused and self._task is not None:
            self._resume_reading_for_buffer()
        if self._body_left:
            waiter = self._body_waiter = self._loop.create_future()
            await waiter
        parts, self._body_parts = self._body_parts, []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _watch_body(self) -> None:
        due = min(self._body_deadline, self._request_deadline)
        self._body_timer = self._loop.call_at(due, self._body_check)

    def _body_check(self) -> None:
        self._body_timer = None
        if not self._body_left or self.transport is None:
            return
        now = self._loop.time()
        # Paused by us (the handler has not asked yet): not the agent's stall.
        self._body_deadline, self._request_deadline = self._guard.answers.body_deadlines(
            now, self._buffer_paused, self._body_deadline, self._request_deadline
        )
        due = min(self._body_deadline, self._request_deadline)
        if now < due:
            self._body_timer = self._loop.call_at(due, self._body_check)
            return
        self._close_after = True  # the rest of the body is not coming: no next request
        late = self._guard.answers.body_late(whole_late=now >= self._request_deadline)
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(late)
        elif self._task is None or self._task.done():
            self._close()
        else:
            self._body_left = 0  # a handler asking later gets the error at once
            self._body_waiter = fut = self._loop.create_future()
            fut.set_exception(late)
            fut.exception()  # retrieved here, raised again when awaited

    # ------------------------------------------------------------------ answering

    async def _serve(self, request: AgentRequest) -> None:
        keep_alive = False
        try:
            response = await self._answer(request)
            if response is not None:
                keep_alive = await self._finish(request, response)
        except asyncio.CancelledError:
            self._close()
            raise
        except ConnectionError:
            pass  # the agent went, or read nothing for send_timeout: closed below
        except Exception as exc:  # writing the answer failed: a bug, never a hung connection
            log.exception("request_failed", exc_info=exc)
        finally:
            self.release_hold()
            self._task = None
        if self._body_left and not self._close_after and self.transport is not None:
            self._linger()
            return
        if not keep_alive or self._close_after or self._discarding:
            self._close()
            return
        self._ready_for_next()

    def _ready_for_next(self) -> None:
        """An answer is written and the connection stays: wait for the next request (idle for
        at most client_keepalive_timeout), or start the one pipelined meanwhile."""
        if self._buffer_paused:
            self._resume_reading_for_buffer()
        now = self._loop.time()
        if self._buffer:  # a pipelined request came meanwhile
            self._expect_head(now)
            self._next_request()
            if self._task is None and self._buffer and self.transport is not None:
                self._arm(self._head_due)
        else:
            self._go_idle(now)

    async def _answer(self, request: AgentRequest) -> web.StreamResponse | None:
        """The route handler's answer, with the request's share of the memory budget and
        counted in flight for the drain. A handler's bug gets the JSON 500 aiohttp's path
        gives it (guard.py's handle_error), unless its answer had begun: then None, and the
        connection closes with what was sent."""
        guard = self._guard
        task = self._task  # this task: set as it was made, before its first step
        assert task is not None
        guard.serving(task, self)
        held = None
        if guard.budget is not None:
            self.hold = hold = Hold(guard.budget)
            held = HOLD.set(hold)
        try:
            return await self._app[ROUTE_HANDLER](request)
        except Exception as exc:  # the envelope answers every failure it knows
            log.exception("request_failed", exc_info=exc)
            if request.began_answer():
                self._close_after = True
                return None
            response = error_response(
                InternalError(
                    "the proxy failed on this request (a bug, logged with its traceback); try again"
                ),
                new_request_id(),
            )
            response.force_close()
            return response
        finally:
            guard.done_serving(task)
            if held is not None:
                HOLD.reset(held)

    async def _finish(self, request: AgentRequest, response: web.StreamResponse) -> bool:
        """Write a whole answer (a streamed one has written itself); whether the connection
        stays open for the next request."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        if response.prepared:
            await response.write_eof()  # a no-op when the stream ended it
            return bool(response.keep_alive)
        if not isinstance(response, web.Response) or not isinstance(
            response.body, bytes | bytearray | None
        ):
            await response.prepare(cast(web.BaseRequest, request))  # aiohttp writes it
            await response.write_eof()
            return bool(response.keep_alive)
        # A body refused unread (or not all in) closes the connection after the answer.
        keep_alive = (
            request.keep_alive
            and response.keep_alive is not False
            and not (self._close_after or self._discarding or self._body_left)
        )
        body = bytes(response.body or b"")
        head, with_body = answer_head(request, response, body, keep_alive)
        if request.hit is not None and response.status == 200:
            request.hit[0].remember(request, response, body)
        if not with_body:
            transport.write(head)
        elif len(body) <= WRITE_AT_ONCE:
            transport.write(head + body)
        else:
            transport.writelines((head, body))
        if self._paused:
            await self._drain_helper()  # taken within send_timeout, or the connection drops
        return keep_alive

    def release_hold(self) -> None:
        hold, self.hold = self.hold, None
        if hold is not None:
            hold.close()

    async def _drain_helper(self) -> None:  # send_timeout
        await drain_in_time(self, super()._drain_helper, self._guard.limits.send_timeout)

    # ------------------------------------------------------------------ timers

    def _expect_head(self, began: float) -> None:
        """A request began (a new connection, or the first bytes of the next one): its head is
        due by header_timeout, the whole of it by request_timeout. The timer is armed for it
        only if the head is not whole after this read (`_arm`)."""
        limits = self._guard.limits
        self._head_began = began
        self._request_deadline = began + limits.request_timeout
        self._head_due = began + self._guard.answers.head_within
        self._idle_due = math.inf

    def _go_idle(self, now: float) -> None:
        """Answered, kept alive: the next request's first byte is due by
        client_keepalive_timeout."""
        self._head_due = math.inf
        self._idle_due = now + self._guard.limits.client_keepalive_timeout
        self._arm(self._idle_due)

    def _arm(self, due: float) -> None:
        """The connection's timer fires by `due`: one set for later is moved earlier; one set
        earlier stays (it finds nothing due, and sets itself again)."""
        if self._timer is not None:
            if self._timer_at <= due:
                return
            self._timer.cancel()
        self._timer_at = due
        self._timer = self._loop.call_at(due, self._tick)

    def _tick(self) -> None:
        """The head and idle limits: whichever the connection is waiting on now."""
        self._timer, self._timer_at = None, math.inf
        if self.transport is None or self._task is not None:
            return  # a request is served: its end sets what comes next
        now = self._loop.time()
        if self._head_due < math.inf:
            if now < self._head_due:
                self._arm(self._head_due)
                return
            if self._buffer:  # a head began and did not come whole in time
                self._guard.answers.head_late(self.transport)
            self._close()
        elif self._idle_due < math.inf:
            if now < self._idle_due:
                self._arm(self._idle_due)
                return
            self._close()

    def _cancel_timers(self) -> None:
        for timer in (self._timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._body_timer = None
        self._timer_at = math.inf

    # ------------------------------------------------------------------ ending

    def _close(self) -> None:
        self._cancel_timers()
        if self.transport is not None:
            self.transport.close()

    def close_when_done(self) -> None:
        """At shutdown: close now if idle, else right after the answer being written."""
        if self._task is None:
            self._close()
        else:
            self._close_after = True

    def _hand_over(self) -> None:
        """aiohttp's server takes this connection from the request now arriving on."""
        transport = self.transport
        assert transport is not None
        self._cancel_timers()
        self._guard.agents.discard(self)
        self._admitted = False  # the ClientConnection counts it from here
        data = bytes(self._buffer)
        self._buffer.clear()
        if self._buffer_paused:
            self._resume_reading_for_buffer()
        self.transport = None  # aiohttp's from here: nothing of this protocol touches it
        self._guard.hand_over(transport, self._peer, self._head_began, data)

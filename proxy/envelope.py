"""The envelope every agent request takes, whatever answers it (a route, /v1/search, /mcp): its
request id, its timing, the rendering of a proxy error, what happens when the agent leaves or
the proxy shuts down, then one metrics update and one access-log line.

An endpoint is `async def endpoint(request, exchange) -> response`; it fills in the `Exchange`
(which metrics it counts under, the route whose dialect its errors take, what its log line
says) and raises ProxyError for a failure it does not answer itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from policies.core.errors import ProxyError, StreamCut
from policies.core.flow import Flow, Reply
from policies.profiles import reading
from proxy import access
from proxy.dialects import error_response
from proxy.echo import EchoGuard
from proxy.errors import RequestTimeout, ShuttingDown
from proxy.guard import cut_reason
from proxy.metrics import RouteMetrics
from proxy.pipeline import Route
from proxy.state import STATE, ProxyState
from proxy.wire import prepare_stream

log = structlog.get_logger("search_proxy")

# The end of an event, where another may begin: a blank line (LF, CR or CRLF line ends).
_EVENT_ENDS = (b"\n\n", b"\r\r", b"\n\r\n", b"\r\r\n")
AGENT_CHECK_S = 1.0  # how often a stream being relayed looks whether its agent is still there
PIECE_BYTES = 64 * 1024  # what of a large answer is handed to the agent's transport at a time
WHOLE_BYTES = 4 * PIECE_BYTES  # answers up to this size are written in one go


@dataclass(slots=True)
class Sent:
    """What of a streamed answer reached the agent: the response once its status line went
    out, the body bytes written, the last few of them, and whether the whole body was written
    (all but the final chunk's end)."""

    response: web.StreamResponse | None = None
    written: int = 0
    ending: bytes = b""
    complete: bool = False


@dataclass(slots=True)
class Exchange:
    """One agent request as the envelope answers, counts and logs it."""

    request_id: str
    started: float
    name: str | None  # the access line's `route`: the route's name, "search", "mcp"
    metrics: RouteMetrics | None = None  # None: counted nowhere (no route matched)
    route: Route | None = None  # its errors take this route's vendor dialect
    flow: Flow | None = None  # the route request, once built
    status: int = 500
    cut: str | None = None  # why the proxy cut the exchange short, if it did
    answering: bool = False  # the endpoint has its answer and is sending it
    sent: Sent = field(default_factory=Sent)
    error: str | None = None  # an error the proxy answered inside a 200 (an MCP tool error)
    # The proxy error answered (its type and message), for the status page's last errors.
    failure: str | None = None
    problem: str | None = None
    # What the endpoint adds to its access line, asked when the line is written.
    fields: Callable[[], dict[str, Any]] | None = None

    def count_as(self, metrics: RouteMetrics) -> None:
        """Count this request under `metrics` (its route label), in flight from now."""
        self.metrics = metrics
        metrics.in_flight.inc()


Endpoint = Callable[[web.Request, Exchange], Awaitable[web.StreamResponse]]


class _AgentWatch:
    """While a stream is relayed, look every AGENT_CHECK_S whether the agent's connection is
    gone, and if so cancel the handler (logged `cut: client_gone`): otherwise a stream silent
    for up to timeouts.idle would hold its upstream connection for an agent that left, until
    the next chunk failed to go out. (aiohttp's handler_cancellation does this, but is off.)"""

    __slots__ = ("_handle", "_loop", "_request", "_task")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(AGENT_CHECK_S, self._check)

    def _check(self) -> None:
        transport = self._request.transport
        if transport is None or transport.is_closing():
            if self._task is not None:
                self._task.cancel()
        else:
            self._handle = self._loop.call_later(AGENT_CHECK_S, self._check)

    def stop(self) -> None:
        self._handle.cancel()


def watch_agent(request: web.Request) -> _AgentWatch:
    """Cancel the handler within AGENT_CHECK_S once the agent's connection is gone (`stop()`
    ends the watch)."""
    return _AgentWatch(request)


def enveloped(endpoint: Endpoint, name: str | None = None) -> Handler:
    """`endpoint` inside the envelope; `name` is its access line's `route` until the endpoint
    names a route."""

    async def handle(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        ex = Exchange(access.request_id(request.headers), state.clock.now(), name)
        response: web.StreamResponse | None = None
        try:
            response = await endpoint(request, ex)
            if not ex.answering:
                ex.status = response.status
            if isinstance(response, web.Response) and not response.prepared:
                _withhold(state.echo, response, ex.name)
        except ProxyError as err:
            ex.status = err.status
            response = error_answer(err, ex)
        except StreamCut as stopped:
            if ex.sent.response is None:  # cut before any answer began: an error still can
                ex.status = stopped.error.status
                response = error_answer(stopped.error, ex)
            else:
                # Its status stands and `answer` ended the connection; the log line says why.
                # Handing aiohttp the sent response keeps it quiet: its final write finds the
                # connection closed, which it takes as the agent gone.
                ex.cut = stopped.error.type
                response = ex.sent.response
        except ConnectionError:
            # The agent went away, or read nothing of a streamed answer for send_timeout.
            transport = request.transport
            if ex.sent.response is None and transport is not None and not transport.is_closing():
                ex.status = 500
                raise  # not the agent's connection that failed: a bug, logged with its traceback
            why = cut_reason(request)
            if ex.sent.response is None:
                ex.status, ex.cut = 499, why or "client_gone"
            elif why or not ex.sent.complete:
                ex.cut = why or "client_gone"  # mid-stream: the status sent stands
            # else the agent had the whole answer and left before its last chunk's end.
            if transport is not None:
                transport.close()
            # Returned, not raised: aiohttp would log a raised one as "Error handling request".
            # Its own final write finds the connection closed and it stops there, quietly.
            response = ex.sent.response or web.StreamResponse(status=499)
        except asyncio.CancelledError:
            # The agent left (a watch, or aiohttp's handler_cancellation), or shutdown came.
            transport = request.transport
            gone = transport is None or transport.is_closing()
            ex.cut = cut_reason(request) or ("client_gone" if gone else "cancelled")
            task = asyncio.current_task()
            if ex.cut != "shutdown" or ex.answering or task is None:
                if ex.cut == "client_gone" and ex.sent.response is None:
                    ex.status = 499
                raise  # mid-stream, the status already sent stands; the log line says it was cut
            # Outlived shutdown_grace before any answer: tell the agent rather than drop it.
            task.uncancel()
            stopping = ShuttingDown(
                "the proxy is shutting down and this request outlived server.shutdown_grace; "
                "send it again"
            )
            ex.status = stopping.status
            response = error_answer(stopping, ex)
        finally:
            _done(request, ex, response)
        return response

    return handle


def _withhold(echo: EchoGuard, response: web.Response, route: str | None) -> None:
    """A whole answer without the secrets the proxy holds (a vendor echoing its key)."""
    echo.headers(response.headers, route)
    if isinstance(response.body, bytes):
        body = echo.body(response.body, route)
        if body is not response.body:
            response.body = body


def _done(request: web.Request, ex: Exchange, response: web.StreamResponse | None) -> None:
    """One metrics update and one access-log line for the finished exchange."""
    reading.forget()  # the parse its policies shared (an answer's may be large) goes with it
    state = request.app[STATE]
    elapsed = state.clock.now() - ex.started
    flow = ex.flow
    if ex.metrics is not None:
        ex.metrics.in_flight.dec()
        overhead = None
        if flow is not None:
            overhead = elapsed - (flow.trace.upstream_seconds + flow.trace.waited_seconds)
        ex.metrics.observe(ex.status, elapsed, overhead)
        if ex.cut is not None and ex.sent.response is not None and ex.route is not None:
            state.metrics.stream_cut(ex.route.name, ex.cut)
    fields = ex.fields() if ex.fields is not None and state.log_requests else {}
    if ex.metrics is not None and state.pulse is not None:
        _remember(state, ex, response)
    if not state.log_requests:
        return
    written = ex.sent.written if ex.sent.response is not None else _body_bytes(request, response)
    # The proxy's own error, also when it travels in a 200 (an MCP tool error).
    error = response.headers.get("X-Proxy-Error") if response is not None else None
    error = error or ex.error or (flow.trace.error if flow else None)
    access.access_line(
        request,
        ex.request_id,
        ex.name,
        ex.status,
        elapsed,
        fields,
        cut=ex.cut,
        written=written,
        error=error,
    )


def _remember(state: ProxyState, ex: Exchange, response: web.StreamResponse | None) -> None:
    """An error answered (or a stream cut) goes to the status page's last errors."""
    proxy_error = response.headers.get("X-Proxy-Error") if response is not None else None
    if ex.problem is None and proxy_error is not None and isinstance(response, web.Response):
        ex.failure, ex.problem = proxy_error, _message(response.body) or proxy_error
    if ex.problem is not None:
        message = ex.problem
    elif ex.cut is not None:
        message = f"the answer was cut short: {ex.cut}"
    elif ex.status >= 500:
        message = f"the vendor answered {ex.status}"
    elif ex.error is not None:
        message = f"answered inside a 200: {ex.error}"
    else:
        return
    assert state.pulse is not None and ex.metrics is not None
    error = ex.error if ex.problem is None else None
    state.pulse.record(ex.metrics.label, ex.status, ex.failure or error, message, ex.request_id)


def _message(body: Any) -> str | None:
    """The message of an error body in the proxy's own shape (/v1/search's, /mcp's)."""
    try:
        error = orjson.loads(body).get("error") if isinstance(body, bytes) else None
    except (orjson.JSONDecodeError, AttributeError):
        return None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None


def _body_bytes(request: web.Request, response: web.StreamResponse | None) -> int:
    """The body bytes a whole (not streamed) answer carries to the agent."""
    if response is None or request.method == "HEAD" or not isinstance(response, web.Response):
        return 0
    return response.content_length or 0


def error_answer(err: ProxyError, ex: Exchange) -> web.Response:
    """A proxy-made error in the route's vendor dialect, with what the flow knows."""
    flow, route = ex.flow, ex.route
    ex.problem, ex.failure = err.message, err.type
    if flow is not None:
        err.attempts = max(err.attempts, flow.trace.attempts)
        err.route = err.route or flow.request.route
    elif route is not None:
        err.route = err.route or route.name
    response = error_response(err, ex.request_id, route.profile if route is not None else None)
    if flow is not None:
        response.headers.update(flow.trace.reply_headers)
        response.headers["X-Proxy-Attempts"] = str(flow.trace.attempts)
    if isinstance(err, RequestTimeout | ShuttingDown):
        response.force_close()  # the connection closes after this answer
    return response


# ---------------------------------------------------------------------------------------------
# Sending a route's reply


async def answer(request: web.Request, reply: Reply, ex: Exchange) -> web.StreamResponse:
    """Turn a reply into the agent's response, streaming it chunk by chunk when it is a stream;
    `ex.sent` follows what of a stream went out. A stream cut mid-way (StreamCut) gets its tail
    (`_cut_tail`) and its connection closed before StreamCut goes on."""
    flow, sent = ex.flow, ex.sent
    assert flow is not None  # a reply answers a flow
    ex.status = reply.status
    ex.answering = True
    headers = reply.headers
    headers.update(flow.trace.reply_headers)
    headers["X-Request-Id"] = flow.request.request_id
    headers["X-Proxy-Attempts"] = str(flow.trace.attempts)
    echo, route = request.app[STATE].echo, ex.name
    whole = reply.stream is None  # scrubbed whole (here, or by _withhold), not piece by piece
    if reply.stream is None:
        if len(reply.body) <= WHOLE_BYTES:
            return web.Response(status=reply.status, headers=headers, body=reply.body)
        # A large answer goes out in pieces, each written once the agent took the last: a slow
        # reader would otherwise have the transport copy what it has not read yet (twice the
        # body in memory). Its length stands.
        body = echo.body(reply.body, route)  # whole: a secret may span two pieces
        headers["Content-Length"] = str(len(body))
        reply.stream = _pieces(body)
    stream = reply.stream
    echo.headers(headers, route)
    # A secret may span two chunks: the scrubber holds back a chunk's end that begins one. Cut
    # short (StreamCut), the stream drops what it held: the start of a key is no answer.
    scrub = None if whole else echo.stream(route)
    response = web.StreamResponse(status=reply.status, headers=headers)
    watch = _AgentWatch(request)
    try:
        await prepare_stream(response, request)
        sent.response = response
        async for piece in stream:
            chunk = piece if scrub is None else scrub.feed(piece)
            if chunk:
                await _send(response, chunk, sent)
        if scrub is not None and (held := scrub.end()):
            await _send(response, held, sent)
        sent.complete = True
        watch.stop()
        await response.write_eof()
    except StreamCut as stopped:
        watch.stop()
        await _end_cut(request, response, reply, stopped.error, sent)
        raise
    finally:
        watch.stop()
        reply.discard()
    return response


async def _send(response: web.StreamResponse, chunk: bytes, sent: Sent) -> None:
    await response.write(chunk)
    sent.written += len(chunk)
    sent.ending = (sent.ending + chunk[-4:])[-4:]


async def _pieces(body: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(body), PIECE_BYTES):
        yield body[start : start + PIECE_BYTES]


def _cut_tail(reply: Reply, err: ProxyError, sent: Sent) -> bytes:
    """What a stream cut by `err` ends with before its connection closes: the reply's own
    `cut_tail`, else for an event stream a final `error` event with the error's type and
    message (already free of secrets), else nothing. Cut inside an event, the default gets
    nothing (a tail would merge into the unfinished event); a reply's own tail is sent after a
    blank line that ends the unfinished event."""
    media = reply.headers.get("Content-Type", "").partition(";")[0].strip().lower()
    sse = media == "text/event-stream"
    inside_event = sse and sent.written and not sent.ending.endswith(_EVENT_ENDS)
    if reply.cut_tail is not None:
        # The reply's own tail knows its client: an MCP client drops the unfinished event
        # (a blank line ends it) and reads the error for its request, instead of hanging.
        try:
            return (b"\n\n" if inside_event else b"") + reply.cut_tail(err)
        except Exception:
            log.exception("cut_tail_failed", route=err.route, error=err.type)
            return b""
    if inside_event:
        return b""
    if sse:
        data = orjson.dumps({"error": {"type": err.type, "message": err.message}})
        return b"event: error\ndata: " + data + b"\n\n"
    return b""


async def _end_cut(
    request: web.Request, response: web.StreamResponse, reply: Reply, err: ProxyError, sent: Sent
) -> None:
    """End a stream the upstream side cut after its status line went out: write its tail,
    then close the connection without the final chunk, so the agent sees the answer end short."""
    tail = _cut_tail(reply, err, sent)
    if tail and sent.response is not None:
        try:
            await response.write(tail)
            sent.written += len(tail)
        except ConnectionError:
            pass  # the agent is gone too; the upstream's cut is what the log line reports
    if request.transport is not None:
        request.transport.close()

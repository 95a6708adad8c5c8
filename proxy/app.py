"""The aiohttp application: reserved endpoints, and the one handler every proxied request takes.

Reserved paths, answered by the proxy itself on the main port: /healthz, /readyz, /metrics,
/v1/search, /openapi.json, and the MCP server at mcp_server.path (/mcp); /admin/... only says
where the admin listener is (`build_admin_app`). Config refuses route prefixes that collide with
them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import orjson
import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from policies.core.clock import SYSTEM_CLOCK, Clock
from policies.core.credentials import is_credential_name
from policies.core.errors import ProxyError, StreamCut
from policies.core.flow import Flow, Reply
from policies.core.redislink import RedisLink
from policies.quota import DailyQuota, quota_store
from proxy.admin import Admin, admin_token
from proxy.clients import ClientGate, keyless_routes
from proxy.config import Config
from proxy.dialects import error_response
from proxy.errors import (
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    ShuttingDown,
)
from proxy.forward import request_headers
from proxy.guard import cut_reason
from proxy.mcp_server import McpEndpoint, McpTrace
from proxy.metrics import Metrics
from proxy.pipeline import Deps, Route, build_route
from proxy.redact import redact_query
from proxy.routing import Router
from proxy.search_api import SearchApi, SearchTrace

log = structlog.get_logger("search_proxy")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Refused whatever the path: CONNECT would open a tunnel; TRACE and TRACK echo the request,
# credentials included, back to the caller. No vendor API uses them.
REFUSED_METHODS = frozenset({"CONNECT", "TRACE", "TRACK"})
ROUTE_METHODS = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"


@dataclass
class ProxyState:
    """Everything the handlers share, created at start-up and owned by the app."""

    config: Config
    clock: Clock
    metrics: Metrics
    routes: dict[str, Route] = field(default_factory=dict)
    router: Router[Route] | None = None
    search_api: SearchApi | None = None
    admin: Admin | None = None
    clients: ClientGate | None = None  # None: `clients:` not configured, callers not identified
    mcp: McpEndpoint | None = None  # the MCP server at mcp_server.path (proxy/mcp_server.py)
    session: aiohttp.ClientSession | None = None
    redis: RedisLink | None = None
    log_requests: bool = True


STATE = web.AppKey("state", ProxyState)


def client_identity(headers: CIMultiDictProxy[str]) -> str:
    """A short, stable hash of the caller's credentials, every header whose name is one
    (policies/core/credentials.py); "" when it sent none."""
    parts = sorted(
        (name.lower(), value)
        for name, value in headers.items()
        if value and is_credential_name(name)
    )
    if not parts:
        return ""
    text = "\n".join(f"{name}:{value}" for name, value in parts)
    # surrogateescape: a header's non-UTF-8 bytes count as they came, and never raise.
    return hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()


async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(
            f"request body of {request.content_length} bytes exceeds the "
            f"limit of {limit} bytes; send a smaller request"
        )
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        body = None
    if body is None or len(body) > limit:
        raise PayloadTooLarge(
            f"request body exceeds the limit of {limit} bytes; send a smaller request"
        )
    return body


def _request_id(request: web.Request) -> str:
    """The agent's X-Request-Id when it is safe to log and forward, else a fresh one."""
    rid = request.headers.get("X-Request-Id", "")
    return rid if _REQUEST_ID.match(rid) else os.urandom(16).hex()


def _refused_method(method: str) -> MethodNotAllowed:
    if method == "CONNECT":
        text = (
            "CONNECT is not supported: this is a reverse proxy; send "
            "requests to a route prefix such as /tavily/search"
        )
    else:
        text = (
            f"{method} is not supported: it would echo the request, credentials included; "
            "send GET or POST to a route prefix such as /tavily/search"
        )
    return MethodNotAllowed(text, headers={"Allow": ROUTE_METHODS})


def _forwarded_host(request: web.Request, headers: CIMultiDict[str]) -> CIMultiDict[str]:
    """X-Forwarded-Host from our own view, the Host the agent sent us; never the agent's own."""
    headers.popall("X-Forwarded-Host", None)
    host = request.headers.get("Host")
    if host:
        headers["X-Forwarded-Host"] = host
    return headers


def _error_answer(
    err: ProxyError, rid: str, route: Route | None, flow: Flow | None
) -> web.Response:
    """A proxy-made error in the route's vendor dialect, with what the flow knows."""
    if flow is not None:
        err.attempts = max(err.attempts, flow.attempts)
        err.route = err.route or flow.route
    elif route is not None:
        err.route = err.route or route.name
    response = error_response(err, rid, route.profile if route is not None else None)
    if flow is not None:
        response.headers.update(flow.reply_headers)
        response.headers["X-Proxy-Attempts"] = str(flow.attempts)
    if isinstance(err, RequestTimeout | ShuttingDown):
        response.force_close()  # the connection closes after this answer
    return response


@dataclass(slots=True)
class _Sent:
    """What of a streamed answer reached the agent: the response once its status line went
    out, the body bytes written, the last few of them, and whether the whole body was written
    (all but the final chunk's end)."""

    response: web.StreamResponse | None = None
    written: int = 0
    ending: bytes = b""
    complete: bool = False


# The end of an event, where another may begin: a blank line (LF, CR or CRLF line ends).
_EVENT_ENDS = (b"\n\n", b"\r\r", b"\n\r\n", b"\r\r\n")
AGENT_CHECK_S = 1.0  # how often a stream being relayed looks whether its agent is still there


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


async def _answer(
    request: web.Request, reply: Reply, flow: Flow, sent: _Sent
) -> web.StreamResponse:
    """Turn a reply into the agent's response, streaming it chunk by chunk when it is a stream;
    `sent` follows what of a stream went out. A stream cut mid-way (StreamCut) gets its tail
    (`_cut_tail`) and its connection closed before StreamCut goes on."""
    headers = reply.headers
    headers.update(flow.reply_headers)
    headers["X-Request-Id"] = flow.request_id
    headers["X-Proxy-Attempts"] = str(flow.attempts)
    if reply.stream is None:
        return web.Response(status=reply.status, headers=headers, body=reply.body)
    response = web.StreamResponse(status=reply.status, headers=headers)
    watch = _AgentWatch(request)
    try:
        await response.prepare(request)
        sent.response = response
        async for chunk in reply.stream:
            await response.write(chunk)
            sent.written += len(chunk)
            sent.ending = (sent.ending + chunk[-4:])[-4:]
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


def _cut_tail(reply: Reply, err: ProxyError, sent: _Sent) -> bytes:
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
    request: web.Request, response: web.StreamResponse, reply: Reply, err: ProxyError, sent: _Sent
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


async def proxy_request(request: web.Request) -> web.StreamResponse:
    """Receive, match, run the route's chain, answer; then one metrics update and one log line."""
    state = request.app[STATE]
    clock = state.clock
    started = clock.now()
    rid = _request_id(request)
    route: Route | None = None
    flow: Flow | None = None
    status = 500
    cut: str | None = None  # why the proxy cut the exchange short, if it did
    answering = False
    sent = _Sent()
    response: web.StreamResponse | None = None
    try:
        if request.method in REFUSED_METHODS:
            raise _refused_method(request.method)
        route, target = state.router.match(request.raw_path)  # type: ignore[union-attr]
        route.metrics.in_flight.inc()
        caller = None
        if state.clients is not None:  # before anything is read, counted or sent
            caller = await state.clients.admit(route.profile, request.headers, target.query_string)
        body = await _read_body(request, state.config.server.max_body_bytes)
        timeouts = route.config.timeouts
        flow = Flow(
            route=route.name,
            method=request.method,
            path=target.rest if route.config.strip_prefix else route.config.prefix + target.rest,
            query_string=target.query_string,
            headers=_forwarded_host(
                request,
                request_headers(
                    request.headers,
                    set_headers=route.set_headers,
                    remove=route.remove_headers,
                    client_ip=request.remote,
                    proto=request.scheme,
                    request_id=rid,
                ),
            ),
            body=body,
            request_id=rid,
            client=caller.name if caller is not None else client_identity(request.headers),
            deadline=started + timeouts.total,
            started=started,
        )
        if caller is not None:
            caller.scrub(flow)  # the client token never reaches the vendor
        # An MCP tool call may run for minutes before its answer begins: stop it, and its
        # upstream call, once the agent has gone (aiohttp's handler_cancellation is off).
        watch = _AgentWatch(request) if route.config.mcp is not None else None
        try:
            reply = await route.handler(flow)
        finally:
            if watch is not None:
                watch.stop()
        status = reply.status
        answering = True
        response = await _answer(request, reply, flow, sent)
    except ProxyError as err:
        status = err.status
        response = _error_answer(err, rid, route, flow)
    except StreamCut as stopped:
        if sent.response is None:  # cut before any answer began: an error answer still can
            status = stopped.error.status
            response = _error_answer(stopped.error, rid, route, flow)
        else:
            # Its status stands and `_answer` ended the connection; the log line says why.
            # Handing aiohttp the sent response keeps it quiet: its final write finds the
            # connection closed, which it takes as the agent gone.
            cut = stopped.error.type
            response = sent.response
    except ConnectionError:
        # The agent went away, or read nothing of a streamed answer for send_timeout.
        transport = request.transport
        if sent.response is None and transport is not None and not transport.is_closing():
            status = 500
            raise  # not the agent's connection that failed: a bug, logged with its traceback
        why = cut_reason(request)
        if sent.response is None:
            status, cut = 499, why or "client_gone"
        elif why or not sent.complete:
            cut = why or "client_gone"  # mid-stream: the status sent stands
        # else the agent had the whole answer and left before its last chunk's end: not a cut.
        if transport is not None:
            transport.close()
        # Returned, not raised: aiohttp would log a raised one as "Error handling request". Its
        # own final write finds the connection closed and it stops there, quietly.
        response = sent.response or web.StreamResponse(status=499)
    except asyncio.CancelledError:
        # With aiohttp's handler_cancellation on, an agent leaving cancels its handler.
        transport = request.transport
        gone = transport is None or transport.is_closing()
        cut = cut_reason(request) or ("client_gone" if gone else "cancelled")
        task = asyncio.current_task()
        if cut != "shutdown" or answering or task is None:
            if cut == "client_gone" and sent.response is None:
                status = 499
            raise  # mid-stream, the status already sent stands; the log line says it was cut
        # Outlived shutdown_grace before any answer: tell the agent rather than drop it.
        task.uncancel()
        stopping = ShuttingDown(
            "the proxy is shutting down and this request outlived server.shutdown_grace; "
            "send it again"
        )
        status = stopping.status
        response = _error_answer(stopping, rid, route, flow)
    finally:
        elapsed = clock.now() - started
        if route is not None:
            route.metrics.in_flight.dec()
            upstream_s = flow.upstream_seconds + flow.waited_seconds if flow else 0.0
            route.metrics.observe(status, elapsed, elapsed - upstream_s)
        if cut is not None and sent.response is not None and route is not None:
            state.metrics.stream_cut(route.name, cut)
        if state.log_requests:
            written = sent.written if sent.response is not None else _body_bytes(request, response)
            # The proxy's own error, also when it travels in a 200 (an MCP tool error).
            error = response.headers.get("X-Proxy-Error") if response is not None else None
            error = error or (flow.error if flow else None)
            _log_request(request, rid, route, flow, status, elapsed, cut, written, error)
    assert response is not None  # every branch that does not raise answers
    return response


def _body_bytes(request: web.Request, response: web.StreamResponse | None) -> int:
    """The body bytes a whole (not streamed) answer carries to the agent."""
    if response is None or request.method == "HEAD" or not isinstance(response, web.Response):
        return 0
    return response.content_length or 0


def _log_request(
    request: web.Request,
    rid: str,
    route: Route | None,
    flow: Flow | None,
    status: int,
    elapsed: float,
    cut: str | None = None,
    written: int = 0,
    error: str | None = None,
) -> None:
    """The one access-log line of a request; credentials are redacted by the log processor.
    `cut`: why the proxy cut it short (shutdown, send_timeout, client_gone, or the error type
    of an upstream stream's failure), if it did; `written`: the body bytes sent to the agent;
    `error`: the type of the error the proxy answered, if it did."""
    log.info(
        "request",
        request_id=rid,
        route=route.name if route else None,
        method=request.method,
        path=request.path,
        query=redact_query(request.query_string) if request.query_string else None,
        status=status,
        duration_ms=round(elapsed * 1000, 2),
        upstream_ms=round(flow.upstream_seconds * 1000, 2) if flow else None,
        attempts=flow.attempts if flow else 0,
        retries=flow.retry_reasons or None if flow else None,
        cache=flow.cache if flow else None,
        breaker=flow.breaker if flow else None,
        provider=flow.provider if flow else None,
        hedges=flow.hedges or None if flow else None,
        cut=cut,
        bytes=written,
        error=error,
        rpc=flow.rpc if flow else None,
    )


# ---------------------------------------------------------------------------------------------
# Reserved endpoints


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process is serving."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: routes are loaded and, when Redis is configured, it answers."""
    state = request.app[STATE]
    body: dict[str, object] = {"routes": sorted(state.routes)}
    ready = bool(state.routes) and state.session is not None
    if state.redis is not None:
        redis_ok = await state.redis.ping()
        body["redis"] = "up" if redis_ok else "down"
        ready = ready and redis_ok
    else:
        body["redis"] = "not configured"
    body["status"] = "ready" if ready else "not ready"
    return web.json_response(body, status=200 if ready else 503)


async def metrics_endpoint(request: web.Request) -> web.Response:
    """Prometheus exposition of this process's registry."""
    state = request.app[STATE]
    return web.Response(
        body=generate_latest(state.metrics.registry),
        headers={"Content-Type": CONTENT_TYPE_LATEST},
    )


async def search_endpoint(request: web.Request) -> web.Response:
    """POST /v1/search: one normalised search across the configured providers; one access-log
    line like every request's, with the providers tried and the vendor calls made."""
    state = request.app[STATE]
    started = state.clock.now()
    rid = _request_id(request)
    trace = SearchTrace()
    status = 500
    try:
        if request.method != "POST":
            err = MethodNotAllowed(
                f"{request.method} /v1/search is not supported: send POST with a JSON body like "
                '{"query": "..."}',
                route="search",
                headers={"Allow": "POST"},
            )
            response = error_response(err, rid)
        else:
            api = state.search_api
            assert api is not None  # built at start-up, before the first request
            gate = state.clients  # with clients: a known token as `Authorization: Bearer`
            try:
                caller = await gate.admit(None, request.headers, "") if gate else None
            except ProxyError as err:
                response = error_response(err, rid)
            else:
                response = await api.handle(request, rid, trace, caller.name if caller else "")
        status = response.status
        return response
    except (ConnectionError, asyncio.CancelledError):
        status = 499
        raise
    finally:
        if state.log_requests:
            _log_search(request, rid, trace, status, state.clock.now() - started)


def _log_search(
    request: web.Request, rid: str, trace: SearchTrace, status: int, elapsed: float
) -> None:
    """The access-log line of a /v1/search request: `attempts` counts its vendor calls."""
    log.info(
        "request",
        request_id=rid,
        route="search",
        method=request.method,
        path=request.path,
        query=redact_query(request.query_string) if request.query_string else None,
        status=status,
        duration_ms=round(elapsed * 1000, 2),
        queries=trace.queries,
        providers=trace.providers or None,
        attempts=trace.calls,
    )


async def mcp_endpoint(request: web.Request) -> web.StreamResponse:
    """The proxy's own MCP server at mcp_server.path (proxy/mcp_server.py): its access rule
    first, then the body, bounded like every request's; one access-log line per request."""
    state = request.app[STATE]
    started = state.clock.now()
    rid = _request_id(request)
    trace = McpTrace()
    status = 500
    try:
        mcp = state.mcp
        assert mcp is not None  # built with the app
        try:
            caller = await mcp.admit(request)
            body = await _read_body(request, state.config.server.max_body_bytes)
            response = await mcp.handle(request, body, rid, caller, trace)
        except ProxyError as err:
            response = error_response(err, rid)
        except ConnectionError:  # the agent left before its answer: nothing more to send
            status = 499
            if request.transport is not None:
                request.transport.close()
            # Returned, not raised (aiohttp would log "Error handling request"); its own final
            # write finds the connection closed and stops there.
            return web.StreamResponse(status=499)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499
        raise
    finally:
        if state.log_requests:
            _log_mcp(request, rid, trace, status, state.clock.now() - started)


def _log_mcp(request: web.Request, rid: str, trace: McpTrace, status: int, elapsed: float) -> None:
    """The access-log line of an /mcp request: its JSON-RPC method and, for a tool call, the
    tool, its error type if it failed, and what its search did (`attempts`: vendor calls)."""
    search = trace.search
    log.info(
        "request",
        request_id=rid,
        route="mcp",
        method=request.method,
        path=request.path,
        status=status,
        duration_ms=round(elapsed * 1000, 2),
        rpc=trace.rpc,
        tool=trace.tool,
        error=trace.error,
        queries=search.queries or None,
        providers=search.providers or None,
        attempts=search.calls,
    )


async def openapi_endpoint(request: web.Request) -> web.Response:
    """GET /openapi.json: the OpenAPI 3.1 document of /v1/search, with this config's limits."""
    api = request.app[STATE].search_api
    assert api is not None  # built at start-up, before the first request
    return await api.openapi(request)


async def admin_endpoint(request: web.Request) -> web.Response:
    """/admin/*: breaker state and reset, cache purge (see proxy/admin.py for access)."""
    return await request.app[STATE].admin.dispatch(request)  # type: ignore[union-attr]


async def admin_elsewhere(request: web.Request) -> web.Response:
    """/admin/* on the agents' port: not here, and says where."""
    err = NotFound(
        "the admin endpoints are not served on this port: they have a listener of their own "
        "(server.admin_host:server.admin_port, 127.0.0.1:8081 unless configured)"
    )
    return error_response(err, _request_id(request))


@web.middleware
async def own_error_shape(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's router answers some requests itself, in plain text: a method a reserved
    endpoint does not take, a CONNECT authority-form target, a body past client_max_size.
    Those answers take our JSON shape like every other error the proxy writes."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        err: ProxyError
        if request.method in REFUSED_METHODS:
            err = _refused_method(request.method)
        elif isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(exc.allowed_methods))
            err = MethodNotAllowed(
                f"{request.method} {request.path} is not supported; use {allowed}",
                headers={"Allow": allowed},
            )
        elif isinstance(exc, web.HTTPNotFound):
            err = NotFound(
                f"{request.raw_path!r} is not a path this proxy serves; send requests to a "
                "route prefix such as /tavily/search"
            )
        elif isinstance(exc, web.HTTPRequestEntityTooLarge):
            limit = request.app[STATE].config.server.max_body_bytes
            err = PayloadTooLarge(
                f"request body exceeds the limit of {limit} bytes; send a smaller request"
            )
        else:
            raise
        return error_response(err, _request_id(request))


# ---------------------------------------------------------------------------------------------
# Assembly


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Own the pooled session, the Redis link and the routes' background tasks."""
    state = app[STATE]
    server = state.config.server
    connector = aiohttp.TCPConnector(
        limit=server.upstream_connections,
        limit_per_host=server.upstream_connections_per_host,
        keepalive_timeout=server.keepalive_timeout,
        ttl_dns_cache=300,
    )
    state.session = aiohttp.ClientSession(
        connector=connector,
        auto_decompress=True,
        timeout=aiohttp.ClientTimeout(total=None),
        # One session serves every agent: a vendor's cookie for one must never reach another.
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent",),
    )
    if state.config.redis is not None:
        rc = state.config.redis
        state.redis = RedisLink(
            rc.url, rc.key_prefix, timeout=rc.timeout, events=state.metrics, clock=state.clock
        )
        state.metrics.redis_up.set(1)
    deps = Deps(state.config, state.session, state.clock, state.metrics, state.redis)
    for name, cfg in state.config.routes.items():
        deps.routes[name] = build_route(cfg, deps)
    state.routes = deps.routes
    state.router = Router([(r.config.prefix, r) for r in state.routes.values()])
    state.search_api = SearchApi(state.config.search_api, state.routes, state.metrics, state.clock)
    state.admin = Admin(state.routes, admin_token(state.config.server))
    _identify_clients(state)
    for route in state.routes.values():
        if route.breaker is not None:
            await route.breaker.start()
    try:
        yield
    finally:
        for route in state.routes.values():
            if route.breaker is not None:
                await route.breaker.stop()
        await state.session.close()
        if state.redis is not None:
            await state.redis.close()


def _identify_clients(state: ProxyState) -> None:
    """The client gate when `clients:` is configured; warnings for what it leaves open."""
    config = state.config
    if not config.clients:
        for name, cfg in config.routes.items():
            if cfg.rate_limit is not None and cfg.rate_limit.key == "client":
                log.warning(
                    "client_key_unverified",
                    route=name,
                    hint="rate_limit.key: client keys on credentials any caller can make up; "
                    "configure clients: to identify callers",
                )
        return
    limits = {n: c.daily_requests for n, c in config.clients.items() if c.daily_requests}
    quota = DailyQuota(limits, quota_store(state.clock, state.redis))
    state.clients = ClientGate(config.clients, quota, state.metrics)
    for name in keyless_routes(state.routes):
        log.warning(
            "route_injects_no_key",
            route=name,
            hint="with clients configured the agent's token is not forwarded: set the vendor "
            "key in this route's headers.set, or its vendor answers without one",
        )


def build_app(
    config: Config, *, clock: Clock = SYSTEM_CLOCK, metrics: Metrics | None = None
) -> web.Application:
    """The proxy as an aiohttp application (start it with web.run_app or an AppRunner)."""
    # Bodies are bounded by our own check so the agent gets the JSON 413, not aiohttp's text one;
    # the +1 lets aiohttp's own limit sit just past ours.
    app = web.Application(
        client_max_size=config.server.max_body_bytes + 1, middlewares=[own_error_shape]
    )
    app[STATE] = ProxyState(
        config=config,
        clock=clock,
        metrics=metrics or Metrics(),
        # The access line is skipped outright, not built and filtered, below level info.
        log_requests=logging.getLevelNamesMapping()[config.log.level.upper()] <= logging.INFO,
        mcp=McpEndpoint(config.mcp_server),
    )
    app.cleanup_ctx.append(_lifecycle)
    app.cleanup_ctx.append(_mcp_lifecycle)  # after _lifecycle: it searches with its routes
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_route("*", "/v1/search", search_endpoint)
    app.router.add_get("/openapi.json", openapi_endpoint)
    app.router.add_route("*", "/admin", admin_elsewhere)
    app.router.add_route("*", "/admin/{tail:.*}", admin_elsewhere)
    _mount_mcp(app, config)
    app.router.add_route("*", "/{tail:.*}", proxy_request)
    return app


def _mount_mcp(app: web.Application, config: Config) -> None:
    """The MCP server's path (and with a trailing slash, as some clients write it). When it is
    off, the path says how to turn it on, unless a route's prefix serves it."""
    path = config.mcp_server.path
    if not config.mcp_server.enabled and any(
        r.prefix == path or path.startswith(r.prefix + "/") for r in config.routes.values()
    ):
        return
    app.router.add_route("*", path, mcp_endpoint)
    app.router.add_route("*", path + "/", mcp_endpoint)


async def _mcp_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Run the MCP server (proxy/mcp_server.py) over the search API `_lifecycle` built."""
    state = app[STATE]
    assert state.mcp is not None and state.search_api is not None
    async with state.mcp.running(
        state.search_api, state.clients, state.config.server.max_body_bytes
    ):
        yield


def build_admin_app(app: web.Application) -> web.Application:
    """The admin endpoints of the proxy `app`, for their own listener: start it after `app`,
    whose start-up builds the routes they act on."""
    admin = web.Application(middlewares=[own_error_shape])
    admin[STATE] = app[STATE]
    admin.router.add_get("/admin/breakers", admin_endpoint, name="breakers")
    admin.router.add_post("/admin/breakers/{route}/reset", admin_endpoint, name="reset_breaker")
    admin.router.add_delete("/admin/cache/{route}", admin_endpoint, name="clear_cache")
    return admin

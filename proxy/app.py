"""The aiohttp application: reserved endpoints, and the one handler every proxied request takes.

Reserved paths, answered by the proxy itself on the main port: /healthz, /readyz, /metrics,
/v1/search, /v1/fetch, /openapi.json, and the MCP server at mcp_server.path (/mcp); /admin/...
only says where the admin listener is (`build_admin_app`). Config refuses route prefixes that
collide with them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog
from aiohttp import HttpVersion11, web
from aiohttp.typedefs import Handler
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from policies.core.clock import SYSTEM_CLOCK, Clock
from policies.core.credentials import is_credential_name
from policies.core.errors import ProxyError
from policies.core.flow import CallBudget, Flow
from proxy import __version__
from proxy.access import request_id, route_fields
from proxy.bodies import inflated, read_body
from proxy.budget import budget_for
from proxy.clients import foreign_page
from proxy.config import Config
from proxy.dialects import error_response
from proxy.direct import DirectHooks
from proxy.envelope import Exchange, answer, enveloped, watch_agent
from proxy.errors import (
    ExpectationFailed,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
)
from proxy.fetch_api import FetchTrace
from proxy.fleet import FLEET, exposition
from proxy.front import ROUTE_HANDLER
from proxy.generation import build_generation
from proxy.headers import request_headers
from proxy.keys import one_key
from proxy.mcp_server import McpEndpoint, McpTrace
from proxy.metrics import Metrics
from proxy.oauth import is_oauth_path, oauth_answer
from proxy.outbound import VendorPool
from proxy.reload import RELOADER, Reloader, reload_endpoint
from proxy.search_api import SearchTrace
from proxy.series import Series
from proxy.state import STATE, ProxyState
from proxy.status import Pulse
from proxy.statuspage import status_endpoint, status_page
from proxy.wire import AgentRequest

__all__ = ["STATE", "build_admin_app", "build_app", "client_identity"]

log = structlog.get_logger("search_proxy")

# Refused whatever the path: CONNECT would open a tunnel; TRACE and TRACK echo the request,
# credentials included, back to the caller. No vendor API uses them.
REFUSED_METHODS = frozenset({"CONNECT", "TRACE", "TRACK"})
ROUTE_METHODS = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"
# The route label /v1/search is counted under in the request metrics (/mcp: its path).
SEARCH_LABEL = "/v1/search"
FETCH_LABEL = "/v1/fetch"
# Set on the admin endpoints' own application: its 404 lists them.
ADMIN_LISTENER = web.AppKey("admin_listener", bool)


def client_identity(headers: CIMultiDictProxy[str]) -> str:
    """A short, stable hash of the caller's credentials, every header whose name is one
    (policies/core/credentials.py) but Cookie; "" when it sent none. A cookie is state a server
    handed the caller and may change under it (a load balancer's sticky cookie after an MCP
    `initialize`): it would make a new caller of the same one."""
    parts = sorted(
        (name.lower(), value)
        for name, value in headers.items()
        if value and is_credential_name(name) and name.lower() != "cookie"
    )
    if not parts:
        return ""
    text = "\n".join(f"{name}:{value}" for name, value in parts)
    # surrogateescape: a header's non-UTF-8 bytes count as they came, and never raise.
    return hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()


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


def _as_read(request: web.Request, headers: CIMultiDict[str]) -> CIMultiDict[str]:
    """The body goes on as it was read: one that aiohttp inflated is no longer encoded."""
    if inflated(request):
        headers.popall("Content-Encoding", None)
    return headers


def _refuse_foreign_page(request: web.Request, state: ProxyState, what: str) -> None:
    """A browser page of another site may not spend the proxy's vendor keys: a form's POST
    needs no CORS preflight, and a page whose name was rebound to this machine (DNS rebinding)
    sends its own Origin. With client tokens a page could not anyway: it knows none."""
    origin = request.headers.get("Origin")
    if origin is None or state.clients is not None:
        return
    page = foreign_page(origin)
    if page is not None:
        raise Forbidden(
            f"search-proxy does not serve browser pages from other sites (Origin {page!r}) "
            f"on {what}: call it from an agent or its SDK, or configure clients: tokens for "
            "browser callers",
            route=what,
        )


async def proxy_request(request: web.Request, ex: Exchange) -> web.StreamResponse:
    """Match the route, build the request's flow, run the route's chain, answer."""
    state = request.app[STATE]
    if request.method in REFUSED_METHODS:
        raise _refused_method(request.method)
    try:
        route, target = state.router.match(request.raw_path)  # type: ignore[union-attr]
    except NotFound:
        if is_oauth_path(request.path):  # an MCP client looking for OAuth: say there is none
            return oauth_answer(request.path, ex.request_id)
        raise
    ex.name, ex.route = route.name, route
    ex.count_as(route.metrics)
    _refuse_foreign_page(request, state, route.name)
    profile = route.profile
    body = await read_body(request, state.config.server.max_body_bytes, route.name)
    caller = None
    if state.clients is not None:  # before anything is counted or sent
        caller = await state.clients.admit(profile, request.headers, target.query_string, body)
    flow = ex.flow = Flow.new(
        route=route.name,
        method=request.method,
        path=target.rest if route.config.strip_prefix else route.config.prefix + target.rest,
        query_string=target.query_string,
        headers=_as_read(
            request,
            _forwarded_host(
                request,
                request_headers(
                    request.headers,
                    set_headers=route.set_headers,
                    remove=route.remove_headers,
                    client_ip=request.remote,
                    proto=request.scheme,
                    request_id=ex.request_id,
                ),
            ),
        ),
        body=body,
        request_id=ex.request_id,
        client=caller.name if caller is not None else client_identity(request.headers),
        deadline=ex.started + route.config.timeouts.total,
        started=ex.started,
        calls=CallBudget(
            route.config.max_calls_per_request,
            route.calls_setting,
            "its retries, hedges, simplified variants and failovers stop there",
        ),
    )
    if caller is not None:  # the client token never reaches the vendor
        flow = ex.flow = flow.with_request(caller.scrub(flow.request))
    if route.body_key is not None:  # nor the agent's key beside the route's
        keyed = one_key(profile, route.body_key, flow.request)
        if keyed is not flow.request:
            flow = ex.flow = flow.with_request(keyed)
    ex.fields = lambda: route_fields(flow.trace)
    # An MCP tool call may run for minutes before its answer begins: stop it, and its
    # upstream call, once the agent has gone (aiohttp's handler_cancellation is off).
    watch = watch_agent(request) if route.config.has("mcp") else None
    try:
        reply = await route.handler(flow)
    finally:
        if watch is not None:
            watch.stop()
    replays = route.replays
    if flow.trace.cached is not None and replays is not None and isinstance(request, AgentRequest):
        request.hit = (replays, flow.trace.cached)  # the front remembers what it writes
    return await answer(request, reply, ex)


# ---------------------------------------------------------------------------------------------
# Reserved endpoints


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process is serving."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: routes are loaded and, when Redis is configured, it answers."""
    state = request.app[STATE]
    body: dict[str, object] = {"routes": sorted(state.routes)}
    ready = bool(state.routes) and state.vendors is not None
    if state.redis is not None:
        redis_ok = await state.redis.ping()
        body["redis"] = "up" if redis_ok else "down"
        ready = ready and redis_ok
    else:
        body["redis"] = "not configured"
    body["status"] = "ready" if ready else "not ready"
    return web.json_response(body, status=200 if ready else 503)


async def metrics_endpoint(request: web.Request) -> web.Response:
    """Prometheus exposition of this process's registry; a worker of several answers for all of
    them, added up (proxy/fleetmetrics.py)."""
    state = request.app[STATE]
    fleet = request.app.get(FLEET)
    return web.Response(
        body=generate_latest(state.metrics.registry)
        if fleet is None
        else await exposition(fleet, state.metrics),
        headers={"Content-Type": CONTENT_TYPE_LATEST},
    )


async def search_endpoint(request: web.Request, ex: Exchange) -> web.StreamResponse:
    """POST /v1/search: one normalised search across the configured providers; its access line
    names the providers tried and the vendor calls made (`attempts`)."""
    state = request.app[STATE]
    ex.count_as(state.endpoint_metrics[SEARCH_LABEL])
    trace = SearchTrace()
    ex.fields = lambda: {
        "queries": trace.queries,
        "providers": trace.providers or None,
        "attempts": trace.calls,
    }
    api = state.search_api
    assert api is not None  # built at start-up, before the first request
    example = '{"query": "..."}'
    return await _own_api(
        request, "search", example, lambda c: api.handle(request, ex.request_id, trace, c)
    )


async def fetch_endpoint(request: web.Request, ex: Exchange) -> web.StreamResponse:
    """POST /v1/fetch: pages by URL across the fetch providers; its access line names the
    providers asked, the vendor calls made (`attempts`) and the pages answered."""
    state = request.app[STATE]
    ex.count_as(state.endpoint_metrics[FETCH_LABEL])
    trace = FetchTrace()
    ex.fields = lambda: {
        "urls": trace.urls,
        "providers": trace.providers or None,
        "attempts": trace.calls,
        "pages": trace.pages,
        "cached": trace.cached or None,
    }
    api = state.fetch_api
    assert api is not None  # built at start-up, before the first request
    example = '{"urls": ["https://example.com/page"]}'
    return await _own_api(
        request, "fetch", example, lambda c: api.handle(request, ex.request_id, trace, c)
    )


async def _own_api(
    request: web.Request,
    route: str,
    example: str,
    answer: Callable[[str], Awaitable[web.Response]],
) -> web.Response:
    """What /v1/search and /v1/fetch share around their API: POST only (a body like `example`),
    and with clients: a known token as `Authorization: Bearer`, whose name `answer` is given."""
    _refuse_foreign_page(request, request.app[STATE], route)
    if request.method != "POST":
        raise MethodNotAllowed(
            f"{request.method} /v1/{route} is not supported: send POST with a JSON body like "
            f"{example}",
            route=route,
            headers={"Allow": "POST"},
        )
    gate = request.app[STATE].clients
    caller = await gate.admit(None, request.headers, "") if gate else None
    return await answer(caller.name if caller else "")


async def mcp_endpoint(request: web.Request, ex: Exchange) -> web.StreamResponse:
    """The proxy's own MCP server at mcp_server.path (proxy/mcp_server.py): its access rule
    first, then the body, bounded like every request's. The access line names the JSON-RPC
    method and, for a tool call, the tool and what its search did (`attempts`: vendor calls)."""
    state = request.app[STATE]
    ex.count_as(state.endpoint_metrics[state.config.mcp_server.path])
    trace = McpTrace()
    search = trace.search

    def fields() -> dict[str, object]:
        return {
            "rpc": trace.rpc,
            "tool": trace.tool,
            "queries": search.queries or None,
            "providers": search.providers or None,
            "attempts": search.calls,
        }

    ex.fields = fields
    mcp = state.mcp
    assert mcp is not None  # built with the app
    caller = await mcp.admit(request)
    server = state.config.server
    body = await read_body(request, server.max_body_bytes, state.config.mcp_server.path)
    who = caller.name if caller is not None else client_identity(request.headers)
    # A tool call stops, with its vendor calls, once its client has gone.
    watch = watch_agent(request)
    try:
        return await mcp.handle(request, body, ex.request_id, caller, trace, who)
    finally:
        watch.stop()
        ex.error = trace.error  # a tool error inside a 200: the log line and the status page


async def openapi_endpoint(request: web.Request) -> web.Response:
    """GET /openapi.json: the OpenAPI 3.1 document of /v1/search and /v1/fetch, with this
    config's limits (built at start-up)."""
    return web.Response(body=request.app[STATE].openapi_json, content_type="application/json")


async def admin_endpoint(request: web.Request) -> web.Response:
    """/admin/*: breaker state and reset, cache purge (see proxy/admin.py for access)."""
    return await request.app[STATE].admin.dispatch(request)  # type: ignore[union-attr]


async def admin_elsewhere(request: web.Request) -> web.Response:
    """/admin/* on the agents' port: not here, and says where."""
    err = NotFound(
        "the admin endpoints are not served on this port: they have a listener of their own, "
        f"at {request.app[STATE].admin_at()} (server.admin_host:server.admin_port, or "
        "--admin-port)"
    )
    return error_response(err, request_id(request.headers))


def _not_found(request: web.Request) -> NotFound:
    """A path no handler of this listener takes: on the admin listener, the admin endpoints it
    serves and where agents go instead; on the agents' port, where requests go."""
    path = repr(request.raw_path)
    if not request.app.get(ADMIN_LISTENER, False):
        return NotFound(
            f"{path} is not a path this proxy serves; send requests to a route prefix such as "
            "/tavily/search"
        )
    served = ", ".join(
        f"{route.method} {route.resource.canonical}"
        for route in request.app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    )
    agents = request.app[STATE].agents_address or "the agents' port (server.port)"
    return NotFound(
        f"{path} is not an admin endpoint; this listener serves {served}. Agents' requests "
        f"(route prefixes such as /tavily/search, /v1/search, /v1/fetch, /mcp) go to {agents}"
    )


async def expect(request: web.Request) -> web.StreamResponse | None:
    """An `Expect` header, before the handler runs (and before any middleware): 100-continue
    is met as aiohttp meets it; any other is a 417 in the proxy's JSON shape (aiohttp's own
    answer is plain text)."""
    if request.version != HttpVersion11:
        return None
    if request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the body's answer has not begun
        return None
    err = ExpectationFailed(
        f"Expect: {request.headers['Expect'][:64]!r} is not supported (only 100-continue); "
        "send the request without it"
    )
    return error_response(err, request_id(request.headers))


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
            err = _not_found(request)
        elif isinstance(exc, web.HTTPRequestEntityTooLarge):
            limit = request.app[STATE].config.server.max_body_bytes
            err = PayloadTooLarge(
                f"request body exceeds the limit of {limit} bytes; send a smaller request"
            )
        else:
            raise
        return error_response(err, request_id(request.headers))


# ---------------------------------------------------------------------------------------------
# Assembly


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Own the pooled session, the Redis link, the serving generation (its routes and their
    background tasks), the status sampler and the config watch."""
    state = app[STATE]
    server = state.config.server
    # No cookie jar, no User-Agent of ours: a vendor's cookie for one agent never reaches
    # another, and the agent's own User-Agent goes through.
    state.vendors = VendorPool(
        server.upstream_connections,
        server.upstream_connections_per_host,
        server.keepalive_timeout,
    )
    metrics = state.metrics
    metrics.redis_is_configured(state.config.redis is not None)
    if state.config.redis is not None:
        from policies.core.redislink import RedisLink  # redis-py: loaded only when configured

        rc = state.config.redis
        state.redis = RedisLink(
            rc, rc.key_prefix, timeout=rc.timeout, events=metrics, clock=state.clock
        )
        await state.redis.warm()  # a burst at start-up finds its connections open
    metrics.identify(__version__, state.config_hash)
    state.endpoint_metrics = {
        label: metrics.route(label)
        for label in (SEARCH_LABEL, FETCH_LABEL, state.config.mcp_server.path)
    }
    generation = build_generation(
        state.config,
        state.vendors,
        state.clock,
        metrics,
        state.redis,
        serving=lambda name: state.routes.get(name),
        direct_hooks=state.direct_hooks,
    )
    await generation.start()
    state.use(generation)
    # From here on the state holds the serving generation: this frame lives as long as the app,
    # and keeping the first one here would keep its routes (their caches) past every reload.
    del generation
    assert state.pulse is not None
    tasks = [asyncio.create_task(state.pulse.run(), name="status-pulse")]
    if state.config_path is not None:
        tasks.append(asyncio.create_task(app[RELOADER].watch(), name="config-watch"))
    try:
        yield
    finally:
        await app[RELOADER].close()  # first: a reload under way completes its swap
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if state.generation is not None:
            await state.generation.release(None)
        state.vendors.close()
        if state.redis is not None:
            await state.redis.close()


def build_app(
    config: Config,
    *,
    clock: Clock = SYSTEM_CLOCK,
    metrics: Metrics | None = None,
    config_path: str | None = None,
    config_hash: str = "",
    direct_hooks: DirectHooks | None = None,
) -> web.Application:
    """The proxy as an aiohttp application (start it with web.run_app or an AppRunner). With
    `config_path` (the file `config` was read from, whose hash is `config_hash`) it can reload
    (proxy/reload.py) and watches the file; `direct_hooks` replace the direct fetcher's DNS and
    watch its connects (tests)."""
    # Bodies are bounded by our own check so the agent gets the JSON 413, not aiohttp's text one;
    # the +1 lets aiohttp's own limit sit just past ours.
    app = web.Application(
        client_max_size=config.server.max_body_bytes + 1, middlewares=[own_error_shape]
    )
    metrics = metrics or Metrics()
    state = app[STATE] = ProxyState(
        config=config,
        clock=clock,
        metrics=metrics,
        # The access line is skipped outright, not built and filtered, below level info.
        log_requests=logging.getLevelNamesMapping()[config.log.level.upper()] <= logging.INFO,
        mcp=McpEndpoint(config.mcp_server),
        config_path=config_path,
        config_hash=config_hash,
        series=Series(metrics),
        pulse=Pulse(metrics),
        direct_hooks=direct_hooks,
    )
    state.memory = budget_for(config.server.max_buffered_bytes)
    metrics.watch_budget(state.memory)
    app[RELOADER] = Reloader(state)
    app.cleanup_ctx.append(_lifecycle)
    app.cleanup_ctx.append(_mcp_lifecycle)  # after _lifecycle: it searches with its routes
    app.router.add_get("/healthz", healthz, expect_handler=expect)
    app.router.add_get("/readyz", readyz, expect_handler=expect)
    app.router.add_get("/metrics", metrics_endpoint, expect_handler=expect)
    search = enveloped(search_endpoint, "search")
    app.router.add_route("*", "/v1/search", search, expect_handler=expect)
    fetch = enveloped(fetch_endpoint, "fetch")
    app.router.add_route("*", "/v1/fetch", fetch, expect_handler=expect)
    app.router.add_get("/openapi.json", openapi_endpoint, expect_handler=expect)
    app.router.add_route("*", "/admin", admin_elsewhere, expect_handler=expect)
    app.router.add_route("*", "/admin/{tail:.*}", admin_elsewhere, expect_handler=expect)
    _mount_mcp(app, config)
    # Route requests: the front's (proxy/front.py) on a GuardedRunner's listener; this
    # catch-all takes those handed to aiohttp (and every one of a test server's).
    route_handler = enveloped(proxy_request)
    app[ROUTE_HANDLER] = route_handler
    app.router.add_route("*", "/{tail:.*}", route_handler, expect_handler=expect)
    return app


def _mount_mcp(app: web.Application, config: Config) -> None:
    """The MCP server's path (and with a trailing slash, as some clients write it). When it is
    off, the path says how to turn it on, unless a route's prefix serves it."""
    path = config.mcp_server.path
    if not config.mcp_server.enabled and any(
        r.prefix == path or path.startswith(r.prefix + "/") for r in config.routes.values()
    ):
        return
    endpoint = enveloped(mcp_endpoint, "mcp")
    app.router.add_route("*", path, endpoint, expect_handler=expect)
    app.router.add_route("*", path + "/", endpoint, expect_handler=expect)


async def _mcp_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Run the MCP server (proxy/mcp_server.py) over the search API `_lifecycle` built."""
    state = app[STATE]
    assert state.mcp is not None and state.mcp.api is not None  # state.use() gave it its API
    async with state.mcp.running(state.config.server.max_body_bytes):
        yield


def build_admin_app(app: web.Application) -> web.Application:
    """The admin endpoints of the proxy `app`, for their own listener: start it after `app`,
    whose start-up builds the routes they act on."""
    admin = web.Application(middlewares=[own_error_shape])
    admin[STATE] = app[STATE]
    admin[ADMIN_LISTENER] = True
    admin[RELOADER] = app[RELOADER]
    endpoints = [
        ("GET", "/", status_page, None),
        ("GET", "/admin/status", status_endpoint, None),
        ("POST", "/admin/reload", reload_endpoint, None),
        ("GET", "/admin/breakers", admin_endpoint, "breakers"),
        ("POST", "/admin/breakers/{route}/reset", admin_endpoint, "reset_breaker"),
        ("DELETE", "/admin/cache/{route}", admin_endpoint, "clear_cache"),
    ]
    for method, path, handler, name in endpoints:
        admin.router.add_route(method, path, handler, name=name, expect_handler=expect)
    return admin

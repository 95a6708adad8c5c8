"""The proxy's own MCP server: one `web_search` tool over /v1/search's providers, served at
`mcp_server.path` (`/mcp`) over MCP's streamable HTTP transport.

The MCP side is the official `mcp` package: its low-level `Server` with our two handlers
(tools/list, tools/call), run by its `StreamableHTTPSessionManager` in stateless JSON mode, so
no client session is held between requests and every POST is answered with one JSON-RPC
message. The package speaks ASGI; `serve_asgi` below bridges one aiohttp request to it.

A tool call (proxy/mcp_tool.py) runs `SearchApi.answer`, the very code /v1/search runs
(providers in order with failover, breakers, cache, simplified queries, the per-request call
budget), with the caller's identity, within `mcp_server.call_timeout` for the whole call. Its
result is a text block an LLM reads and, as `structuredContent`, the normalised answer
/v1/search gives for one query. A failure is a tool error (`isError: true`) whose text is the
proxy's own message, the one /v1/search answers with. A call stops, with every vendor attempt,
when its client leaves or cancels it (in stateless mode a `notifications/cancelled` comes on a
POST of its own: `RunningCalls` finds the call it names).

Access (`admit`): with `clients:` configured, a known client token as `Authorization: Bearer`;
otherwise loopback peers only unless `mcp_server.allow_remote`. Our own checks replace the
package's DNS-rebinding protection: a loopback-only server also wants a loopback `Host`, and a
browser page (`Origin`) must itself be on a loopback host. The access-log line is written by
proxy/app.py (`mcp_endpoint`), never with the Authorization header.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from aiohttp import web
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.types import Message, Scope

from policies.core.errors import ProxyError, seconds_text
from policies.core.route import HOP_BY_HOP
from proxy import __version__
from proxy.clients import Caller, ClientGate, hostname, is_loopback_host
from proxy.config import McpServerConfig
from proxy.errors import Forbidden, InternalError, MethodNotAllowed, NotFound
from proxy.mcp_fetch import FetchTool
from proxy.mcp_tool import (
    INSTRUCTIONS,
    TOOL_NAME,
    error_result,
    render_text,
    search_body,
    tool_definition,
    tool_message,
)
from proxy.search_api import SearchApi, SearchTrace

log = structlog.get_logger("search_proxy")

SCOPE_KEY = "search_proxy.mcp"  # the ASGI scope entry carrying a request's _ToolContext
DISCONNECT_POLL_S = 1.0
# How long past its deadline a call may take to wind down (a policy that does not watch the
# deadline) before it is cancelled outright.
HARD_STOP_S = 1.0


@dataclass(slots=True)
class McpTrace:
    """What one /mcp request did, for its access-log line."""

    rpc: str | None = None  # the JSON-RPC method: initialize, tools/list, tools/call ...
    tool: str | None = None
    error: str | None = None  # a tool error's type: bad_request, all_providers_failed ...
    search: SearchTrace = field(default_factory=SearchTrace)


@dataclass(frozen=True, slots=True)
class _ToolContext:
    """Who is calling and where to record what the call did; travels in the ASGI scope."""

    request_id: str
    client: str  # the client's name with clients: configured, else ""
    caller: str  # who the caller is for a cancel: its client name, or its credentials' digest
    trace: McpTrace


class RunningCalls:
    """The tool calls in flight by (caller, JSON-RPC id), so a `notifications/cancelled`,
    which a stateless server gets on a POST of its own, stops the call it names. One entry per
    running call: bounded by the proxy's connections."""

    def __init__(self) -> None:
        self._calls: dict[tuple[str, str], list[asyncio.Task[Any]]] = {}

    @staticmethod
    def _key(caller: str, request_id: Any) -> tuple[str, str]:
        return caller, orjson.dumps(request_id).decode()

    @contextlib.contextmanager
    def running(self, caller: str, request_id: Any, task: asyncio.Task[Any]) -> Iterator[None]:
        key = self._key(caller, request_id)
        self._calls.setdefault(key, []).append(task)
        try:
            yield
        finally:
            tasks = self._calls[key]
            tasks.remove(task)
            if not tasks:
                del self._calls[key]

    def cancel(self, caller: str, request_id: Any) -> bool:
        """Stop the call `caller` sent as `request_id`. Callers that cannot be told apart
        (none with credentials, on loopback) may share ids: a cancel that names more than one
        running call stops none rather than another agent's."""
        tasks = self._calls.get(self._key(caller, request_id), [])
        if len(tasks) != 1:
            if tasks:
                log.warning("mcp_cancel_ambiguous", calls=len(tasks))
            return False
        tasks[0].cancel()
        return True


# ---------------------------------------------------------------------------------------------
# Access


def is_loopback_peer(remote: str | None) -> bool:
    """Whether a peer address is this machine's loopback (IPv4-mapped IPv6 included)."""
    try:
        ip = ipaddress.ip_address(remote or "")
    except ValueError:
        return False
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def refusal(
    config: McpServerConfig,
    *,
    remote: str | None,
    host: str | None,
    origin: str | None,
    tokens: bool,
) -> Forbidden | None:
    """Why a request may not use the MCP server from where it comes (None: it may).

    With client tokens (`tokens`) any peer may, its token checked next; otherwise only a
    loopback peer calling a loopback Host, unless `allow_remote`. A browser page (`Origin`)
    must be on a loopback host itself: a page elsewhere, its name rebound to this machine's
    address (DNS rebinding), is refused."""
    if origin is not None:  # "null" (a sandboxed page) is no loopback host either
        page = hostname(origin.partition("://")[2].split("/", 1)[0])
        if not is_loopback_host(page):
            return Forbidden(
                f"search-proxy's MCP server does not serve browser pages from other sites "
                f"(Origin {page or origin!r}): call {config.path} from an MCP client, not a web "
                "page"
            )
    if tokens or config.allow_remote:
        return None
    if not is_loopback_peer(remote):
        return Forbidden(
            f"search-proxy's MCP server serves this machine only (loopback), and this request "
            f"came from {remote or 'an unknown address'}: connect from the proxy's host, or set "
            "mcp_server.allow_remote: true (better with clients: tokens configured)"
        )
    if host is not None and not is_loopback_host(hostname(host)):
        return Forbidden(
            f"search-proxy's MCP server serves loopback callers at a loopback address only, "
            f"and this request names host {hostname(host)!r}: use http://127.0.0.1 or "
            "http://localhost, or set mcp_server.allow_remote: true"
        )
    return None


# ---------------------------------------------------------------------------------------------
# ASGI bridge


def _scope(request: web.Request, extra: Mapping[str, Any]) -> Scope:
    """The ASGI scope of an aiohttp request; Authorization stays out (only our gate reads it)."""
    headers = [
        (name.lower(), value)
        for name, value in request.raw_headers
        if name.lower() != b"authorization"
    ]
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    server = (sock[0], sock[1]) if isinstance(sock, tuple) and len(sock) >= 2 else None
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": f"{request.version.major}.{request.version.minor}",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path,
        "raw_path": request.raw_path.split("?", 1)[0].encode("latin-1", "replace"),
        "query_string": request.query_string.encode("latin-1", "replace"),
        "root_path": "",
        "headers": headers,
        "client": (request.remote, 0) if request.remote else None,
        "server": server,
        "state": {},
        **extra,
    }


async def serve_asgi(
    app: Any,
    request: web.Request,
    body: bytes,
    extra: Mapping[str, Any],
    headers: Mapping[str, str],
) -> web.StreamResponse:
    """Run ASGI `app` for one aiohttp request whose body was already read (and bounded);
    `extra` joins its scope, `headers` its response.

    `receive` gives the body once, then blocks until the connection closes or the app is done
    (what an SSE response listening for a disconnect expects). `send` streams the answer; when
    the client has gone, it drops the rest quietly (the app is not told: it would log an error)
    and ConnectionResetError follows once the app is done. An app that fails before answering
    gets our 500; one that fails midway has its connection closed, so the client sees a cut
    answer."""
    done = asyncio.Event()
    delivered = gone = False
    response: web.StreamResponse | None = None

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        while not done.is_set():
            transport = request.transport
            if transport is None or transport.is_closing():
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), DISCONNECT_POLL_S)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal response, gone
        if gone:
            return
        if message["type"] == "http.response.start":
            response = web.StreamResponse(status=message["status"])
            for name, value in message.get("headers", ()):
                if name.decode("latin-1").lower() not in HOP_BY_HOP:
                    response.headers.add(name.decode("latin-1"), value.decode("latin-1"))
            response.headers.update(headers)
            return
        if message["type"] != "http.response.body" or response is None:
            return
        try:
            if not response.prepared:
                await response.prepare(request)
            chunk = message.get("body", b"")
            if chunk:
                await response.write(chunk)
            if not message.get("more_body", False):
                await response.write_eof()
        except ConnectionError:
            gone = True

    try:
        await app(_scope(request, extra), receive, send)
    except Exception:
        log.exception("mcp_server_failed", request_id=headers.get("X-Request-Id"))
        if response is None or not response.prepared:
            raise InternalError(
                "the MCP server failed to answer this request (a bug; the proxy's log has the "
                "details); send it again",
                route="mcp",
            ) from None
        if request.transport is not None:
            request.transport.close()
    finally:
        done.set()
    if gone:
        raise ConnectionResetError("the client went away before its answer was sent")
    if response is None:
        raise InternalError("the MCP server sent no answer (a bug); send it again", route="mcp")
    if not response.prepared:  # a start without a body message
        await response.prepare(request)
        await response.write_eof()
    return response


# ---------------------------------------------------------------------------------------------
# The endpoint


class McpEndpoint:
    """The MCP server of one proxy app: built with the app, running (`running`) once the
    routes and the search API exist, answering at `config.path` through proxy/app.py."""

    def __init__(self, config: McpServerConfig) -> None:
        self.config = config
        self.api: SearchApi | None = None
        self.clients: ClientGate | None = None
        self.tool: types.Tool | None = None
        self.fetch: FetchTool | None = None  # fetch_page (proxy/mcp_fetch.py); set by the app
        self.server: Server[Any, Any] = Server(
            "search-proxy", version=__version__, instructions=INSTRUCTIONS
        )
        # Our handlers straight into the request table, as the package's decorators put theirs:
        # the tool result is exactly ours (no re-validation, no exception text as a result).
        self.server.request_handlers[types.ListToolsRequest] = self._list_tools
        self.server.request_handlers[types.CallToolRequest] = self._call_tool
        self.manager: StreamableHTTPSessionManager | None = None
        self.calls = RunningCalls()

    @contextlib.asynccontextmanager
    async def running(
        self, api: SearchApi, clients: ClientGate | None, max_body_bytes: int
    ) -> AsyncIterator[None]:
        """Serve while inside: the package's session manager runs in a task of its own, which
        enters and leaves its task group (anyio wants both in one task)."""
        if not self.config.enabled:
            yield
            return
        self.use(api, clients, self.config)
        # The package's own logger says "Processing request ..." at info for every message.
        logging.getLogger("mcp").setLevel(logging.WARNING)
        if clients is None and self.config.allow_remote:
            log.warning(
                "mcp_server_open",
                path=self.config.path,
                hint="mcp_server.allow_remote without clients: anyone who reaches this port "
                "searches with the proxy's keys; configure clients: tokens",
            )
        manager = StreamableHTTPSessionManager(
            self.server,
            json_response=True,
            stateless=True,
            security_settings=None,  # no DNS-rebinding check of its own: `refusal` does it
            max_request_body_size=max_body_bytes,
        )
        started, stop = asyncio.Event(), asyncio.Event()

        async def hold() -> None:
            async with manager.run():
                self.manager = manager
                started.set()
                await stop.wait()

        holder = asyncio.create_task(hold(), name="mcp-session-manager")
        waiting = asyncio.create_task(started.wait())
        await asyncio.wait({holder, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if holder.done():
            holder.result()  # its exception, if it failed to start
        try:
            yield
        finally:
            self.manager = None
            stop.set()
            await holder

    def use(self, api: SearchApi, clients: ClientGate | None, config: McpServerConfig) -> None:
        """Search through `api` and admit by `clients` from now on (a reload's new generation;
        its path and `enabled` stay as they were served)."""
        self.api, self.clients, self.config = api, clients, config
        self.tool = tool_definition(api)

    async def admit(self, request: web.Request) -> Caller | None:
        """Whether this request may use the MCP server, and its known client: ProxyErrors
        (404 off, 405 not POST, 403 refused, 401 no known token) for the caller to render."""
        if not self.config.enabled:
            raise NotFound(
                f"this proxy's MCP server is off, so {self.config.path} serves nothing: it needs "
                "a route with a search section (web_search runs /v1/search's providers) and "
                "mcp_server.enabled not set to false",
                route="mcp",
            )
        if request.method != "POST":
            raise MethodNotAllowed(
                f"{request.method} {self.config.path} is not supported: this MCP server is "
                "stateless (streamable HTTP, JSON answers) and opens no event stream; send "
                "JSON-RPC messages with POST",
                route="mcp",
                headers={"Allow": "POST"},
            )
        refused = refusal(
            self.config,
            remote=request.remote,
            host=request.headers.get("Host"),
            origin=request.headers.get("Origin"),
            tokens=self.clients is not None,
        )
        if refused is not None:
            refused.route = "mcp"
            raise refused
        if self.clients is None:
            return None
        caller = self.clients.identify(None, request.headers, "")  # Unauthorized without one
        return caller

    async def handle(
        self,
        request: web.Request,
        body: bytes,
        rid: str,
        caller: Caller | None,
        trace: McpTrace,
        who: str,
    ) -> web.StreamResponse:
        """Answer one admitted request through the package's streamable HTTP transport; `who`
        tells this caller's calls from others' (`RunningCalls`)."""
        manager = self.manager
        if manager is None:
            raise InternalError("the MCP server is not running yet; send it again", route="mcp")
        message = _message(body)
        method = message.get("method") if message is not None else None
        trace.rpc = method[:64] if isinstance(method, str) else None
        if method == "notifications/cancelled" and message is not None:
            params = message.get("params")
            if isinstance(params, dict) and "requestId" in params:
                self.calls.cancel(who, params["requestId"])
        context = _ToolContext(rid, caller.name if caller is not None else "", who, trace)
        return await serve_asgi(
            manager.handle_request, request, body, {SCOPE_KEY: context}, {"X-Request-Id": rid}
        )

    async def _list_tools(self, req: types.ListToolsRequest) -> types.ServerResult:
        assert self.tool is not None  # set before the manager runs
        more = [self.fetch.definition] if self.fetch is not None else []
        return types.ServerResult(types.ListToolsResult(tools=[self.tool, *more]))

    async def _call_tool(self, req: types.CallToolRequest) -> types.ServerResult:
        """web_search: the answer /v1/search gives, as text and as structuredContent; any
        failure as a tool error with the proxy's message (never a traceback)."""
        context = self.server.request_context
        request = context.request  # the Starlette request of serve_asgi
        if request is None or not isinstance(request.scope.get(SCOPE_KEY), _ToolContext):
            return error_result("search-proxy: web_search is served over HTTP only")
        call: _ToolContext = request.scope[SCOPE_KEY]
        trace = call.trace
        name = trace.tool = req.params.name
        arguments = req.params.arguments or {}
        if self.fetch is not None and name == self.fetch.name:
            work = self.fetch.call(arguments, call.request_id, call.client, trace)
        elif name == TOOL_NAME:
            work = self._search(arguments, call)
        else:
            trace.error = "unknown_tool"
            tools = ", ".join([TOOL_NAME] + ([self.fetch.name] if self.fetch else []))
            return error_result(f"there is no tool {name!r} here: its tools are {tools}")
        # One deadline for the whole call, whichever tool; a cancel or the client leaving stops
        # it with every vendor attempt.
        limit = self.config.call_timeout
        search = asyncio.create_task(work)
        with self.calls.running(call.caller, context.request_id, search):
            try:
                # The search keeps to the deadline itself; this wait is the backstop.
                done, _ = await asyncio.wait((search,), timeout=limit + HARD_STOP_S)
            finally:
                search.cancel()  # the client left (this handler is cancelled), or time is up
        if search.cancelled():
            trace.error = "cancelled"
            return error_result(f"{name}: the client cancelled this call")
        if not done:
            trace.error = "deadline_exceeded"
            return error_result(
                f"{name} ran past its {seconds_text(limit)} (mcp_server.call_timeout) "
                "and was stopped; try again"
            )
        return search.result()

    async def _search(self, arguments: Mapping[str, Any], call: _ToolContext) -> types.ServerResult:
        """One web_search, within mcp_server.call_timeout from now."""
        api = self.api
        assert api is not None  # set before the manager runs
        trace = call.trace
        limit = self.config.call_timeout
        deadline = api.clock.now() + limit
        try:
            body = search_body(arguments)
            if self.clients is not None:
                await self.clients.spend(call.client)  # the daily quota, per tool call
            answer = await api.answer(
                body, call.request_id, trace.search, call.client, deadline=deadline
            )
            text = render_text(answer)
        except ProxyError as err:
            trace.error = err.type
            message = tool_message(err)
            if api.clock.now() >= deadline:
                message = (
                    f"{TOOL_NAME} ran out of its {seconds_text(limit)} "
                    f"(mcp_server.call_timeout): {message}"
                )
            return error_result(message)
        except Exception:
            log.exception("mcp_tool_failed", request_id=call.request_id, tool=TOOL_NAME)
            trace.error = InternalError.type
            return error_result(
                "search-proxy failed while searching (a bug; its log has the details, request "
                f"id {call.request_id}); try again"
            )
        return types.ServerResult(
            types.CallToolResult(
                content=[types.TextContent(type="text", text=text)],
                structuredContent=answer,
                isError=False,
            )
        )


def _message(body: bytes) -> dict[str, Any] | None:
    """The JSON-RPC message of a request body (None for a batch or junk)."""
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return message if isinstance(message, dict) else None

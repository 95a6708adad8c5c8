"""The MCP side of the proxy's own MCP server: the official `mcp` package's low-level `Server`
with our tool handlers, run by its `StreamableHTTPSessionManager` (stateless, JSON answers), and
the bridge from one aiohttp request to its ASGI app. Imported on the first /mcp request only
(proxy/mcp_server.py): the package and its models are a third of an idle proxy's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import structlog
from aiohttp import web
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.types import Message, Scope

from policies.core.errors import ProxyError, seconds_text
from policies.core.route import HOP_BY_HOP
from proxy import __version__
from proxy.errors import InternalError
from proxy.mcp_calls import EndpointView, ToolContext
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
from proxy.wire import prepare_stream

log = structlog.get_logger("search_proxy")

SCOPE_KEY = "search_proxy.mcp"  # the ASGI scope entry carrying a request's ToolContext
DISCONNECT_POLL_S = 1.0
# How long past its deadline a call may take to wind down (a policy that does not watch the
# deadline) before it is cancelled outright.
HARD_STOP_S = 1.0


class McpEngine:
    """The package's server and session manager for one endpoint (its config, search API,
    fetch API and client gate are the endpoint's, as the last reload left them)."""

    def __init__(self, endpoint: EndpointView, max_body_bytes: int) -> None:
        self.endpoint = endpoint
        self.server: Server[Any, Any] = Server(
            "search-proxy", version=__version__, instructions=INSTRUCTIONS
        )
        # Our handlers straight into the request table, as the package's decorators put theirs:
        # the tool result is exactly ours (no re-validation, no exception text as a result).
        self.server.request_handlers[types.ListToolsRequest] = self._list_tools
        self.server.request_handlers[types.CallToolRequest] = self._call_tool
        self.manager = StreamableHTTPSessionManager(
            self.server,
            json_response=True,
            stateless=True,
            security_settings=None,  # no DNS-rebinding check of its own: `refusal` does it
            max_request_body_size=max_body_bytes,
        )
        # The tools as the endpoint's current APIs describe them (rebuilt after a reload).
        self._built: tuple[object, object, object] | None = None
        self._search_tool: types.Tool | None = None
        self._fetch_tool: FetchTool | None = None
        self._holder: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def start(self) -> None:
        """Run the session manager in a task of its own, which enters and leaves its task
        group (anyio wants both in one task); returns once it runs."""
        # The package's own logger says "Processing request ..." at info for every message.
        logging.getLogger("mcp").setLevel(logging.WARNING)
        started = asyncio.Event()

        async def hold() -> None:
            async with self.manager.run():
                started.set()
                await self._stop.wait()

        self._holder = asyncio.create_task(hold(), name="mcp-session-manager")
        waiting = asyncio.create_task(started.wait())
        await asyncio.wait({self._holder, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if self._holder.done():
            self._holder.result()  # its exception, if it failed to start

    async def stop(self) -> None:
        self._stop.set()
        if self._holder is not None:
            await self._holder

    async def handle(
        self, request: web.Request, body: bytes, context: ToolContext
    ) -> web.StreamResponse:
        """One admitted request through the package's streamable HTTP transport."""
        headers = {"X-Request-Id": context.request_id}
        return await serve_asgi(
            self.manager.handle_request, request, body, {SCOPE_KEY: context}, headers
        )

    def _tools(self) -> tuple[types.Tool, FetchTool | None]:
        """web_search's definition, and fetch_page when /v1/fetch has a provider."""
        endpoint = self.endpoint
        built = (endpoint.api, endpoint.fetch_api, endpoint.clients)
        if self._built != built:
            assert endpoint.api is not None  # set before the first request is admitted
            self._search_tool = tool_definition(endpoint.api)
            fetch = endpoint.fetch_api
            self._fetch_tool = None
            if fetch is not None and fetch.enabled:
                self._fetch_tool = FetchTool(fetch, endpoint.clients)
            self._built = built
        assert self._search_tool is not None
        return self._search_tool, self._fetch_tool

    async def _list_tools(self, req: types.ListToolsRequest) -> types.ServerResult:
        search, fetch = self._tools()
        more = [fetch.definition] if fetch is not None else []
        return types.ServerResult(types.ListToolsResult(tools=[search, *more]))

    async def _call_tool(self, req: types.CallToolRequest) -> types.ServerResult:
        """web_search: the answer /v1/search gives, as text and as structuredContent; any
        failure as a tool error with the proxy's message (never a traceback)."""
        context = self.server.request_context
        request = context.request  # the Starlette request of serve_asgi
        if request is None or not isinstance(request.scope.get(SCOPE_KEY), ToolContext):
            return error_result("search-proxy: web_search is served over HTTP only")
        call: ToolContext = request.scope[SCOPE_KEY]
        trace = call.trace
        name = trace.tool = req.params.name
        arguments = req.params.arguments or {}
        _, fetch = self._tools()
        if fetch is not None and name == fetch.name:
            work = fetch.call(arguments, call.request_id, call.client, trace)
        elif name == TOOL_NAME:
            work = self._search(arguments, call)
        else:
            trace.error = "unknown_tool"
            tools = ", ".join([TOOL_NAME] + ([fetch.name] if fetch is not None else []))
            return error_result(f"there is no tool {name!r} here: its tools are {tools}")
        # One deadline for the whole call, whichever tool; a cancel or the client leaving stops
        # it with every vendor attempt.
        limit = self.endpoint.config.call_timeout
        search = asyncio.create_task(work)
        with self.endpoint.calls.running(call.caller, context.request_id, search):
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

    async def _search(self, arguments: Mapping[str, Any], call: ToolContext) -> types.ServerResult:
        """One web_search, within mcp_server.call_timeout from now."""
        api = self.endpoint.api
        assert api is not None  # set before the manager runs
        trace = call.trace
        limit = self.endpoint.config.call_timeout
        deadline = api.clock.now() + limit
        try:
            body = search_body(arguments)
            if self.endpoint.clients is not None:
                await self.endpoint.clients.spend(call.client)  # the daily quota, per tool call
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


# ---------------------------------------------------------------------------------------------
# The ASGI bridge


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
                await prepare_stream(response, request)
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
        await prepare_stream(response, request)
        await response.write_eof()
    return response

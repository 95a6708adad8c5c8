"""The proxy's own MCP server: one `web_search` tool over /v1/search's providers, served at
`mcp_server.path` (`/mcp`) over MCP's streamable HTTP transport.

The MCP side is the official `mcp` package (proxy/mcp_engine.py): its low-level `Server` with
our two handlers (tools/list, tools/call), run by its `StreamableHTTPSessionManager` in
stateless JSON mode, so no client session is held between requests and every POST is answered
with one JSON-RPC message. The engine is built on the first /mcp request: the package and its
models are a third of an idle proxy's memory, which a proxy nobody calls over MCP never pays,
and are imported in a thread, so the loop serves other requests meanwhile.

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
import importlib
import ipaddress
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from aiohttp import web

from proxy.clients import Caller, ClientGate, foreign_page, hostname, is_loopback_host
from proxy.config import McpServerConfig
from proxy.errors import Forbidden, MethodNotAllowed, NotFound, UnsupportedMediaType
from proxy.fetch_api import FetchApi
from proxy.mcp_calls import McpTrace, RunningCalls, ToolContext
from proxy.search_api import SearchApi

if TYPE_CHECKING:
    from proxy.mcp_engine import McpEngine

log = structlog.get_logger("search_proxy")

__all__ = ["McpEndpoint", "McpTrace", "is_loopback_peer", "refusal"]


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
    page = foreign_page(origin) if origin is not None else None
    if page is not None:
        return Forbidden(
            f"search-proxy's MCP server does not serve browser pages from other sites "
            f"(Origin {page!r}): call {config.path} from an MCP client, not a web page"
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


def takes_json(content_type: str) -> bool:
    """Whether the mcp package takes a POST with this Content-Type (as aiohttp decodes it);
    its own two checks refuse in plain text (a 400, then a 415): the value starts with
    application/json, any case; and a comma-separated part of the media type, before
    parameters, is exactly application/json. The package reads the header's bytes as Latin-1
    (Starlette), aiohttp as UTF-8: read as the package reads it, or `strip` takes different
    characters for space (a UTF-8 no-break space passed here and met the package's 415)."""
    value = content_type.encode("utf-8", "surrogateescape").decode("latin-1")
    parts = value.split(";", 1)[0].split(",")
    return value.lower().startswith("application/json") and any(
        part.strip() == "application/json" for part in parts
    )


class McpEndpoint:
    """The MCP server of one proxy app: built with the app, running (`running`) once the
    routes and the search API exist, answering at `config.path` through proxy/app.py."""

    def __init__(self, config: McpServerConfig) -> None:
        self.config = config
        self.api: SearchApi | None = None
        self.fetch_api: FetchApi | None = None  # fetch_page beside web_search, when enabled
        self.clients: ClientGate | None = None
        self.calls = RunningCalls()
        self._max_body_bytes = 0
        self._engine: McpEngine | None = None
        self._starting = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def running(self, max_body_bytes: int) -> AsyncIterator[None]:
        """Serve while inside (over what `use` gave it); the engine, if a request started it,
        stops on the way out."""
        if not self.config.enabled:
            yield
            return
        self._max_body_bytes = max_body_bytes
        if self.clients is None and self.config.allow_remote:
            log.warning(
                "mcp_server_open",
                path=self.config.path,
                hint="mcp_server.allow_remote without clients: anyone who reaches this port "
                "searches with the proxy's keys; configure clients: tokens",
            )
        try:
            yield
        finally:
            engine, self._engine = self._engine, None
            if engine is not None:
                await engine.stop()

    def use(
        self,
        api: SearchApi,
        clients: ClientGate | None,
        config: McpServerConfig,
        fetch_api: FetchApi | None,
    ) -> None:
        """Search through `api`, fetch through `fetch_api` and admit by `clients` from now on
        (a reload's new generation; its path and `enabled` stay as they were served)."""
        self.api, self.clients, self.config, self.fetch_api = api, clients, config, fetch_api

    async def admit(self, request: web.Request) -> Caller | None:
        """Whether this request may use the MCP server, and its known client: ProxyErrors
        (404 off, 405 not POST, 403 refused, 401 no known token, 415 not JSON) for the caller
        to render."""
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
        caller = None
        if self.clients is not None:
            caller = self.clients.identify(None, request.headers, "")  # Unauthorized without one
        given = request.headers.get("Content-Type", "")
        if not takes_json(given):
            raise UnsupportedMediaType(
                f"{self.config.path} takes JSON-RPC messages as Content-Type: application/json "
                f"(MCP's streamable HTTP); this request's is {given or 'not given'!r}",
                route="mcp",
            )
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
        engine = self._engine or await self._start()
        message = _message(body)
        method = message.get("method") if message is not None else None
        trace.rpc = method[:64] if isinstance(method, str) else None
        if method == "notifications/cancelled" and message is not None:
            params = message.get("params")
            if isinstance(params, dict) and "requestId" in params:
                self.calls.cancel(who, params["requestId"])
        context = ToolContext(rid, caller.name if caller is not None else "", who, trace)
        return await engine.handle(request, body, context)

    async def _start(self) -> McpEngine:
        """The engine, built and started by the first request (others wait for it)."""
        async with self._starting:
            if self._engine is None:
                # The mcp package, on first use only, imported off the loop: ~0.6 s of imports
                # in which the loop would serve nothing else.
                await asyncio.to_thread(importlib.import_module, "proxy.mcp_engine")
                from proxy.mcp_engine import McpEngine

                engine = McpEngine(self, self._max_body_bytes)
                await engine.start()
                self._engine = engine
            return self._engine


def _message(body: bytes) -> dict[str, Any] | None:
    """The JSON-RPC message of a request body (None for a batch or junk)."""
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return message if isinstance(message, dict) else None

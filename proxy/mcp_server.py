"""The proxy's own MCP server: one `web_search` tool over /v1/search's providers, served at
`mcp_server.path` (`/mcp`) over MCP's streamable HTTP transport.

The MCP side is the official `mcp` package: its low-level `Server` with our two handlers
(tools/list, tools/call), run by its `StreamableHTTPSessionManager` in stateless JSON mode, so
no client session is held between requests and every POST is answered with one JSON-RPC
message. The package speaks ASGI; `serve_asgi` below bridges one aiohttp request to it.

A tool call runs `SearchApi.answer`, the very code /v1/search runs (providers in order with
failover, breakers, cache, simplified queries, the per-request call budget), with the caller's
identity. Its result is a text block an LLM reads (numbered results, then which provider
answered and which query found them) and, as `structuredContent`, the normalised answer
/v1/search gives for one query. A failure is a tool error (`isError: true`) whose text is the
proxy's own message, the one /v1/search answers with.

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
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from aiohttp import web
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.types import Message, Scope

from policies.core.errors import BadRequest, ProxyError
from policies.core.options import OPTION_NAMES
from proxy import __version__
from proxy.clients import Caller, ClientGate, is_loopback_host
from proxy.config import McpServerConfig
from proxy.errors import Forbidden, InternalError, MethodNotAllowed, NotFound
from proxy.forward import HOP_BY_HOP
from proxy.search_api import SearchApi, SearchTrace

log = structlog.get_logger("search_proxy")

TOOL_NAME = "web_search"
# The tool's arguments: /v1/search's fields an LLM can use well, with the same names and rules.
# Not offered: `queries` (one search per call), `providers` and `credentials` (the operator's
# business), `safe_search`, and the LiteLLM / Perplexity aliases.
ARGUMENTS = ("query", *(name for name in OPTION_NAMES if name != "safe_search"), "mode")
_ARGUMENT_HELP = {
    "query": "What to search for, in plain words, as you would type it into a search engine.",
    "max_results": "How many results to return (1-{max}; default {default}).",
    "time_range": "Only results published or updated within the last day, week, month or year.",
    "include_domains": 'Only results from these domains (subdomains included), e.g. ["arxiv.org"].',
    "exclude_domains": "Never results from these domains (subdomains included).",
    "topic": "general (web search, the default) or news.",
    "country": "ISO 3166-1 alpha-2 code (US, DE, GB): where results should come from.",
    "language": "ISO 639-1 code (en, de): the language results should be in.",
    "mode": "first (default): one provider's results; merge: several providers' results, "
    "deduplicated and ranked together (for breadth); race: the faster of two providers.",
}
DESCRIPTION = (
    "Search the web. Returns a numbered list of results (title, URL, snippet, and the date "
    "when known), then a line saying which search provider answered. Providers are tried in "
    "order, with failover when one is down; when a query finds nothing, a simpler form of it "
    "is tried and the answer says which query found the results. Only `query` is required. "
    "Options a provider cannot apply are named in the answer (its results are then not "
    "filtered by them). On failure the tool returns an error saying what happened and what "
    "to do (e.g. when to retry)."
)
INSTRUCTIONS = (
    "search-proxy: web search through several providers with failover. Call web_search with "
    "a query; cite results by their URL."
)
SCOPE_KEY = "search_proxy.mcp"  # the ASGI scope entry carrying a request's _ToolContext
DISCONNECT_POLL_S = 1.0


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
    trace: McpTrace


# ---------------------------------------------------------------------------------------------
# The tool


def _local_refs(node: Any) -> Any:
    """An OpenAPI schema with its `#/components/schemas/X` references as `#/$defs/X`."""
    if isinstance(node, dict):
        return {
            k: (
                v.replace("#/components/schemas/", "#/$defs/")
                if k == "$ref" and isinstance(v, str)
                else _local_refs(v)
            )
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_local_refs(v) for v in node]
    return node


def output_schema(document: Mapping[str, Any]) -> dict[str, Any]:
    """The tool's outputSchema: /v1/search's answer to one query, from its OpenAPI document."""
    schemas = document["components"]["schemas"]
    answer: dict[str, Any] = _local_refs(schemas["SearchAnswer"])
    answer["$defs"] = {name: _local_refs(schemas[name]) for name in ("SearchResult", "Attempt")}
    return answer


def input_schema(document: Mapping[str, Any], default_max_results: int) -> dict[str, Any]:
    """The tool's inputSchema: /v1/search's own field schemas, described for an LLM."""
    fields = document["components"]["schemas"]["SearchRequest"]["properties"]
    properties: dict[str, Any] = {}
    for name in ARGUMENTS:
        schema = {k: v for k, v in fields[name].items() if k not in ("description", "examples")}
        text = _ARGUMENT_HELP[name]
        if name == "max_results":
            text = text.format(max=schema["maximum"], default=default_max_results)
        properties[name] = {**schema, "description": text}
    return {
        "type": "object",
        "properties": properties,
        "required": ["query"],
        "additionalProperties": False,
    }


def tool_definition(api: SearchApi) -> types.Tool:
    return types.Tool(
        name=TOOL_NAME,
        title="Web search",
        description=DESCRIPTION,
        inputSchema=input_schema(api.document, api.config.max_results),
        outputSchema=output_schema(api.document),
        annotations=types.ToolAnnotations(
            title="Web search",
            readOnlyHint=True,
            destructiveHint=False,
            idempotentHint=True,
            openWorldHint=True,
        ),
    )


def search_body(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The /v1/search body of a web_search call. An argument sent as null counts as not sent
    (LLMs fill optional arguments with null); an unknown one is refused naming the known."""
    unknown = sorted(k for k in arguments if k not in ARGUMENTS)
    if unknown:
        raise _argument_error(
            f"{unknown[0]} is not an argument of web_search (its arguments: {', '.join(ARGUMENTS)})"
        )
    if arguments.get("query") is None:
        raise _argument_error("query is required: send the words to search for")
    return {k: v for k, v in arguments.items() if v is not None}


def _argument_error(text: str) -> ProxyError:
    return BadRequest(f"{TOOL_NAME}: {text}", route="search")


def tool_message(err: ProxyError) -> str:
    """A failure as the tool's error text: the proxy's own message, with a field error named
    after the tool rather than the endpoint (`/v1/search: query is empty ...`)."""
    return err.message.replace("/v1/search: ", f"{TOOL_NAME}: ", 1)


def render_text(answer: Mapping[str, Any]) -> str:
    """One search answer as the text an LLM reads: numbered results, then where they came from."""
    query = answer["query"]
    results = answer["results"]
    provider = answer["provider"]
    lines: list[str] = []
    if results:
        lines.append(f'Web search results for "{query}":')
        for i, r in enumerate(results, start=1):
            lines.append("")
            lines.append(f"{i}. {r['title'] or r['url']}")
            lines.append(f"   {r['url']}")
            if r["snippet"]:
                lines.append(f"   {' '.join(r['snippet'].split())}")
            date = r["date"] or (r["published_date"] or "")[:10]
            if date:
                lines.append(f"   Published: {date}")
        lines.append("")
    else:
        lines.append(f'No results found for "{query}". Try fewer or different words.')
    before = [
        f"{a['provider']} ({_attempt_text(a)})"
        for a in answer["attempts"]
        if a["outcome"] != "results"
    ]
    if provider is not None:
        merged = answer.get("providers") or [provider]
        source = f"Answered by {', '.join(merged)}" + (" (merged)" if len(merged) > 1 else "")
        if answer["from_cache"]:
            age = answer["cache_age_s"]
            source += " from the proxy's cache" + (f" ({age} s old)" if age is not None else "")
        if before:
            source += f", after {', '.join(before)}"
        lines.append(source + ".")
    elif before:
        lines.append(f"Providers asked: {', '.join(before)}.")
    if answer["query_used"] != query:
        lines.append(
            f"The original query found nothing; these results are for the simplified query "
            f'"{answer["query_used"]}".'
        )
    if answer["dropped_options"]:
        lines.append(
            f"{provider or 'The provider'} could not apply "
            f"{', '.join(answer['dropped_options'])}: its results are not filtered by them."
        )
    return "\n".join(lines)


def _attempt_text(attempt: Mapping[str, Any]) -> str:
    """How a provider that did not answer fared, in a word or two (its status is in
    structuredContent: a refused connection has none of the vendor's)."""
    words = {"empty": "no results", "skipped": "skipped", "cancelled": "cancelled"}
    return words.get(str(attempt["outcome"]), "failed")


def _error_result(text: str) -> types.ServerResult:
    return types.ServerResult(
        types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=True)
    )


# ---------------------------------------------------------------------------------------------
# Access


def _hostname(authority: str) -> str:
    """The host of a Host header or an Origin's authority: `[::1]:8080` -> `::1`."""
    if authority.startswith("["):
        return authority[1 : authority.find("]")] if "]" in authority else ""
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


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
        page = _hostname(origin.partition("://")[2].split("/", 1)[0])
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
    if host is not None and not is_loopback_host(_hostname(host)):
        return Forbidden(
            f"search-proxy's MCP server serves loopback callers at a loopback address only, "
            f"and this request names host {_hostname(host)!r}: use http://127.0.0.1 or "
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
        self.server: Server[Any, Any] = Server(
            "search-proxy", version=__version__, instructions=INSTRUCTIONS
        )
        # Our handlers straight into the request table, as the package's decorators put theirs:
        # the tool result is exactly ours (no re-validation, no exception text as a result).
        self.server.request_handlers[types.ListToolsRequest] = self._list_tools
        self.server.request_handlers[types.CallToolRequest] = self._call_tool
        self.manager: StreamableHTTPSessionManager | None = None

    @contextlib.asynccontextmanager
    async def running(
        self, api: SearchApi, clients: ClientGate | None, max_body_bytes: int
    ) -> AsyncIterator[None]:
        """Serve while inside: the package's session manager runs in a task of its own, which
        enters and leaves its task group (anyio wants both in one task)."""
        if not self.config.enabled:
            yield
            return
        self.api, self.clients = api, clients
        self.tool = tool_definition(api)
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
        self, request: web.Request, body: bytes, rid: str, caller: Caller | None, trace: McpTrace
    ) -> web.StreamResponse:
        """Answer one admitted request through the package's streamable HTTP transport."""
        manager = self.manager
        if manager is None:
            raise InternalError("the MCP server is not running yet; send it again", route="mcp")
        trace.rpc = _rpc_method(body)
        context = _ToolContext(rid, caller.name if caller is not None else "", trace)
        return await serve_asgi(
            manager.handle_request, request, body, {SCOPE_KEY: context}, {"X-Request-Id": rid}
        )

    async def _list_tools(self, req: types.ListToolsRequest) -> types.ServerResult:
        assert self.tool is not None  # set before the manager runs
        return types.ServerResult(types.ListToolsResult(tools=[self.tool]))

    async def _call_tool(self, req: types.CallToolRequest) -> types.ServerResult:
        """web_search: the answer /v1/search gives, as text and as structuredContent; any
        failure as a tool error with the proxy's message (never a traceback)."""
        request = self.server.request_context.request  # the Starlette request of serve_asgi
        if request is None or not isinstance(request.scope.get(SCOPE_KEY), _ToolContext):
            return _error_result("search-proxy: web_search is served over HTTP only")
        context: _ToolContext = request.scope[SCOPE_KEY]
        trace = context.trace
        trace.tool = req.params.name
        if req.params.name != TOOL_NAME:
            trace.error = "unknown_tool"
            return _error_result(
                f"there is no tool {req.params.name!r} here: this server has one tool, {TOOL_NAME}"
            )
        api = self.api
        assert api is not None  # set before the manager runs
        try:
            body = search_body(req.params.arguments or {})
            if self.clients is not None:
                await self.clients.spend(context.client)  # the daily quota, per tool call
            answer = await api.answer(body, context.request_id, trace.search, context.client)
            text = render_text(answer)
        except ProxyError as err:
            trace.error = err.type
            return _error_result(tool_message(err))
        except Exception:
            log.exception("mcp_tool_failed", request_id=context.request_id, tool=TOOL_NAME)
            trace.error = InternalError.type
            return _error_result(
                "search-proxy failed while searching (a bug; its log has the details, request "
                f"id {context.request_id}); try again"
            )
        return types.ServerResult(
            types.CallToolResult(
                content=[types.TextContent(type="text", text=text)],
                structuredContent=answer,
                isError=False,
            )
        )


def _rpc_method(body: bytes) -> str | None:
    """The JSON-RPC method of a request body, for the log line (None when it has none)."""
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    method = message.get("method") if isinstance(message, dict) else None
    return method[:64] if isinstance(method, str) else None

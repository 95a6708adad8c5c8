"""The MCP server's `fetch_page` tool, beside `web_search`: /v1/fetch's code (`FetchApi.answer`),
its answer as text an LLM reads (each page under its title, then what could not be read and
why) and, as `structuredContent`, /v1/fetch's answer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog
from mcp import types

from policies.core.errors import BadRequest, ProxyError
from proxy.clients import ClientGate
from proxy.errors import InternalError
from proxy.fetch_api import FetchApi, FetchTrace
from proxy.mcp_tool import answer_schema, error_result

log = structlog.get_logger("search_proxy")

TOOL_NAME = "fetch_page"
ARGUMENTS = ("urls", "format", "max_chars")
_ARGUMENT_HELP = {
    "urls": "The pages to read: http(s) URLs, e.g. from web_search results (one URL as a string "
    "is read as a list of one).",
    "format": "markdown (the default: headings, lists, links and tables kept) or text.",
    "max_chars": "The longest content wanted per page (1-{max}; default {default}); longer "
    "pages are cut.",
}
DESCRIPTION = (
    "Read web pages by URL. Returns each page's title, URL and main content (navigation and "
    "ads left out), as markdown unless text is asked, then the URLs that could not be read "
    "and why. Pages are read through several providers with failover, and recently read "
    "pages come from a cache. Use it on the results of web_search you need to read in full."
)


def input_schema(schemas: Mapping[str, Any], default_chars: int) -> dict[str, Any]:
    """The tool's inputSchema: /v1/fetch's own field schemas, described for an LLM."""
    fields = schemas["FetchRequest"]["properties"]
    properties: dict[str, Any] = {}
    for name in ARGUMENTS:
        schema = {k: v for k, v in fields[name].items() if k != "description"}
        text = _ARGUMENT_HELP[name]
        if name == "max_chars":
            text = text.format(max=schema["maximum"], default=default_chars)
        properties[name] = {**schema, "description": text}
    return {
        "type": "object",
        "properties": properties,
        "required": ["urls"],
        "additionalProperties": False,
    }


def output_schema(schemas: Mapping[str, Any]) -> dict[str, Any]:
    """The tool's outputSchema: /v1/fetch's answer, its references made local."""
    return answer_schema(schemas, "FetchAnswer", ("FetchResult", "FetchFailure"))


def fetch_body(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The /v1/fetch body of a fetch_page call: an argument sent as null counts as not sent,
    one URL as a string is a list of one, an unknown argument is refused naming the known."""
    unknown = sorted(k for k in arguments if k not in ARGUMENTS)
    if unknown:
        known = ", ".join(ARGUMENTS)
        raise BadRequest(
            f"{TOOL_NAME}: {unknown[0]} is not an argument of {TOOL_NAME} (its arguments: {known})",
            route="fetch",
        )
    body = {k: v for k, v in arguments.items() if v is not None}
    if isinstance(body.get("urls"), str):
        body["urls"] = [body["urls"]]
    if "urls" not in body:
        raise BadRequest(f"{TOOL_NAME}: urls is required: send the pages' URLs", route="fetch")
    return body


def render_pages(answer: Mapping[str, Any]) -> str:
    """/v1/fetch's answer as the text an LLM reads: each page under its title, then failures."""
    lines: list[str] = []
    for page in answer["results"]:
        lines.append(f"# {page['title'] or page['url']}")
        lines.append(f"URL: {page['url']}")
        source = f"Read by {page['provider']}"
        if page["from_cache"]:
            source += f" (from the proxy's cache, read at {page['fetched_at']})"
        if page["truncated"]:
            source += f"; cut to {len(page['content'])} characters"
        lines += [source + ".", "", page["content"], ""]
    if answer["failed"]:
        lines.append("Could not read:")
        lines += [f"- {f['url']}: {f['error']['message']}" for f in answer["failed"]]
    return "\n".join(lines).rstrip()


class FetchTool:
    """fetch_page as the MCP server lists and calls it."""

    name = TOOL_NAME

    def __init__(self, api: FetchApi, clients: ClientGate | None) -> None:
        self.api = api
        self.clients = clients
        self.definition = types.Tool(
            name=TOOL_NAME,
            title="Read web pages",
            description=DESCRIPTION,
            inputSchema=input_schema(api.schemas, api.config.max_chars),
            outputSchema=output_schema(api.schemas),
            annotations=types.ToolAnnotations(
                title="Read web pages",
                readOnlyHint=True,
                destructiveHint=False,
                idempotentHint=True,
                openWorldHint=True,
            ),
        )

    async def call(
        self, arguments: Mapping[str, Any], request_id: str, client: str, trace: Any
    ) -> types.ServerResult:
        """The pages, as text and as structuredContent; a failure (a bad argument, nothing
        read) as a tool error with the proxy's message. `trace`: the request's McpTrace."""
        done = FetchTrace()
        try:
            body = fetch_body(arguments)
            if self.clients is not None:
                await self.clients.spend(client)  # the daily quota, per tool call
            answer = await self.api.answer(body, request_id, done, client, endpoint=TOOL_NAME)
        except ProxyError as err:
            trace.error = err.type
            return error_result(err.message)
        except Exception:
            log.exception("mcp_tool_failed", request_id=request_id, tool=TOOL_NAME)
            trace.error = InternalError.type
            return error_result(
                "search-proxy failed while reading pages (a bug; its log has the details, "
                f"request id {request_id}); try again"
            )
        finally:
            trace.search.providers = done.providers
            trace.search.calls = done.calls
        if not answer["results"]:
            trace.error = answer["failed"][0]["error"]["type"]
        return types.ServerResult(
            types.CallToolResult(
                content=[types.TextContent(type="text", text=render_pages(answer))],
                structuredContent=answer,
                isError=not answer["results"],
            )
        )

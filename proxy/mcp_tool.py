"""The proxy's MCP tool, `web_search`: its definition (schemas from /v1/search's OpenAPI
document, described for an LLM), its arguments as a /v1/search body, and its answer as the text
an LLM reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mcp import types

from policies.core.errors import BadRequest, ProxyError
from policies.core.options import OPTION_NAMES
from proxy.search_api import SearchApi

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


def answer_schema(
    schemas: Mapping[str, Any], answer: str, parts: tuple[str, ...]
) -> dict[str, Any]:
    """A tool's outputSchema: the OpenAPI schema `answer`, with the schemas it refers to
    (`parts`) as its own `$defs`."""
    found: dict[str, Any] = _local_refs(schemas[answer])
    found["$defs"] = {name: _local_refs(schemas[name]) for name in parts}
    return found


def output_schema(document: Mapping[str, Any]) -> dict[str, Any]:
    """The tool's outputSchema: /v1/search's answer to one query, from its OpenAPI document."""
    return answer_schema(
        document["components"]["schemas"], "SearchAnswer", ("SearchResult", "Attempt")
    )


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


def error_result(text: str) -> types.ServerResult:
    return types.ServerResult(
        types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=True)
    )

"""JSON-RPC and server-sent events as an MCP route reads them, and what a tool call's final
answer means for the route's policies."""

from __future__ import annotations

import itertools
import json
import secrets
from collections.abc import Mapping
from typing import Any

from multidict import CIMultiDict

from policies.core.errors import ClientFault, ProxyError, StreamCut, UpstreamUnreachable
from policies.core.flow import Flow, Reply
from policies.core.outcome import Outcome
from policies.mcp.config import McpConfig

# The code of the JSON-RPC errors the proxy answers itself (implementation-defined range).
PROXY_ERROR_CODE = -32099
# The challenge of a refused request on an MCP route: a server's own may send an OAuth client
# to the server's metadata, an address the agent is not to use, for a resource that is not the
# route; the proxy's says what it takes (its OAuth paths explain further, proxy/oauth.py).
CHALLENGE = (
    'Bearer realm="search-proxy", error="invalid_token", error_description="this route takes '
    'a static bearer token: send Authorization: Bearer <key>, not OAuth"'
)
# The JSON-RPC ids of the requests the proxy sends upstream itself (a tool call's attempts, the
# initialize of a session it opens): unique in this process, unguessable across processes
# (never derived from anything the agent sends, such as its X-Request-Id).
_ATTEMPT_PREFIX = f"sp-{secrets.token_hex(6)}-"
_ATTEMPT_NUMBERS = itertools.count(1)


def attempt_id() -> str:
    """A JSON-RPC id of the proxy's own for a request it sends upstream."""
    return f"{_ATTEMPT_PREFIX}{next(_ATTEMPT_NUMBERS)}"


class Cancelled(ClientFault):
    """The agent cancelled its request (`notifications/cancelled`)."""

    status = 499
    type = "cancelled"


class SessionNotFound(ClientFault):
    """The request names a session this caller did not open (another caller's, or none): as
    an MCP server answers a session it does not know, with 404, and nothing reaches it."""

    status = 404
    type = "session_not_found"


def parse_message(body: bytes) -> dict[str, Any] | None:
    """One JSON-RPC message (an object), or None for anything else (a batch, junk)."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


def encode(message: Mapping[str, Any]) -> bytes:
    """A message as one line of compact JSON (an SSE data line cannot hold a newline)."""
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()


def sse_event(data: bytes) -> bytes:
    return b"event: message\ndata: " + data + b"\n\n"


def is_response(message: Mapping[str, Any]) -> bool:
    """A JSON-RPC response: a result, or an error object (not a vendor's `{"error": "..."}`)."""
    if message.get("jsonrpc") != "2.0" or "method" in message:
        return False
    return "result" in message or isinstance(message.get("error"), dict)


class SseParser:
    """Server-sent events from chunks as they arrive: each complete event's data. Linear in
    the bytes fed: a chunk is normalised once and only the new part is searched."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._cr = False  # the last chunk ended in CR: an LF opening the next one pairs with it

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._cr = chunk.endswith(b"\r")
        start = max(len(self._buffer) - 1, 0)  # a blank line may span the old and new bytes
        self._buffer += chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events: list[bytes] = []
        begin = 0
        while (end := self._buffer.find(b"\n\n", max(start, begin))) >= 0:
            block = bytes(self._buffer[begin:end])
            begin = end + 2
            data = [
                line[5:].removeprefix(b" ")
                for line in block.split(b"\n")
                if line.startswith(b"data:")
            ]
            if data:
                events.append(b"\n".join(data))
        del self._buffer[:begin]
        return events


async def response_in(reply: Reply, request_id: Any) -> dict[str, Any] | None:
    """The JSON-RPC response to `request_id` a reply carries, in its JSON body or the SSE
    stream (read up to it); None when it carries none. A cut stream raises its error."""
    if reply.stream is None:
        message = parse_message(reply.body)
        found = message is not None and is_response(message) and message.get("id") == request_id
        return message if found else None
    parser = SseParser()
    try:
        async for chunk in reply.stream:
            for data in parser.feed(chunk):
                message = parse_message(data)
                if message is not None and is_response(message) and message.get("id") == request_id:
                    return message
    except StreamCut as cut:
        raise cut.error from None
    return None


def tool_error(request_id: Any, err: ProxyError) -> dict[str, Any]:
    """A failed tool call as the agent's LLM reads it: a tool error with the proxy's message."""
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "result": {
            "content": [{"type": "text", "text": err.message}],
            "isError": True,
            "_meta": {"search-proxy/error": _error_fields(err)},
        },
    }


def rpc_error(request_id: Any, err: ProxyError) -> dict[str, Any]:
    """A failed request other than a tool call: a JSON-RPC error with the proxy's message."""
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "error": {"code": PROXY_ERROR_CODE, "message": err.message, "data": _error_fields(err)},
    }


def _error_fields(err: ProxyError) -> dict[str, Any]:
    fields: dict[str, Any] = {"type": err.type, "attempts": err.attempts}
    if err.retry_after_s is not None:
        fields["retry_after_s"] = round(err.retry_after_s, 3)
    return fields


def _text_of(result: Mapping[str, Any]) -> str:
    content = result.get("content")
    if not isinstance(content, list):
        return ""
    return "\n".join(
        item["text"]
        for item in content
        if isinstance(item, dict) and isinstance(item.get("text"), str)
    )


def _is_empty_search(result: Mapping[str, Any]) -> bool:
    """A search tool's answer with a `results` list that is empty, in `structuredContent` or
    as JSON text in the first text content (Tavily's MCP server)."""
    structured = result.get("structuredContent")
    if isinstance(structured, dict) and isinstance(structured.get("results"), list):
        return not structured["results"]
    content = result.get("content")
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        return False
    text = content[0].get("text")
    if not isinstance(text, str) or not text.lstrip().startswith("{"):
        return False
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("results") == []


def assess(cfg: McpConfig, tool: str, message: Mapping[str, Any]) -> Outcome:
    """What a tool call's final JSON-RPC response means for the route's policies."""
    error = message.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        return Outcome.SERVER_ERROR if code in cfg.transient_errors else Outcome.CLIENT_ERROR
    result = message.get("result")
    if not isinstance(result, dict):
        return Outcome.MALFORMED
    if result.get("isError") is True:
        text = _text_of(result).lower()
        transient = any(words in text for words in cfg.transient_tool_errors)
        return Outcome.SERVER_ERROR if transient else Outcome.CLIENT_ERROR
    if tool in cfg.search_tools and _is_empty_search(result):
        return Outcome.EMPTY
    return Outcome.OK


def mcp_classifier(reply: Reply) -> Outcome:
    """The route classifier: McpUpstream classified its replies; others go by status."""
    if reply.outcome is None:
        reply.outcome = Outcome.of_status(reply.status)
    return reply.outcome


def json_headers() -> CIMultiDict[str]:
    return CIMultiDict({"Content-Type": "application/json"})


def answered(flow: Flow, message: Mapping[str, Any], err: ProxyError, status: int = 200) -> Reply:
    """The proxy's answer to a request it could not get answered: `message`, a tool error or
    JSON-RPC error carrying `err` (HTTP 200 unless `status`: an MCP client tears its session
    down on an HTTP error), named in `X-Proxy-Error` and on the log line."""
    flow.trace.error = err.type  # the log line's `error`, also once headers have gone
    headers = json_headers()
    headers["X-Proxy-Error"] = err.type
    return Reply(status, headers, encode(message), outcome=Outcome.CLIENT_ERROR)


def no_tail(err: Exception) -> bytes:
    """The end of a cut GET stream: nothing (the client opens another)."""
    return b""


def cut_event(flow: Flow, request_id: Any, err: Exception, render: Any) -> bytes:
    """The last event of a stream cut by `err`: the error for the request it answers."""
    if not isinstance(err, ProxyError):
        err = UpstreamUnreachable(str(err))
    flow.trace.error = err.type
    return sse_event(encode(render(request_id, err)))

"""JSON-RPC and server-sent events as an MCP route reads them, and what a tool call's final
answer means for the route's policies."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from policies.core.errors import ClientFault, ProxyError
from policies.core.flow import Reply
from policies.core.outcome import Outcome
from policies.mcp.config import McpConfig

# The code of the JSON-RPC errors the proxy answers itself (implementation-defined range).
PROXY_ERROR_CODE = -32099


class Cancelled(ClientFault):
    """The agent cancelled its request (`notifications/cancelled`)."""

    status = 499
    type = "cancelled"


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

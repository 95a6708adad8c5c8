"""The fake's MCP server (streamable HTTP at /mcp): the JSON-RPC messages answering a request."""

from __future__ import annotations

import json
from typing import Any

from proxy.testing.fakevendor.vendors import int_or_none, make_results


def mcp_messages(msg: dict[str, Any], results: int) -> list[dict[str, Any]]:
    """JSON-RPC messages answering one MCP request: progress notifications, then the result."""
    rid = msg.get("id")
    method = msg.get("method")
    params = msg.get("params") or {}
    out: list[dict[str, Any]] = []
    if method == "initialize":
        result: dict[str, Any] = {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": {"name": "fakevendor", "version": "1.0"},
        }
    elif method == "ping":
        result = {}
    elif method == "tools/list":
        schema = {
            "type": "object",
            "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
            "required": ["query"],
        }
        tool = {"name": "search", "description": "Fake web search", "inputSchema": schema}
        result = {"tools": [tool]}
    elif method == "tools/call" and params.get("name") == "search":
        args = params.get("arguments") or {}
        query = str(args.get("query", ""))
        n = int_or_none(args.get("max_results"))
        n = results if n is None else max(0, min(n, results))
        token = (params.get("_meta") or {}).get("progressToken")
        if token is not None:
            progress = {"progressToken": token, "progress": 1, "total": 2}
            out.append({"jsonrpc": "2.0", "method": "notifications/progress", "params": progress})
        items = [
            {"url": r.url, "title": r.title, "content": r.snippet} for r in make_results(query, n)
        ]
        result = {"content": [{"type": "text", "text": json.dumps(items)}], "isError": False}
    else:
        error = {"code": -32601, "message": f"Method not found: {method}"}
        out.append({"jsonrpc": "2.0", "id": rid, "error": error})
        return out
    out.append({"jsonrpc": "2.0", "id": rid, "result": result})
    return out

"""What the MCP server's two halves share: the record of one /mcp request (`McpTrace`), who a
tool call is for (`ToolContext`), the calls in flight (`RunningCalls`) and what the engine reads
of its endpoint (`EndpointView`). Free of the `mcp` package, which proxy/mcp_engine.py alone
imports, on the first /mcp request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
import structlog

from proxy.clients import ClientGate
from proxy.config import McpServerConfig
from proxy.fetch_api import FetchApi
from proxy.search_api import SearchApi, SearchTrace

log = structlog.get_logger("search_proxy")


class EndpointView(Protocol):
    """The endpoint as the engine reads it: its APIs and gate as the last reload left them."""

    config: McpServerConfig
    api: SearchApi | None
    fetch_api: FetchApi | None
    clients: ClientGate | None
    calls: RunningCalls


@dataclass(slots=True)
class McpTrace:
    """What one /mcp request did, for its access-log line."""

    rpc: str | None = None  # the JSON-RPC method: initialize, tools/list, tools/call ...
    tool: str | None = None
    error: str | None = None  # a tool error's type: bad_request, all_providers_failed ...
    search: SearchTrace = field(default_factory=SearchTrace)


@dataclass(frozen=True, slots=True)
class ToolContext:
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

"""Sessions an MCP route opens itself while its server is down: what the server last said of
itself (`ServerCard`) answers a new agent's `initialize`, so its idempotent tool calls can be
answered from the cache; once the server answers again, a session of the server's own opens
behind each, and requests in it go under the server's session id."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from multidict import CIMultiDict

from policies.core.clock import Clock
from policies.core.errors import UpstreamInvalidResponse
from policies.core.flow import Flow, Handler, Reply
from policies.core.memory import parse_cost
from policies.mcp.messages import (
    SseParser,
    attempt_id,
    encode,
    is_response,
    parse_message,
    response_in,
)
from policies.mcp.sessions import Recent

PREFIX = "sp-offline-"  # the session ids the proxy gives out itself
# What is kept of an agent's initialize params, at most (a peer must not make the proxy hold
# a request body per session): the fields a server reads.
MAX_PARAMS_BYTES = 8192
_PARAMS = ("protocolVersion", "capabilities", "clientInfo")
# Marks an answer the proxy made from its memory of the server (`result._meta`).
MARK = "search-proxy/offline"
# The most an answer a card keeps takes once parsed (an initialize result is a few hundred bytes,
# a first page of tools tens of KB): kept, it lives as long as the route, outside the budget.
MAX_CARD_BYTES = 4 * 1024 * 1024

Result = dict[str, Any]


@dataclass
class ServerCard:
    """What the route last saw its server answer: an `initialize` result and the first page
    of `tools/list`."""

    initialize: Result | None = None
    tools: Result | None = None


def noting(reply: Reply, request_id: Any, keep: Callable[[Result], None]) -> Reply:
    """`reply` unchanged, but the result it carries for `request_id` is handed to `keep` as it
    passes (from its JSON body, or from the SSE stream as the agent reads it)."""
    if reply.status != 200:
        return reply

    def look(data: bytes) -> bool:
        if len(data) + parse_cost(data) > MAX_CARD_BYTES:
            return False  # not kept, nor parsed: it passes as it is
        message = parse_message(data)
        if message is None or not is_response(message) or message.get("id") != request_id:
            return False
        if isinstance(message.get("result"), dict):
            keep(message["result"])
        return True

    if reply.stream is None:
        look(reply.body)
        return reply
    inner = reply.stream

    async def passing() -> AsyncIterator[bytes]:
        parser: SseParser | None = SseParser()
        async for chunk in inner:
            if parser is not None and any(look(data) for data in parser.feed(chunk)):
                parser = None  # found: the rest only passes
            yield chunk

    reply.stream = passing()
    return reply


@dataclass(eq=False)
class Opened:
    """A session the proxy opened for an agent: the agent's `initialize` params (to open one
    upstream for it later), and the server's session behind it once there is one."""

    params: Result
    upstream: str | None = None
    opening: asyncio.Lock = field(default_factory=asyncio.Lock)


class OfflineSessions:
    """The sessions one MCP route opened itself, and the route's upstream for every request:
    a request in such a session goes under the server's own session, opened first if needed."""

    def __init__(
        self, route: str, upstream: Handler, limit: int, idle: float, clock: Clock
    ) -> None:
        self.route = route
        self.upstream = upstream
        self.card = ServerCard()
        self._opened: Recent[Opened] = Recent(limit, idle, clock)

    def open(self, params: Result) -> str:
        """A new session of the proxy's own for an agent that sent `params` with initialize."""
        session = PREFIX + secrets.token_hex(16)
        kept = {k: params[k] for k in _PARAMS if k in params}
        if len(encode(kept)) > MAX_PARAMS_BYTES:
            kept = {"protocolVersion": str(params.get("protocolVersion", ""))[:32]}
            kept.update(capabilities={}, clientInfo={"name": "mcp-client", "version": "0"})
        self._opened.put(session, Opened(kept))
        return session

    def get(self, session: str | None) -> Opened | None:
        if session is None or not session.startswith(PREFIX):
            return None
        return self._opened.get(session)

    def forget(self, session: str) -> None:
        self._opened.pop(session)

    async def __call__(self, flow: Flow) -> Reply:
        session = flow.request.headers.get("Mcp-Session-Id")
        opened = self.get(session)
        if opened is None or session is None:
            return await self.upstream(flow)
        if opened.upstream is None:
            failed = await self._open_upstream(flow, opened)
            if failed is not None:
                return failed
        assert opened.upstream is not None
        reply = await self.upstream(_in_session(flow, opened.upstream))
        if reply.status == 404:
            opened.upstream = None  # the server lost it (a restart): open another next time
        if "Mcp-Session-Id" in reply.headers:
            reply.headers["Mcp-Session-Id"] = session
        return reply

    async def _open_upstream(self, flow: Flow, opened: Opened) -> Reply | None:
        """Open the server's session behind `opened` (initialize, then initialized): None once
        it is open, else the server's answer refusing it (a failed exchange raises)."""
        async with opened.opening:
            if opened.upstream is not None:
                return None
            headers = CIMultiDict(flow.request.headers)
            headers.popall("Mcp-Session-Id", None)
            asked = {
                "jsonrpc": "2.0",
                "id": attempt_id(),
                "method": "initialize",
                "params": opened.params,
            }
            request = replace(flow.request, method="POST", headers=headers, key_body=None)
            reply = await self.upstream(flow.with_request(replace(request, body=encode(asked))))
            if reply.status != 200:
                return reply
            try:
                session = reply.headers.get("Mcp-Session-Id")
                answer = await response_in(reply, asked["id"])
            finally:
                reply.discard()
            result = answer.get("result") if answer is not None else None
            if session is None or not isinstance(result, dict):
                raise UpstreamInvalidResponse(
                    f"{self.route}: the MCP server answered the initialize of a session the "
                    f"proxy opened for this agent without a session or a result "
                    f"{flow.attempt_text}; try again shortly",
                    route=self.route,
                    attempts=flow.attempt,
                )
            version = result.get("protocolVersion")
            if isinstance(version, str):
                headers["MCP-Protocol-Version"] = version
            initialized = encode({"jsonrpc": "2.0", "method": "notifications/initialized"})
            request = replace(request, headers=headers, body=initialized)
            done = await self.upstream(_in_session(flow.with_request(request), session))
            done.discard()
            opened.upstream = session
            return None


def _in_session(flow: Flow, session: str) -> Flow:
    headers = CIMultiDict(flow.request.headers)
    headers["Mcp-Session-Id"] = session
    return flow.with_request(replace(flow.request, headers=headers))

"""The messages that open, hold and end an MCP route's sessions: `initialize` (retried, and
answered by the proxy itself while the server is down), who may use a session, the GET stream
and DELETE when the server is gone, and what a session the proxy opened answers locally."""

from __future__ import annotations

from typing import Any

import structlog

from policies.core.errors import ProxyError, VendorFailure
from policies.core.flow import Flow, Handler, Reply
from policies.core.outcome import Outcome
from policies.mcp.messages import (
    SessionNotFound,
    answered,
    cut_event,
    encode,
    json_headers,
    no_tail,
    rpc_error,
)
from policies.mcp.offline import MARK, OfflineSessions, Result, noting
from policies.mcp.sessions import SessionOwners

log = structlog.get_logger("search_proxy.mcp")

# The server's answers that mean it is not there (a gateway in front of it answering for it).
_GONE = frozenset({502, 503, 504})
# The longest the handshake (initialize, initialized) may take, retries included: under the 60 s
# MCP clients wait, so an agent gets an answer (a session opened offline, or the proxy's
# error) rather than its own timeout, even from a server that accepts and never answers.
HANDSHAKE_S = 20.0


class SessionLifecycle:
    """One MCP route's sessions: who owns each (`owners`), the ones the proxy opened itself
    (`offline`, when `stand_in`), and the handler that sends a session's own messages upstream
    with the route's retries (`session`)."""

    def __init__(
        self,
        route: str,
        owners: SessionOwners,
        offline: OfflineSessions,
        session: Handler,
        upstream: Handler,
        stand_in: bool,
    ) -> None:
        self.route = route
        self.owners = owners
        self.offline = offline
        self.session = session
        self.upstream = upstream
        self.stand_in_allowed = stand_in

    # --- opening a session --------------------------------------------------------------

    async def handshake(self, flow: Flow) -> Reply:
        """A message of the handshake (initialize, initialized) through the route's retries,
        within HANDSHAKE_S."""
        context = flow.context
        context.deadline = min(context.deadline, context.started + HANDSHAKE_S)
        return await self.session(flow)

    async def initialize(self, flow: Flow, request_id: Any, params: Result) -> Reply:
        """`initialize`, retried on a failed exchange or a 5xx before anything was answered;
        while the server stays down, a session of the proxy's own when it may open one."""
        try:
            reply = await self.handshake(flow)
        except ProxyError as err:
            if isinstance(err, VendorFailure):
                opened = await self._open_offline(flow, request_id, params, err.type)
                if opened is not None:
                    return opened
            return answered(flow, rpc_error(request_id, err), err)
        if reply.status in _GONE:
            opened = await self._open_offline(flow, request_id, params, "upstream_error")
            if opened is not None:
                reply.discard()
                return opened
            return reply
        opened_id = reply.headers.get("Mcp-Session-Id")
        if 200 <= reply.status < 300 and opened_id is not None:
            await self.owners.bind(opened_id, flow.request.client)
        reply = noting(reply, request_id, self._keep_initialize)
        if reply.stream is not None:
            reply.cut_tail = lambda err: cut_event(flow, request_id, err, rpc_error)
        return reply

    def _keep_initialize(self, result: Result) -> None:
        self.offline.card.initialize = result

    def note_tools(self, reply: Reply, request_id: Any) -> Reply:
        """A tools/list answer, its first page kept for the sessions the proxy opens."""

        def keep(result: Result) -> None:
            self.offline.card.tools = result

        return noting(reply, request_id, keep)

    async def _open_offline(
        self, flow: Flow, request_id: Any, params: Result, why: str
    ) -> Reply | None:
        """The answer to `initialize` from the server's last known one, in a session of the
        proxy's own; None when this route opens none (off, or the server never answered)."""
        known = self.offline.card.initialize
        if not self.stand_in_allowed or known is None:
            return None
        session = self.offline.open(params)
        await self.owners.bind(session, flow.request.client)
        log.info("mcp_session_opened_offline", route=self.route, error=why)
        flow.trace.error = why  # the log line says why the server did not answer it
        headers = json_headers()
        headers["Mcp-Session-Id"] = session
        headers["X-Proxy-Error"] = why
        result = _marked(known)
        body = encode({"jsonrpc": "2.0", "id": request_id, "result": result})
        return Reply(200, headers, body, outcome=Outcome.OK)

    # --- who may use a session ----------------------------------------------------------

    def not_yours(self, flow: Flow, session: str, request_id: Any) -> Reply:
        """404 for a session this caller did not open, as a server answers one it does not
        know: the client opens a session of its own."""
        err = SessionNotFound(
            f"{self.route}: there is no MCP session {session[:64]!r} for these credentials: a "
            "session belongs to the credentials that opened it; send initialize to open one",
            route=self.route,
        )
        return answered(flow, rpc_error(request_id, err), err, status=404)

    async def ended(self, session: str) -> None:
        """The session is over (deleted, or unknown to the server): forget it."""
        await self.owners.forget(session)
        self.offline.forget(session)

    # --- what a session the proxy opened answers itself ---------------------------------

    async def stand_in(
        self,
        flow: Flow,
        session: str | None,
        method: Any,
        params: Result,
        message: Result | None,
    ) -> Reply | None:
        """The local answer in a session the proxy opened that has no server session behind
        it yet: what needs no server (initialized, ping, the tools it last listed, DELETE,
        no GET stream); None for the rest, which opens a server session on the way."""
        opened = self.offline.get(session)
        if opened is None or opened.upstream is not None or session is None:
            return None
        if flow.request.method == "DELETE":
            await self.ended(session)
            return Reply(200, json_headers(), b"")
        if flow.request.method == "GET":
            return self._no_stream(flow, "it has not answered since this session opened")
        if message is None or method is None:
            return None
        request_id = message.get("id")
        if "id" not in message:
            return Reply(202, json_headers(), b"")  # a notification: accepted, nobody to tell
        result: Result | None = None
        if method == "ping":
            result = {}
        elif method == "tools/list" and "cursor" not in params and self.offline.card.tools:
            tools = {k: v for k, v in self.offline.card.tools.items() if k != "nextCursor"}
            result = _marked(tools)
        if result is None:
            return None
        body = encode({"jsonrpc": "2.0", "id": request_id, "result": result})
        return Reply(200, json_headers(), body, outcome=Outcome.OK)

    # --- ending a session, and its GET stream -------------------------------------------

    async def delete(self, flow: Flow) -> Reply:
        """DELETE ends the session upstream; with the server gone it is over anyway, and the
        client is told so (200) rather than handed a 502 it cannot act on."""
        session = flow.request.headers.get("Mcp-Session-Id")
        try:
            reply = await self.upstream(flow)
        except VendorFailure as err:
            reply = self._over(flow, err.type)
        if reply.status in _GONE:
            reply.discard()
            reply = self._over(flow, "upstream_error")
        if session is not None and (200 <= reply.status < 300 or reply.status == 404):
            await self.ended(session)
        return reply

    def _over(self, flow: Flow, why: str) -> Reply:
        flow.trace.error = why
        headers = json_headers()
        headers["X-Proxy-Error"] = why
        return Reply(200, headers, b"", outcome=Outcome.CLIENT_ERROR)

    async def stream(self, flow: Flow) -> Reply:
        """The GET stream; a silent one cut by timeouts.idle just ends (the client opens
        another). With the server gone, 405: an MCP client takes it as "no stream offered"
        and goes on with its POSTs, where a 502 makes it give up on the session."""
        try:
            reply = await self.upstream(flow)
        except VendorFailure as err:
            return self._no_stream(flow, err.message, err.type)
        if reply.status in _GONE:
            reply.discard()
            return self._no_stream(flow, f"the MCP server answered HTTP {reply.status}")
        if reply.stream is not None:
            reply.cut_tail = no_tail
        return reply

    def _no_stream(self, flow: Flow, why: str, error: str = "upstream_error") -> Reply:
        flow.trace.error = error
        headers = json_headers()
        headers["Allow"] = "POST, DELETE"
        headers["X-Proxy-Error"] = error
        text = (
            f"{self.route}: no event stream for this session while the MCP server cannot be "
            f"reached ({why}); its POSTs still work (idempotent tools from the cache): open "
            "the stream again later"
        )
        body = encode({"error": {"type": error, "message": text, "route": self.route}})
        return Reply(405, headers, body, outcome=Outcome.CLIENT_ERROR)


def _marked(result: Result) -> Result:
    """A result the proxy answers from its memory of the server, marked so in `_meta`."""
    given = result.get("_meta")
    meta = given if isinstance(given, dict) else {}
    return {**result, "_meta": {**meta, MARK: True}}

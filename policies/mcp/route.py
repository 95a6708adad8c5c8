"""The two ends of an MCP route's chain: `McpRoute`, which reads each JSON-RPC message and sends
idempotent tool calls through the chain, and `McpUpstream`, one attempt of a tool call; and
`build_route`, which puts a route's parts together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import structlog
from multidict import CIMultiDict

from policies.core.clock import Clock
from policies.core.errors import (
    AnswerTooCostly,
    DeadlineExceeded,
    MemoryBudgetFull,
    ProxyError,
    StreamCut,
    UpstreamInvalidResponse,
    UpstreamUnreachable,
    seconds_text,
)
from policies.core.flow import Flow, Handler, Policy, Reply, compose
from policies.core.memory import Hold, holding, parse_cost
from policies.core.outcome import Outcome
from policies.mcp.config import McpConfig
from policies.mcp.lifecycle import SessionLifecycle
from policies.mcp.messages import (
    CHALLENGE,
    Cancelled,
    SseParser,
    answered,
    assess,
    attempt_id,
    cut_event,
    encode,
    is_response,
    json_headers,
    parse_message,
    rpc_error,
    sse_event,
    tool_error,
)
from policies.mcp.offline import OfflineSessions
from policies.mcp.sessions import SessionOwners

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

log = structlog.get_logger("search_proxy.mcp")


# Interim messages buffered between the upstream and a slow agent before the relay waits.
INTERIM_QUEUE = 64


# --- the bottom of a tool call's chain ------------------------------------------------------


class McpUpstream:
    """One attempt of a tool call: sends it under an id of its own, relays the progress it
    streams to the request's interim sink, and answers the chain with the final JSON-RPC
    response (status 503 when it is a transient failure, so retries, the breaker and stale
    entries act on it)."""

    def __init__(self, route: str, cfg: McpConfig, upstream: Handler, clock: Clock) -> None:
        self.route = route
        self.cfg = cfg
        self.upstream = upstream
        self.clock = clock

    async def __call__(self, flow: Flow) -> Reply:
        message = parse_message(flow.request.body)
        if message is None:  # the edge only sends tool calls here
            raise UpstreamInvalidResponse(f"{self.route}: not a JSON-RPC message", route=self.route)
        tool = str((message.get("params") or {}).get("name", ""))
        sent_as = attempt_id()
        flow.trace.rpc_attempts.append(sent_as)
        body = encode({**message, "id": sent_as})
        reply = await self.upstream(flow.with_request(replace(flow.request, body=body)))
        if not 200 <= reply.status < 300:
            return reply  # the status decides: 429 and 5xx are retried, 4xx passes through
        try:
            remaining = flow.context.deadline - self.clock.now()
            async with asyncio.timeout(max(remaining, 0.0)):
                final = await self._final(flow, reply, sent_as)
        except TimeoutError:
            raise DeadlineExceeded(
                f"{self.route}: the tool call {tool!r} ran past the route's timeouts.total of "
                f"{seconds_text(flow.context.deadline - flow.context.started)} after "
                f"{flow.attempt} attempt(s); raise timeouts.total for long tool calls, or try "
                "again",
                route=self.route,
                attempts=flow.attempt,
            ) from None
        finally:
            reply.discard()
        outcome = assess(self.cfg, tool, final)
        status = 503 if outcome is Outcome.SERVER_ERROR else 200
        return Reply(status, json_headers(), encode(final), outcome=outcome)

    async def _final(self, flow: Flow, reply: Reply, sent_as: str) -> dict[str, Any]:
        """The response to `sent_as`, from a JSON body or the SSE stream carrying it."""
        if reply.stream is None:
            message = parse_message(reply.body)
            if message is None or not is_response(message):
                raise self._malformed(flow, "answered a tool call with no JSON-RPC response")
            return message
        parser = SseParser()
        hold = holding()
        try:
            async for chunk in reply.stream:
                for data in parser.feed(chunk):
                    cost = self._charge_parse(flow, data, hold)
                    message = parse_message(data)
                    if message is None:
                        pass
                    elif is_response(message) and message.get("id") == sent_as:
                        return message  # its charge ends with the request
                    elif flow.context.interim is not None and not is_response(message):
                        await flow.context.interim(sse_event(encode(message)))
                    if hold is not None:
                        hold.give(cost)  # passed on, or not ours: let go
        except StreamCut as cut:
            raise cut.error from None  # an attempt that failed: the retry loop decides
        raise UpstreamUnreachable(
            f"{self.route}: the MCP server ended the tool call's stream without a result "
            f"{flow.attempt_text}; try again shortly",
            route=self.route,
            attempts=flow.attempt,
            outcome=Outcome.RESET,
            reason="ended the stream without a result",
        )

    def _charge_parse(self, flow: Flow, data: bytes, hold: Hold | None) -> int:
        """Charge `hold` what parsing an event of the stream will take, and return it, as a
        buffered answer is charged (proxy/forward.py): the stream's bytes pass uncounted, but
        one event of many small values would parse to many times its size."""
        cost = parse_cost(data) if hold is not None else 0
        if not cost or hold is None or hold.take(cost):
            return cost
        limit = hold.budget.limit
        if len(data) + cost <= limit:
            raise MemoryBudgetFull.over(self.route, flow.attempt, limit)
        raise AnswerTooCostly(
            f"{self.route}: the MCP server's event of {len(data)} bytes would take some "
            f"{len(data) + cost} bytes of memory once read (it holds many small values), more "
            f"than the memory budget of {limit} bytes (server.max_buffered_bytes); it is not "
            "retried; ask for less, or raise server.max_buffered_bytes",
            route=self.route,
            attempts=flow.attempt,
        )

    def _malformed(self, flow: Flow, what: str) -> UpstreamInvalidResponse:
        return UpstreamInvalidResponse(
            f"{self.route}: the MCP server {what} {flow.attempt_text}; try again shortly",
            route=self.route,
            attempts=flow.attempt,
        )


# --- the route's handler ------------------------------------------------------------------


class McpRoute:
    """An MCP route's handler: tool calls of idempotent tools through `chain`, the session's
    own messages (initialize, initialized, DELETE, the GET stream) through `lifecycle`, the
    rest straight to `upstream`; every answer under the agent's own JSON-RPC id. A request
    naming a session its caller did not open reaches nothing upstream."""

    def __init__(
        self,
        route: str,
        cfg: McpConfig,
        chain: Handler,
        upstream: Handler,
        lifecycle: SessionLifecycle,
    ) -> None:
        self.route = route
        self.cfg = cfg
        self.chain = chain
        self.upstream = upstream
        self.lifecycle = lifecycle
        # Tool calls in flight by (session, caller, the agent's id): a cancel finds its call.
        # One entry per running request, so it is bounded by the proxy's connections.
        self._running: dict[tuple[str, str, bytes], tuple[asyncio.Task[Reply], Flow]] = {}

    async def __call__(self, flow: Flow) -> Reply:
        message = parse_message(flow.request.body) if flow.request.method == "POST" else None
        method = message.get("method") if message is not None else None
        params = message.get("params") if message is not None else None
        if not isinstance(params, dict):
            params = {}
        tool = params.get("name")
        if isinstance(method, str):
            rpc = f"{method} {tool}" if isinstance(tool, str) else method
            flow.trace.rpc = rpc[:120]  # the agent's text: bounded on the log line
        request_id = message.get("id") if message is not None else None
        life = self.lifecycle
        session = flow.request.headers.get("Mcp-Session-Id")
        if session is not None and not await life.owners.allows(session, flow.request.client):
            return life.not_yours(flow, session, request_id)
        if method == "notifications/cancelled":
            flow = self._cancel(flow, message or {}, params)
        reply = await life.stand_in(flow, session, method, params, message)
        if reply is None:
            reply = await self._dispatch(flow, message, method, params, tool)
        if session is not None and reply.status == 404:
            await life.ended(session)  # the server no longer knows it
        if reply.status in (401, 403) and "WWW-Authenticate" in reply.headers:
            reply.headers["WWW-Authenticate"] = CHALLENGE
        return reply

    async def _dispatch(
        self,
        flow: Flow,
        message: dict[str, Any] | None,
        method: Any,
        params: dict[str, Any],
        tool: Any,
    ) -> Reply:
        life = self.lifecycle
        if flow.request.method == "DELETE":
            return await life.delete(flow)
        if flow.request.method == "GET":
            return await life.stream(flow)
        if message is None or method is None or "id" not in message:
            # Notifications, responses and batches; the one that ends the handshake is
            # retried like the initialize before it.
            if method == "notifications/initialized":
                return await life.handshake(flow)
            return await self.upstream(flow)
        request_id = message["id"]
        if method == "initialize":
            return await life.initialize(flow, request_id, params)
        if (
            method != "tools/call"
            or not isinstance(tool, str)
            or tool not in self.cfg.idempotent_tools
            # Anything besides the tool and its arguments (a task-augmented call, say) may
            # make the answer this session's own: not for the cache.
            or not params.keys() <= {"name", "arguments", "_meta"}
        ):
            reply = await self._passthrough(flow, request_id)
            if method == "tools/list" and "cursor" not in params:
                reply = life.note_tools(reply, request_id)
            return reply
        key_body = encode({"tool": tool, "arguments": params.get("arguments") or {}})
        return await self._tool_call(
            flow.with_request(replace(flow.request, key_body=key_body)), request_id
        )

    def _key(self, flow: Flow, request_id: Any) -> tuple[str, str, bytes]:
        session = flow.request.headers.get("Mcp-Session-Id", "")
        return session, flow.request.client, encode({"id": request_id})

    def _cancel(self, flow: Flow, message: dict[str, Any], params: dict[str, Any]) -> Flow:
        """The agent cancels a tool call: stop ours, and tell the server under the id it knows
        (the flow that sends the cancel on)."""
        running = self._running.get(self._key(flow, params.get("requestId")))
        if running is None:
            return flow
        task, call_flow = running
        task.cancel()
        sent = call_flow.trace.rpc_attempts
        if not sent:
            return flow
        body = encode({**message, "params": {**params, "requestId": sent[-1]}})
        return flow.with_request(replace(flow.request, body=body))

    async def _passthrough(self, flow: Flow, request_id: Any) -> Reply:
        """A request the policies leave alone; a failure is answered as a JSON-RPC error."""
        try:
            reply = await self.upstream(flow)
        except ProxyError as err:
            return answered(flow, rpc_error(request_id, err), err)
        if reply.stream is not None:
            reply.cut_tail = lambda err: cut_event(flow, request_id, err, rpc_error)
        return reply

    async def _tool_call(self, flow: Flow, request_id: Any) -> Reply:
        """Runs the call through the chain; answers JSON, or SSE once progress arrives."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(INTERIM_QUEUE)
        streaming = asyncio.Event()

        async def interim(event: bytes) -> None:
            streaming.set()
            await queue.put(event)

        flow.context.interim = interim
        call = asyncio.create_task(self._final(flow, request_id))
        key = self._key(flow, request_id)
        self._running[key] = (call, flow)
        call.add_done_callback(lambda _: self._forget(key, call))
        waiter = asyncio.create_task(streaming.wait())
        try:
            await asyncio.wait((call, waiter), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            waiter.cancel()
        if not streaming.is_set():
            return self._last_reply(flow, call, request_id, streaming=False)

        async def events() -> AsyncIterator[bytes]:
            while (event := await queue.get()) is not None:
                yield event
            yield sse_event(self._last_reply(flow, call, request_id, streaming=True).body)

        async def finish() -> None:
            try:
                await asyncio.wait((call,))  # however it ends: its outcome is read by events()
            finally:
                await queue.put(None)

        closer = asyncio.create_task(finish())

        def release() -> None:
            call.cancel()
            closer.cancel()

        return Reply(
            200,
            CIMultiDict({"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}),
            stream=events(),
            release=release,
            cut_tail=lambda err: cut_event(flow, request_id, err, tool_error),
        )

    def _forget(self, key: tuple[str, str, bytes], call: asyncio.Task[Reply]) -> None:
        if self._running.get(key, (None,))[0] is call:
            del self._running[key]

    def _last_reply(
        self, flow: Flow, call: asyncio.Task[Reply], request_id: Any, streaming: bool
    ) -> Reply:
        """The finished call's answer: its JSON-RPC response, or a tool error saying why not."""
        if call.cancelled():
            err: ProxyError = Cancelled(
                f"{self.route}: the client cancelled this tool call", route=self.route
            )
        elif (failure := call.exception()) is not None:
            log.error("mcp_tool_call_failed", route=self.route, exc_info=failure)
            err = UpstreamInvalidResponse(
                f"{self.route}: the tool call failed inside the proxy "
                f"({type(failure).__name__}); try again shortly",
                route=self.route,
            )
        else:
            reply = call.result()
            # Once progress went out as a stream, only a JSON-RPC response can end it.
            if reply.stream is None and (reply.status == 200 or not streaming):
                return reply
            reply.discard()
            err = UpstreamInvalidResponse(
                f"{self.route}: the MCP server answered HTTP {reply.status} to the tool call "
                "after sending progress; try again shortly",
                route=self.route,
                upstream_status=reply.status,
            )
        return answered(flow, tool_error(request_id, err), err)

    async def _final(self, flow: Flow, request_id: Any) -> Reply:
        """The tool call's answer, under the agent's id; the proxy's failures as tool errors."""
        try:
            reply = await self.chain(flow)
        except ProxyError as err:
            return answered(flow, tool_error(request_id, err), err)
        if 400 <= reply.status < 500 and reply.status != 429:
            return reply  # the server's own answer (404: the session is gone; 400, 401 ...)
        message = parse_message(reply.body) if reply.stream is None else None
        if message is None or not is_response(message):
            reply.discard()
            invalid = UpstreamInvalidResponse(
                f"{self.route}: the MCP server answered HTTP {reply.status} to the tool call "
                f"without a JSON-RPC response after {flow.trace.attempts} attempt(s); try again "
                "shortly",
                route=self.route,
                attempts=flow.trace.attempts,
                upstream_status=reply.status,
            )
            return answered(flow, tool_error(request_id, invalid), invalid)
        # A JSON-RPC answer, even one the server sent with a 5xx, is the agent's to read.
        headers = json_headers()
        headers.update({k: v for k, v in reply.headers.items() if k.lower() != "content-type"})
        message = {**message, "id": request_id}
        result = message.get("result")
        if isinstance(result, dict):  # what the proxy did, where the agent's code can read it
            marks = {"cache": flow.trace.cache if flow.trace.cache in ("hit", "stale") else None}
            marks["query_used"] = flow.trace.query_used
            if any(marks.values()):
                given = result.get("_meta")
                meta: dict[str, Any] = given if isinstance(given, dict) else {}
                added = {f"search-proxy/{k}": v for k, v in marks.items() if v is not None}
                message["result"] = {**result, "_meta": {**meta, **added}}
        return Reply(200, headers, encode(message), outcome=reply.outcome)


def build_route(
    route: str,
    cfg: McpConfig,
    *,
    policies: Sequence[Policy],
    upstream: Handler,
    retry: Policy | None,
    clock: Clock,
    redis: RedisLink | None,
    cached: bool,
) -> McpRoute:
    """An MCP route from its built policies and its upstream: tool calls of idempotent tools
    through `policies`, a session's own messages through `retry` alone, everything through the
    sessions the proxy opens itself (`cached`: the route has a cache to answer them from)."""
    offline = OfflineSessions(route, upstream, cfg.max_sessions, cfg.session_idle, clock)
    lifecycle = SessionLifecycle(
        route,
        SessionOwners(route, cfg.max_sessions, cfg.session_idle, clock, redis),
        offline,
        session=compose([retry] if retry is not None else [], offline),
        upstream=offline,
        stand_in=cached and cfg.offline_sessions,
    )
    calls = compose(policies, McpUpstream(route, cfg, offline, clock))
    return McpRoute(route, cfg, calls, offline, lifecycle)

"""MCP routes: a remote MCP server (streamable HTTP) behind the route's policies, per tool call.

An agent's MCP client POSTs JSON-RPC messages to one endpoint and gets JSON or an SSE stream
back (progress notifications, then the result). HTTP-level policies would cache an `initialize`
with another client's session, or retry a whole stream. Here a route's `mcp:` section makes
the proxy read the messages:

- `tools/call` of a tool listed in `idempotent_tools` goes through the route's chain (cache,
  breaker, search recovery, retry, rate limit) as one search would. `McpUpstream`, at the
  bottom, relays the call's progress notifications to the agent as they arrive (`Flow.interim`)
  and hands the chain the final JSON-RPC response, classified: a JSON-RPC error or tool error
  the config marks transient is a 5xx, an empty search result inside the tool's content is
  EMPTY (so the query is simplified), anything else ends the call.
- Everything else (`initialize`, notifications, other methods, tools not known to be
  idempotent, the GET stream, DELETE) passes straight through, never cached or coalesced.

Each attempt goes upstream under an id of its own, and every answer (fresh, retried, cached,
stale) reaches the agent under the agent's own JSON-RPC id. A failure the proxy answers
itself is a tool error (`isError`) carrying the proxy's message for a tool call, a JSON-RPC
error for other requests: an MCP client raises on a non-2xx answer, losing the message.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import structlog
from multidict import CIMultiDict

from policies.core.clock import Clock
from policies.core.errors import (
    ClientFault,
    DeadlineExceeded,
    ProxyError,
    StreamCut,
    UpstreamInvalidResponse,
    UpstreamUnreachable,
    seconds_text,
)
from policies.core.flow import Flow, Handler, Reply
from policies.core.outcome import Outcome
from policies.core.profile import McpPreset
from policies.vendors import BUILTIN

log = structlog.get_logger("search_proxy.mcp")

# JSON-RPC codes MCP servers use for failures that may pass: the MCP SDKs' "connection
# closed" (-32000) and "request timed out" (-32001), and JSON-RPC's internal error.
TRANSIENT_CODES = frozenset({-32000, -32001, -32603})
TRANSIENT_TOOL_ERRORS = ("temporarily unavailable", "timed out", "rate limit", "try again")
# The code of the JSON-RPC errors the proxy answers itself (implementation-defined range).
PROXY_ERROR_CODE = -32099
# Interim messages buffered between the upstream and a slow agent before the relay waits.
INTERIM_QUEUE = 64
# The JSON-RPC ids of upstream attempts: unique in this process, unguessable across processes
# (never derived from anything the agent sends, such as its X-Request-Id).
_ATTEMPT_PREFIX = f"sp-{secrets.token_hex(6)}-"
_ATTEMPT_NUMBERS = itertools.count(1)


class Cancelled(ClientFault):
    """The agent cancelled its request (`notifications/cancelled`)."""

    status = 499
    type = "cancelled"


# The vendors' remote MCP servers a route's `mcp: {server: <vendor>}` starts from; each preset
# is in its vendor's record (policies/vendors/).
KNOWN_SERVERS: Mapping[str, McpPreset] = MappingProxyType(
    {name: vendor.mcp for name, vendor in BUILTIN.items() if vendor.mcp is not None}
)


@dataclass(frozen=True)
class McpConfig:
    """A route's `mcp:` section."""

    server: str | None = None  # a KNOWN_SERVERS preset the other keys default from
    idempotent_tools: frozenset[str] = frozenset()  # cached and retried per call
    search_tools: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    transient_errors: frozenset[int] = TRANSIENT_CODES
    transient_tool_errors: tuple[str, ...] = TRANSIENT_TOOL_ERRORS


# --- JSON-RPC and SSE ------------------------------------------------------------------------


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


# --- the bottom of a tool call's chain ------------------------------------------------------

_JSON = CIMultiDict({"Content-Type": "application/json"})


class McpUpstream:
    """One attempt of a tool call: sends it under an id of its own, relays the progress it
    streams to `flow.interim`, and answers the chain with the final JSON-RPC response (status
    503 when it is a transient failure, so retries, the breaker and stale entries act on it)."""

    def __init__(self, route: str, cfg: McpConfig, upstream: Handler, clock: Clock) -> None:
        self.route = route
        self.cfg = cfg
        self.upstream = upstream
        self.clock = clock

    async def __call__(self, flow: Flow) -> Reply:
        message = parse_message(flow.body)
        if message is None:  # the edge only sends tool calls here
            raise UpstreamInvalidResponse(f"{self.route}: not a JSON-RPC message", route=self.route)
        tool = str((message.get("params") or {}).get("name", ""))
        attempt_id = flow.rpc_attempt = f"{_ATTEMPT_PREFIX}{next(_ATTEMPT_NUMBERS)}"
        body, flow.body = flow.body, encode({**message, "id": attempt_id})
        try:
            reply = await self.upstream(flow)
        finally:
            flow.body = body
        if not 200 <= reply.status < 300:
            return reply  # the status decides: 429 and 5xx are retried, 4xx passes through
        try:
            remaining = flow.deadline - self.clock.now()
            async with asyncio.timeout(max(remaining, 0.0)):
                final = await self._final(flow, reply, attempt_id)
        except TimeoutError:
            raise DeadlineExceeded(
                f"{self.route}: the tool call {tool!r} ran past the route's timeouts.total of "
                f"{seconds_text(flow.deadline - flow.started)} after {flow.attempts} "
                "attempt(s); raise timeouts.total for long tool calls, or try again",
                route=self.route,
                attempts=flow.attempts,
            ) from None
        finally:
            reply.discard()
        outcome = assess(self.cfg, tool, final)
        status = 503 if outcome is Outcome.SERVER_ERROR else 200
        return Reply(status, CIMultiDict(_JSON), encode(final), outcome=outcome)

    async def _final(self, flow: Flow, reply: Reply, attempt_id: str) -> dict[str, Any]:
        """The response to `attempt_id`, from a JSON body or the SSE stream carrying it."""
        if reply.stream is None:
            message = parse_message(reply.body)
            if message is None or not is_response(message):
                raise self._malformed(flow, "answered a tool call with no JSON-RPC response")
            return message
        parser = SseParser()
        try:
            async for chunk in reply.stream:
                for data in parser.feed(chunk):
                    message = parse_message(data)
                    if message is None:
                        continue
                    if is_response(message) and message.get("id") == attempt_id:
                        return message
                    if flow.interim is not None and not is_response(message):
                        await flow.interim(sse_event(encode(message)))
        except StreamCut as cut:
            raise cut.error from None  # an attempt that failed: the retry loop decides
        raise UpstreamUnreachable(
            f"{self.route}: the MCP server ended the tool call's stream without a result "
            f"(attempt {flow.attempts} of {flow.max_attempts}); try again shortly",
            route=self.route,
            attempts=flow.attempts,
            outcome=Outcome.RESET,
            reason="ended the stream without a result",
        )

    def _malformed(self, flow: Flow, what: str) -> UpstreamInvalidResponse:
        return UpstreamInvalidResponse(
            f"{self.route}: the MCP server {what} (attempt {flow.attempts} of "
            f"{flow.max_attempts}); try again shortly",
            route=self.route,
            attempts=flow.attempts,
        )


# --- the route's handler ------------------------------------------------------------------


class McpRoute:
    """An MCP route's handler: tool calls of idempotent tools through `chain`, everything
    else straight to `upstream`; every answer under the agent's own JSON-RPC id."""

    def __init__(self, route: str, cfg: McpConfig, chain: Handler, upstream: Handler) -> None:
        self.route = route
        self.cfg = cfg
        self.chain = chain
        self.upstream = upstream
        # Tool calls in flight by (session, caller, the agent's id): a cancel finds its call.
        # One entry per running request, so it is bounded by the proxy's connections.
        self._running: dict[tuple[str, str, bytes], tuple[asyncio.Task[Reply], Flow]] = {}

    async def __call__(self, flow: Flow) -> Reply:
        message = parse_message(flow.body) if flow.method == "POST" else None
        method = message.get("method") if message is not None else None
        params = message.get("params") if message is not None else None
        if not isinstance(params, dict):
            params = {}
        tool = params.get("name")
        if isinstance(method, str):
            rpc = f"{method} {tool}" if isinstance(tool, str) else method
            flow.rpc = rpc[:120]  # the agent's text: bounded on the log line
        if message is None or method is None or "id" not in message:
            # Notifications, responses, batches, DELETE, and the GET stream: a silent GET
            # stream cut by timeouts.idle just ends (the client opens another), no error event.
            if method == "notifications/cancelled":
                self._cancel(flow, message or {}, params)
            reply = await self.upstream(flow)
            if reply.stream is not None and flow.method == "GET":
                reply.cut_tail = _nothing
            return reply
        request_id = message["id"]
        if (
            method != "tools/call"
            or not isinstance(tool, str)
            or tool not in self.cfg.idempotent_tools
            # Anything besides the tool and its arguments (a task-augmented call, say) may
            # make the answer this session's own: not for the cache.
            or not params.keys() <= {"name", "arguments", "_meta"}
        ):
            return await self._passthrough(flow, request_id)
        flow.key_body = encode({"tool": tool, "arguments": params.get("arguments") or {}})
        return await self._tool_call(flow, request_id)

    def _key(self, flow: Flow, request_id: Any) -> tuple[str, str, bytes]:
        session = flow.headers.get("Mcp-Session-Id", "")
        return session, flow.client, encode({"id": request_id})

    def _cancel(self, flow: Flow, message: dict[str, Any], params: dict[str, Any]) -> None:
        """The agent cancels a tool call: stop ours, and tell the server under the id it knows."""
        running = self._running.get(self._key(flow, params.get("requestId")))
        if running is None:
            return
        task, call_flow = running
        task.cancel()
        if call_flow.rpc_attempt is not None:
            params = {**params, "requestId": call_flow.rpc_attempt}
            flow.body = encode({**message, "params": params})

    async def _passthrough(self, flow: Flow, request_id: Any) -> Reply:
        """A request the policies leave alone; a failure is answered as a JSON-RPC error."""
        try:
            reply = await self.upstream(flow)
        except ProxyError as err:
            return _answer(flow, rpc_error(request_id, err), err)
        if reply.stream is not None:
            reply.cut_tail = lambda err: _cut_event(flow, request_id, err, rpc_error)
        return reply

    async def _tool_call(self, flow: Flow, request_id: Any) -> Reply:
        """Runs the call through the chain; answers JSON, or SSE once progress arrives."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(INTERIM_QUEUE)
        streaming = asyncio.Event()

        async def interim(event: bytes) -> None:
            streaming.set()
            await queue.put(event)

        flow.interim = interim
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
            cut_tail=lambda err: _cut_event(flow, request_id, err, tool_error),
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
        return _answer(flow, tool_error(request_id, err), err)

    async def _final(self, flow: Flow, request_id: Any) -> Reply:
        """The tool call's answer, under the agent's id; the proxy's failures as tool errors."""
        try:
            reply = await self.chain(flow)
        except ProxyError as err:
            return _answer(flow, tool_error(request_id, err), err)
        if 400 <= reply.status < 500 and reply.status != 429:
            return reply  # the server's own answer (404: the session is gone; 400, 401 ...)
        message = parse_message(reply.body) if reply.stream is None else None
        if message is None or not is_response(message):
            reply.discard()
            invalid = UpstreamInvalidResponse(
                f"{self.route}: the MCP server answered HTTP {reply.status} to the tool call "
                f"without a JSON-RPC response after {flow.attempts} attempt(s); try again "
                "shortly",
                route=self.route,
                attempts=flow.attempts,
                upstream_status=reply.status,
            )
            return _answer(flow, tool_error(request_id, invalid), invalid)
        # A JSON-RPC answer, even one the server sent with a 5xx, is the agent's to read.
        headers = CIMultiDict(_JSON)
        headers.update({k: v for k, v in reply.headers.items() if k.lower() != "content-type"})
        message = {**message, "id": request_id}
        result = message.get("result")
        if isinstance(result, dict):  # what the proxy did, where the agent's code can read it
            marks = {"cache": flow.cache if flow.cache in ("hit", "stale") else None}
            marks["query_used"] = flow.query_used
            if any(marks.values()):
                given = result.get("_meta")
                meta: dict[str, Any] = given if isinstance(given, dict) else {}
                added = {f"search-proxy/{k}": v for k, v in marks.items() if v is not None}
                message["result"] = {**result, "_meta": {**meta, **added}}
        return Reply(200, headers, encode(message), outcome=reply.outcome)


def _answer(flow: Flow, message: Mapping[str, Any], err: ProxyError) -> Reply:
    flow.error = err.type  # the log line's `error`, also once headers have gone
    headers = CIMultiDict(_JSON)
    headers["X-Proxy-Error"] = err.type
    return Reply(200, headers, encode(message), outcome=Outcome.CLIENT_ERROR)


def _nothing(err: Exception) -> bytes:
    return b""


def _cut_event(flow: Flow, request_id: Any, err: Exception, render: Any) -> bytes:
    if not isinstance(err, ProxyError):
        err = UpstreamUnreachable(str(err))
    flow.error = err.type
    return sse_event(encode(render(request_id, err)))

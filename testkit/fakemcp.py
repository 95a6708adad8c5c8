"""A fake remote search MCP server that mimics Tavily's (streamable HTTP, stateful sessions).

A real FastMCP server from the official ``mcp`` package, with Tavily's tool names and result
format, behind an ASGI middleware that records what arrived and injects failures::

    fake = FakeMcp(fail_rate=0.3, fail_mode="mixed", progress_gaps=[0.2, 0.2])
    async with serve_fake_mcp(fake) as url:  # "http://127.0.0.1:<port>/mcp"
        ...  # point an MCP client (or the proxy) at url
        await fake.stop()  # optional: the server goes down mid-test (connections cut)
    assert fake.calls[0].tool == "tavily_search"

Tools (each answers ONE text content holding JSON, no ``structuredContent``, like Tavily):

- ``tavily_search(query, max_results=5, search_depth="basic", topic="general", ...)`` ->
  ``{"query", "results": [{"url", "title", "content", "score"}], "response_time"}``; the results
  are ``make_results(query, min(max_results, fake.results))`` of the fake REST vendor (urls
  ``https://example.com/<slug>/<i>``), none when the query has more than ``empty_over_words``.
- ``tavily_extract(urls)`` -> ``{"results": [{"url", "raw_content"}]}``.

Before answering, a tool sleeps each of ``progress_gaps`` then sends one progress notification
(``progress`` = 1..n, ``total`` = n; only when the client asked for progress), then sleeps
``silent`` seconds without any event. Each sent notification is recorded in ``fake.progress``.

Failures (``tools/call`` only, in arrival order): the first ``fail_first`` calls fail, then each
fails with probability ``fail_rate`` (``random.Random(seed)``). Apart from those, the first
``fail_initialize`` ``initialize`` requests get HTTP 503 (a blip while an agent connects).
With ``api_key`` set, a request without it gets 401 and, as Tavily's server answers, a
``WWW-Authenticate`` naming the server's own OAuth metadata. ``set_cookie`` makes every answer
set that cookie, as a load balancer's sticky session does.
Every request on the endpoint is counted in ``fake.requests`` (``"POST tools/list"``, ``"GET"``,
``"DELETE"``), refused ones included. How, by ``fail_mode``:
``http_503`` (HTTP 503 + small JSON body, the tool never runs), ``jsonrpc_error`` (HTTP 200,
application/json, JSON-RPC error -32603 with the request's id), ``tool_error`` (the tool raises
after its waits: ``isError: true``, text containing FAIL_MESSAGE), ``mixed`` (one of the three
at random).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import uvicorn
from mcp.server.fastmcp import Context, FastMCP
from mcp.server.session import ServerSession
from mcp.server.transport_security import TransportSecuritySettings
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.testing.fakevendor.vendors import make_results

FailMode = Literal["http_503", "jsonrpc_error", "tool_error", "mixed"]
FAIL_MODES: tuple[str, ...] = ("http_503", "jsonrpc_error", "tool_error")
FAIL_MESSAGE = "search backend temporarily unavailable"
McpContext = Context[ServerSession, object, Request]  # module level: FastMCP resolves hints


@dataclass
class Call:
    """One ``tools/call`` POST as received, and how it was answered."""

    tool: str
    arguments: dict[str, Any]
    request_id: str | int | None  # the JSON-RPC id
    session_id: str | None  # Mcp-Session-Id header
    authorization: str | None  # Authorization header
    at: float  # time.monotonic() on arrival
    status: int | None = None  # HTTP status answered (None: no answer started)
    failure: str | None = None  # injected fail mode, None when not failed


@dataclass(frozen=True)
class Progress:
    """One progress notification the server sent."""

    request_id: str  # str() of the tool call's JSON-RPC id
    progress: float
    total: float
    at: float  # time.monotonic() just before it was handed to the transport


@dataclass
class FakeMcp:
    """Knobs (change them any time, they are read per request) and records of the fake."""

    # knobs
    seed: int = 0
    results: int = 3  # results the backend has; an answer carries min(max_results, results)
    empty_over_words: int | None = None
    progress_gaps: list[float] = field(default_factory=list)
    silent: float = 0.0
    fail_rate: float = 0.0
    fail_mode: FailMode = "http_503"
    fail_first: int = 0
    fail_initialize: int = 0  # the first this many initialize requests get HTTP 503
    set_cookie: str | None = None  # a Set-Cookie value every answer carries
    json_response: bool = False  # True: answer POSTs with JSON instead of SSE
    api_key: str | None = None  # set: anything without "Authorization: Bearer <key>" gets 401
    path: str = "/mcp"
    # records
    calls: list[Call] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # "<METHOD> <JSON-RPC method>", in order
    progress: list[Progress] = field(default_factory=list)
    initializes: int = 0
    session_ids: set[str] = field(default_factory=set)  # issued (Mcp-Session-Id answered)
    deletes: int = 0  # DELETE requests
    cancelled: list[Any] = field(default_factory=list)  # requestIds of notifications/cancelled
    gets: int = 0  # GET streams opened (answered 200)
    failures: int = 0
    url: str | None = None  # endpoint while served
    _rng: random.Random = field(init=False, repr=False)
    _tool_errors: set[tuple[str | None, str]] = field(init=False, repr=False)
    _tool_calls: int = field(default=0, init=False, repr=False)
    _server: uvicorn.Server | None = field(default=None, init=False, repr=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.fail_mode not in get_args(FailMode):
            raise ValueError(f"fail_mode must be one of {get_args(FailMode)}")
        self._rng = random.Random(self.seed)
        self._tool_errors = set()
        self._tool_calls = 0

    def reset(self) -> None:
        """Forget the records; the seeded RNG restarts (knobs stay)."""
        self.calls.clear()
        self.requests.clear()
        self.progress.clear()
        self.cancelled.clear()
        self.session_ids.clear()
        self.initializes = self.deletes = self.gets = self.failures = 0
        self._rng = random.Random(self.seed)
        self._tool_errors.clear()
        self._tool_calls = 0

    # ------------------------------------------------------------------ the MCP server

    def make_app(self) -> ASGIApp:
        """A fresh ASGI app (FastMCP streamable HTTP behind the recording middleware); run its
        lifespan. Each serve needs a fresh app: a session manager runs only once."""
        mcp = FastMCP(
            "fake-tavily",
            log_level="WARNING",
            streamable_http_path=self.path,
            json_response=self.json_response,
            stateless_http=False,
            # a proxy in front sends its own Host header: no DNS-rebinding checks
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )

        @mcp.tool(structured_output=False)
        async def tavily_search(
            query: str,
            ctx: McpContext,
            max_results: int = 5,
            search_depth: str = "basic",
            topic: str = "general",
            time_range: str | None = None,
            include_domains: list[str] | None = None,
            exclude_domains: list[str] | None = None,
            include_raw_content: bool = False,
            country: str | None = None,
        ) -> str:
            """Search the web (fake Tavily): JSON text with results[] url/title/content/score."""
            await self._before_answer(ctx)
            limit = self.empty_over_words
            n = 0 if limit is not None and len(query.split()) > limit else max_results
            found = make_results(query, max(0, min(n, self.results)))
            results = [
                {"url": r.url, "title": r.title, "content": r.snippet, "score": r.score}
                for r in found
            ]
            return json.dumps({"query": query, "results": results, "response_time": 0.01})

        @mcp.tool(structured_output=False)
        async def tavily_extract(urls: list[str], ctx: McpContext) -> str:
            """Extract pages (fake Tavily): JSON text with results[] url/raw_content."""
            await self._before_answer(ctx)
            results = [{"url": u, "raw_content": f"Content of {u}."} for u in urls]
            return json.dumps({"results": results, "failed_results": [], "response_time": 0.01})

        return _Recorder(self, mcp.streamable_http_app())

    async def _before_answer(self, ctx: McpContext) -> None:
        """Progress gaps, then silence, then raise if the middleware chose ``tool_error``."""
        rc = ctx.request_context
        asked = rc.meta is not None and rc.meta.progressToken is not None
        total = len(self.progress_gaps)
        for i, gap in enumerate(list(self.progress_gaps), start=1):
            await asyncio.sleep(gap)
            if asked:
                self.progress.append(Progress(ctx.request_id, i, total, time.monotonic()))
            await ctx.report_progress(i, total)
        if self.silent > 0:
            await asyncio.sleep(self.silent)
        session_id = rc.request.headers.get("mcp-session-id") if rc.request else None
        key = (session_id, ctx.request_id)
        if key in self._tool_errors:
            self._tool_errors.discard(key)
            raise RuntimeError(FAIL_MESSAGE)

    def _decide_failure(self) -> str | None:
        """For one arriving tools/call: None (answer it) or the fail mode to apply."""
        index, self._tool_calls = self._tool_calls, self._tool_calls + 1
        roll = self._rng.random() if self.fail_rate > 0 else 1.0
        if index >= self.fail_first and roll >= self.fail_rate:
            return None
        self.failures += 1
        return self._rng.choice(FAIL_MODES) if self.fail_mode == "mixed" else self.fail_mode

    # ------------------------------------------------------------------ lifecycle

    async def stop(self) -> None:
        """Take the server down now: stop listening, cut every open connection (in-flight calls
        and GET streams end abruptly), run the app's shutdown. Idempotent; ``serve_fake_mcp``
        can serve the same fake again (pass ``port=`` to come back on the same port)."""
        server, task = self._server, self._task
        self._server = self._task = None
        if server is None or task is None:
            return
        for listener in getattr(server, "servers", []):
            listener.close()
        for conn in list(server.server_state.connections):
            if conn.transport is not None:
                conn.transport.abort()
        server.should_exit = True
        await task


class _Recorder:
    """ASGI middleware: records requests on the endpoint and injects ``tools/call`` failures.
    A POST's body is read here and replayed byte for byte to the app."""

    def __init__(self, fake: FakeMcp, app: ASGIApp) -> None:
        self.fake = fake
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fake = self.fake
        if scope["type"] != "http" or scope["path"].rstrip("/") != fake.path.rstrip("/"):
            await self.app(scope, receive, send)
            return
        method: str = scope["method"]
        headers = Headers(scope=scope)
        if method == "DELETE":
            fake.deletes += 1
        body = b""
        if method == "POST":
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    break
        try:
            rpc = json.loads(body) if body else None
        except ValueError:
            rpc = None
        rpc = rpc if isinstance(rpc, dict) else {}
        fake.requests.append(f"{method} {rpc.get('method') or ''}".strip())
        if rpc.get("method") == "initialize":
            fake.initializes += 1
        if rpc.get("method") == "notifications/cancelled":
            fake.cancelled.append((rpc.get("params") or {}).get("requestId"))

        call: Call | None = None
        if rpc.get("method") == "tools/call":
            params = rpc.get("params") or {}
            call = Call(
                tool=str(params.get("name")),
                arguments=dict(params.get("arguments") or {}),
                request_id=rpc.get("id"),
                session_id=headers.get("mcp-session-id"),
                authorization=headers.get("authorization"),
                at=time.monotonic(),
            )
            fake.calls.append(call)

        async def spy(message: Message) -> None:
            if message["type"] == "http.response.start" and fake.set_cookie is not None:
                cookie = (b"set-cookie", fake.set_cookie.encode())
                message = {**message, "headers": [*message.get("headers", []), cookie]}
            if message["type"] == "http.response.start":
                status: int = message["status"]
                session_id = Headers(raw=message.get("headers", [])).get("mcp-session-id")
                if session_id:
                    fake.session_ids.add(session_id)
                if call is not None:
                    call.status = status
                if method == "GET" and status == 200:
                    fake.gets += 1
            await send(message)

        if fake.api_key is not None and headers.get("authorization") != f"Bearer {fake.api_key}":
            # As Tavily's: the challenge names the server's own OAuth metadata.
            origin = (fake.url or "").removesuffix(fake.path)
            metadata = f"{origin}/.well-known/oauth-protected-resource{fake.path}"
            challenge = f'Bearer resource_metadata="{metadata}"'
            await _send_json(spy, 401, {"error": "unauthorized"}, challenge=challenge)
            return
        if rpc.get("method") == "initialize" and fake.initializes <= fake.fail_initialize:
            await _send_json(spy, 503, {"error": "unavailable", "message": FAIL_MESSAGE})
            return
        if call is not None:
            call.failure = fake._decide_failure()
            if call.failure == "http_503":
                await _send_json(spy, 503, {"error": "unavailable", "message": FAIL_MESSAGE})
                return
            if call.failure == "jsonrpc_error":
                error = {"code": -32603, "message": FAIL_MESSAGE}
                answer = {"jsonrpc": "2.0", "id": call.request_id, "error": error}
                await _send_json(spy, 200, answer, call.session_id)
                return
            if call.failure == "tool_error" and call.request_id is not None:
                fake._tool_errors.add((call.session_id, str(call.request_id)))

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if method == "POST" and not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, spy)


async def _send_json(
    send: Send,
    status: int,
    payload: Any,
    session_id: str | None = None,
    challenge: str | None = None,
) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if session_id:
        headers.append((b"mcp-session-id", session_id.encode()))
    if challenge:
        headers.append((b"www-authenticate", challenge.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers (it runs inside a test's event loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_fake_mcp(
    fake: FakeMcp, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[str]:
    """Serve ``fake`` with uvicorn in the running event loop; yield its endpoint URL
    (``http://<host>:<port><fake.path>``, also in ``fake.url``). ``await fake.stop()`` takes it
    down early; leaving the block stops it if still up."""
    if fake._server is not None:
        raise RuntimeError("this FakeMcp is already being served")
    config = uvicorn.Config(
        fake.make_app(),
        host=host,
        port=port,
        lifespan="on",
        log_config=None,  # leave the process's logging alone
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # so asyncio sets NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))  # here, so a busy port raises OSError (uvicorn would sys.exit)
    except OSError:
        sock.close()
        raise
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    fake._server, fake._task = server, task
    try:
        while not server.started:
            if task.done():
                raise RuntimeError(f"fake MCP server did not start: {task.exception()!r}")
            await asyncio.sleep(0.005)
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        fake.url = f"http://{shown}:{bound}{fake.path}"
        yield fake.url
    finally:
        await fake.stop()
        fake.url = None


# ------------------------------------------------------------------ as a process (benches)


def main(argv: list[str] | None = None) -> None:
    """``python -m testkit.fakemcp [--port 0] [KNOBS]``: serve until SIGTERM or SIGINT, after
    printing the port on the first line of stdout."""
    import argparse
    import signal

    p = argparse.ArgumentParser(prog="python -m testkit.fakemcp", description=main.__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fail-rate", type=float, default=0.0)
    p.add_argument("--fail-mode", choices=(*FAIL_MODES, "mixed"), default="http_503")
    p.add_argument("--empty-over-words", type=int, default=None)
    p.add_argument("--json-response", action="store_true")
    p.add_argument("--silent", type=float, default=0.0, help="seconds each tool call is silent")
    args = p.parse_args(argv)
    fake = FakeMcp(
        seed=args.seed,
        fail_rate=args.fail_rate,
        fail_mode=args.fail_mode,
        empty_over_words=args.empty_over_words,
        json_response=args.json_response,
        silent=args.silent,
    )

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with serve_fake_mcp(fake, args.host, args.port) as url:
            print(url.rsplit(":", 1)[1].split("/", 1)[0], flush=True)
            await stop.wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()

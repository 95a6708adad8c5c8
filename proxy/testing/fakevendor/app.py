"""The fake vendor itself: its state, its record, and the aiohttp application that answers as
the vendor would (the switches a test flips are `modes`, its stream gate `gate`)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json
import socket
import struct
import time
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.testing.fakevendor.faults import Fault, Pause, Received
from proxy.testing.fakevendor.gate import CLOSING, StreamGate
from proxy.testing.fakevendor.mcp import mcp_messages
from proxy.testing.fakevendor.modes import Clock, Modes, RealClock
from proxy.testing.fakevendor.pages import extract_answer
from proxy.testing.fakevendor.serve import FakeVendorServer, ThreadedFakeVendor
from proxy.testing.fakevendor.vendors import (
    BUILDERS,
    COUNT_PARAM,
    drop_results,
    error_payload,
    int_or_none,
    json_or_none,
    make_results,
    params_of,
    query_of,
    route_bare_search,
)

_JSON = "application/json"


class FakeVendor(Modes, StreamGate):
    """State and controls of the fake; ``make_app()`` builds the application serving it.

    ``clock`` gives the time stamped on each request, the time its rate windows slide on and
    the sleeps of latency and hangs; a test's ``ManualClock`` makes those waits instant and
    recorded (``clock.sleeps``). Default: the real monotonic clock.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        results: int = 3,
        stream_chunks: int = 3,
        record: bool = True,
        client_max_size: int = 16 * 1024 * 1024,
        clock: Clock | None = None,
    ) -> None:
        self.seed = seed
        self.clock: Clock = clock or RealClock()
        self.results = results
        self.stream_chunks = stream_chunks
        self.record = record
        self.client_max_size = client_max_size
        self.requests: list[Received] = []
        self.pauses: list[Pause] = []
        self.total = 0
        self.by_vendor: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._clear_gate()
        self._sessions = 0
        self._clear_modes()

    def reset(self) -> None:
        """Forget script, record, modes and stream gate (seeded RNG restarts)."""
        self._clear_modes()
        self.requests.clear()
        self.pauses.clear()
        self.total = 0
        self.by_vendor.clear()
        self._clear_gate()
        self._call_in_loop(self._wake_waiters)

    # ----------------------------------------------------------------- record helpers

    def count(self, path_prefix: str | None = None) -> int:
        """Recorded requests, optionally only those whose path starts with ``path_prefix``."""
        if path_prefix is None:
            return len(self.requests)
        return sum(1 for r in self.requests if r.path.startswith(path_prefix))

    @property
    def last(self) -> Received:
        return self.requests[-1]

    async def wait_for_requests(
        self, n: int, path_prefix: str | None = None, within: float = 2.0
    ) -> None:
        """Wait until ``count(path_prefix) >= n`` (works from any loop or thread)."""
        deadline = time.monotonic() + within
        while self.count(path_prefix) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.count(path_prefix)} of {n} requests after {within}s")
            await asyncio.sleep(0.005)

    # ----------------------------------------------------------------- app

    def make_app(self) -> web.Application:
        """A fresh ``web.Application`` serving this fake (state is shared by all its apps)."""
        app = web.Application(client_max_size=self.client_max_size)
        app[CLOSING] = asyncio.Event()

        async def on_startup(app: web.Application) -> None:
            self._loop = asyncio.get_running_loop()

        async def on_shutdown(app: web.Application) -> None:
            app[CLOSING].set()
            self._wake_waiters()

        app.on_startup.append(on_startup)
        app.on_shutdown.append(on_shutdown)

        r = app.router
        r.add_get("/__fake__/stats", self._stats)
        r.add_post("/__fake__/reset", self._reset_endpoint)

        def search(vendor: str | None) -> Callable[[web.Request], Any]:
            async def handler(request: web.Request) -> web.StreamResponse:
                return await self._search(request, vendor)

            return handler

        # bare paths
        r.add_post("/search", search(None))
        r.add_get("/search", search(None))
        r.add_get("/search.json", search("serpapi"))
        r.add_get("/res/v1/web/search", search("brave"))
        r.add_post("/api/v2/google", search("scavio"))
        r.add_post("/v1/search", search("linkup"))
        r.add_post("/v2/search", search("firecrawl"))
        r.add_post("/", search("jina"))
        # per-vendor prefixes
        r.add_post("/tavily/search", search("tavily"))
        r.add_post("/serper/search", search("serper"))
        r.add_get("/serper/search", search("serper"))
        r.add_post("/exa/search", search("exa"))
        r.add_get("/brave/res/v1/web/search", search("brave"))
        r.add_get("/serpapi/search.json", search("serpapi"))
        r.add_get("/serpapi/search", search("serpapi"))
        r.add_post("/scavio/api/v2/google", search("scavio"))
        r.add_get("/searxng/search", search("searxng"))
        r.add_post("/searxng/search", search("searxng"))
        r.add_post("/linkup/v1/search", search("linkup"))
        r.add_post("/jina/", search("jina"))
        r.add_get("/jina/", search("jina"))
        r.add_get("/jina/{query:.+}", search("jina"))
        r.add_post("/firecrawl/v2/search", search("firecrawl"))
        # extract APIs (pages.py)
        for vendor, paths in (
            ("tavily", ("/extract", "/tavily/extract")),
            ("exa", ("/contents", "/exa/contents")),
            ("firecrawl", ("/v2/scrape", "/firecrawl/v2/scrape")),
            ("jina-reader", ("/jina-reader/",)),
        ):
            for path in paths:
                r.add_post(path, self._extract_handler(vendor))
        # Tavily's usage call (free: what the breaker probes), bare and under its prefix
        r.add_get("/usage", self._usage)
        r.add_get("/tavily/usage", self._usage)
        # utility routes
        r.add_route("*", "/echo", self._echo)
        r.add_route("*", "/echo/{tail:.*}", self._echo)
        r.add_get("/stream", self._stream)
        r.add_get("/sse", self._sse)
        r.add_post("/mcp", self._mcp)
        r.add_get("/mcp", self._mcp_get)
        r.add_delete("/mcp", self._mcp_delete)
        r.add_route("*", "/{tail:.*}", self._not_found)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> FakeVendorServer:
        """Serve on ``host:port`` (0 = any free port) in the running loop."""
        server = FakeVendorServer(self, host, port)
        await server.start()
        return server

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0) -> ThreadedFakeVendor:
        """Serve from a daemon thread with its own loop; ``.stop()`` (or ``with``) ends it."""
        return ThreadedFakeVendor(self, host, port).start()

    # ----------------------------------------------------------------- decisions

    def _record(self, request: web.Request, body: bytes, vendor: str | None) -> Received:
        rec = Received(
            method=request.method,
            path=request.path,
            raw_path=request.raw_path,
            query_string=request.query_string,
            headers=CIMultiDictProxy(CIMultiDict(request.headers)),
            body=body,
            at=self.clock.now(),
            vendor=vendor,
        )
        self.total += 1
        self.by_vendor[vendor or "unknown"] += 1
        if self.record:
            self.requests.append(rec)
        return rec

    async def _pause(self, request: web.Request, cause: str, seconds: float) -> bool:
        """Sleep on the clock; False if the server started shutting down meanwhile."""
        if seconds <= 0:
            return True
        pause = Pause(request.path, cause, seconds)
        if self.record:
            self.pauses.append(pause)
        closing = request.app[CLOSING]
        sleeping = asyncio.ensure_future(self.clock.sleep(seconds))
        shutdown = asyncio.ensure_future(closing.wait())
        try:
            await asyncio.wait((sleeping, shutdown), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pause.ended = "cancelled"
            raise
        finally:
            sleeping.cancel()
            shutdown.cancel()
        pause.ended = "shutdown" if closing.is_set() else "slept"
        return not closing.is_set()

    async def _prelude(
        self, request: web.Request, rec: Received, fault: Fault
    ) -> tuple[web.StreamResponse | None, Fault]:
        """Handle reset, latency, hang and status; else hand back the fault to apply."""
        if fault.kind == "reset":
            return _abort(request), fault
        if not await self._pause(request, "latency", self._latency_now()):
            return _abort(request), fault
        if fault.kind == "hang":
            if not await self._pause(request, "hang", fault.seconds):
                return _abort(request), fault
            fault = Fault.ok()
        if fault.kind == "status":
            status, payload, headers = self._error(rec, fault)
            return self._respond(request, rec, fault, status, payload, headers), fault
        return None, fault

    def _error(self, rec: Received, fault: Fault) -> tuple[int, Any, dict[str, str]]:
        headers = dict(fault.headers or {})
        if fault.body is not None:
            return fault.code, fault.body, headers
        return fault.code, error_payload(rec.vendor, fault.code, fault.error_code), headers

    def _respond(
        self,
        request: web.Request,
        rec: Received,
        fault: Fault,
        status: int,
        payload: Any,
        headers: dict[str, str],
    ) -> web.Response:
        headers = dict(headers)
        if isinstance(payload, bytes):
            body = payload
            headers.setdefault("Content-Type", "application/octet-stream")
        elif isinstance(payload, str):
            body = payload.encode()
            headers.setdefault("Content-Type", "text/plain; charset=utf-8")
        else:
            body = json.dumps(payload, ensure_ascii=False).encode()
            headers.setdefault("Content-Type", _JSON)
        if rec.vendor == "brave" and self._brave is not None:
            if status == 200:
                self._brave_month_used += 1
            headers.update(self._brave_headers())
        if fault.kind == "malformed":
            body = body[: max(1, len(body) // 2)]
        accepts = "gzip" in request.headers.get("Accept-Encoding", "")
        if fault.kind == "gzip" or (self._gzip_accepted and accepts):
            body = gzip.compress(body)
            headers["Content-Encoding"] = "gzip"
        return web.Response(status=status, body=body, headers=headers)

    def _brave_headers(self) -> dict[str, str]:
        assert self._brave is not None
        per_second, per_month, month_reset = self._brave
        now = self.clock.now()
        used = sum(1 for t in self._brave_window if t > now - 1.0)
        return {
            "X-RateLimit-Limit": f"{per_second}, {per_month}",
            "X-RateLimit-Policy": f"{per_second};w=1, {per_month};w={month_reset}",
            "X-RateLimit-Remaining": (
                f"{max(0, per_second - used)}, {max(0, per_month - self._brave_month_used)}"
            ),
            "X-RateLimit-Reset": f"1, {month_reset}",
        }

    # ----------------------------------------------------------------- handlers

    async def _search(self, request: web.Request, vendor: str | None) -> web.StreamResponse:
        body = await request.read()
        if vendor is None:
            vendor = route_bare_search(request, body)
        rec = self._record(request, body, vendor)
        resp, fault = await self._prelude(request, rec, self._decide(rec))
        if resp is not None:
            return resp
        mode = fault.kind if fault.kind in ("empty", "missing_results") else "ok"
        status, payload, headers = self._vendor_answer(rec, mode)
        return self._respond(request, rec, fault, status, payload, headers)

    def _vendor_answer(self, rec: Received, mode: str) -> tuple[int, Any, dict[str, str]]:
        vendor = rec.vendor or "tavily"
        if vendor == "serper":
            batch = json_or_none(rec.body)
            if isinstance(batch, list):
                answers = [self._serper_one(q, mode) for q in batch if isinstance(q, dict)]
                return 200, answers, {}
        params = params_of(rec)
        query = query_of(rec, params)
        if query is None or not query.strip():
            code = 422 if vendor == "brave" else 400
            return code, error_payload(vendor, code, None, "query is missing"), {}
        count = int_or_none(params.get(COUNT_PARAM.get(vendor, ""), None))
        n = self.results if count is None else max(0, min(count, self.results))
        if mode == "empty":
            n = 0
        results = make_results(query, n)
        if vendor == "serper":
            return 200, self._serper_one(params, mode), {}
        status, payload = BUILDERS[vendor](query, results, params, rec)
        if mode == "missing_results" and status == 200:
            drop_results(vendor, payload)
        if isinstance(payload, str):  # SearXNG without format=json answers HTML
            return status, payload, {"Content-Type": "text/html; charset=utf-8"}
        return status, payload, {}

    def _extract_handler(self, vendor: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            rec = self._record(request, body, vendor)
            resp, fault = await self._prelude(request, rec, self._decide(rec))
            if resp is not None:
                return resp
            status, payload = extract_answer(vendor, json_or_none(body), self._failing_pages)
            return self._respond(request, rec, fault, status, payload, {})

        return handler

    def _serper_one(self, params: dict[str, Any], mode: str) -> dict[str, Any]:
        query = str(params.get("q", ""))
        count = int_or_none(params.get("num"))
        n = self.results if count is None else max(0, min(count, self.results))
        results = [] if mode == "empty" else make_results(query, n)
        payload: dict[str, Any] = {
            "searchParameters": {
                "q": query,
                "type": "search",
                "num": count or 10,
                "engine": "google",
            },
            "organic": [
                {"title": r.title, "link": r.url, "snippet": r.snippet, "position": r.position}
                for r in results
            ],
            "credits": 1,
        }
        if mode == "missing_results":
            del payload["organic"]
        return payload

    async def _usage(self, request: web.Request) -> web.StreamResponse:
        """Tavily's GET /usage: the key's and account's usage. It goes through the same faults
        as searches (down, a 429 storm, hangs), as one API's endpoints fail together."""
        rec = self._record(request, await request.read(), "usage")
        # Scripted faults are for searches: a probe must not take one a test queued.
        resp, fault = await self._prelude(request, rec, self._decide(rec, scripted=False))
        if resp is not None:
            return resp
        searches = self.by_vendor["tavily"]
        payload = {
            "key": {"usage": searches, "limit": 1000},
            "account": {"current_plan": "Researcher", "plan_usage": searches, "plan_limit": 1000},
        }
        return self._respond(request, rec, fault, 200, payload, {})

    async def _echo(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        rec = self._record(request, body, "echo")
        resp, fault = await self._prelude(request, rec, self._decide(rec))
        if resp is not None:
            return resp
        try:
            text: str | None = body.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        payload = {
            "method": rec.method,
            "path": rec.path,
            "raw_path": rec.raw_path,
            "query_string": rec.query_string,
            "query": [[k, v] for k, v in rec.query.items()],
            "headers": {k: ", ".join(rec.headers.getall(k)) for k in rec.headers},
            "header_list": [[k, v] for k, v in rec.headers.items()],
            "body": text,
            "body_b64": base64.b64encode(body).decode(),
        }
        return self._respond(request, rec, fault, 200, payload, {})

    async def _stream_out(
        self,
        request: web.Request,
        rec: Received,
        fault: Fault,
        pieces: list[bytes],
        headers: dict[str, str],
        status: int = 200,
        pause: float = 0.0,
    ) -> web.StreamResponse:
        """Write ``pieces`` one by one through the gate, flushing each (`pause` seconds
        apart, so each reaches the reader in a read of its own)."""
        compressor = zlib.compressobj(wbits=31) if fault.kind == "gzip" else None
        if compressor is not None:
            headers = headers | {"Content-Encoding": "gzip"}
        resp = web.StreamResponse(status=status, headers=headers)
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i, piece in enumerate(pieces):
            if pause and i:
                await asyncio.sleep(pause)
            if not await self._gate(request.app):
                _abort(request)
                return resp
            if compressor is not None:
                piece = compressor.compress(piece) + compressor.flush(zlib.Z_SYNC_FLUSH)
            await resp.write(piece)
            self.chunks_sent += 1
            if fault.kind == "malformed" and i == 0 and len(pieces) > 1:
                _abort(request)
                return resp
        if compressor is not None:
            await resp.write(compressor.flush())
        await resp.write_eof()
        return resp

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        rec = self._record(request, await request.read(), "stream")
        resp, fault = await self._prelude(request, rec, self._decide(rec))
        if resp is not None:
            return resp
        n = int_or_none(request.query.get("chunks")) or self.stream_chunks
        size = int_or_none(request.query.get("size")) or 0
        pieces = []
        for i in range(n):
            piece = f"chunk-{i}\n".encode()
            if size > len(piece):
                piece = piece[:-1] + b"." * (size - len(piece)) + b"\n"
            pieces.append(piece)
        echoed = request.query.get("echo")
        if echoed:  # a vendor echoing what it was sent (its key) in every chunk
            said = request.headers.get(echoed, "").encode()
            pieces = [piece[:-1] + b" " + said + b"\n" for piece in pieces]
            if request.query.get("split"):  # each echo cut in two chunks, written apart
                cut = len(said) // 2 + 2  # past the chunk's last byte before it, the space
                pieces = [part for p in pieces for part in (p[:-cut], p[-cut:])]
        pause = (int_or_none(request.query.get("pause_ms")) or 0) / 1000
        headers = {"Content-Type": "application/octet-stream"}
        return await self._stream_out(request, rec, fault, pieces, headers, pause=pause)

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        rec = self._record(request, await request.read(), "sse")
        resp, fault = await self._prelude(request, rec, self._decide(rec))
        if resp is not None:
            return resp
        n = int_or_none(request.query.get("events")) or self.stream_chunks
        events = [json.dumps({"i": i, "text": f"event {i}"}) for i in range(n)]
        pieces = [f"id: {i}\nevent: message\ndata: {e}\n\n".encode() for i, e in enumerate(events)]
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        return await self._stream_out(request, rec, fault, pieces, headers)

    async def _mcp(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        rec = self._record(request, body, "mcp")
        resp, fault = await self._prelude(request, rec, self._decide(rec))
        if resp is not None:
            return resp
        msg = json_or_none(body)
        if msg is None:
            error = {"code": -32700, "message": "Parse error"}
            payload = {"jsonrpc": "2.0", "id": None, "error": error}
            return self._respond(request, rec, fault, 400, payload, {})
        if not isinstance(msg, dict) or "method" not in msg or "id" not in msg:
            return web.Response(status=202)  # notification or response: accepted, no body
        headers: dict[str, str] = {}
        if msg["method"] == "initialize":
            self._sessions += 1
            headers["Mcp-Session-Id"] = f"fake-session-{self._sessions}"
        messages = mcp_messages(msg, self.results)
        accept = request.headers.get("Accept", "")
        if "text/event-stream" not in accept and "application/json" in accept:
            return self._respond(request, rec, fault, 200, messages[-1], headers)
        pieces = [
            f"id: {i}\nevent: message\ndata: {json.dumps(m)}\n\n".encode()
            for i, m in enumerate(messages)
        ]
        headers |= {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        return await self._stream_out(request, rec, fault, pieces, headers)

    async def _mcp_get(self, request: web.Request) -> web.StreamResponse:
        self._record(request, await request.read(), "mcp")
        return web.Response(status=405, headers={"Allow": "POST, DELETE"})

    async def _mcp_delete(self, request: web.Request) -> web.StreamResponse:
        self._record(request, await request.read(), "mcp")
        return web.Response(status=200)

    async def _not_found(self, request: web.Request) -> web.StreamResponse:
        self._record(request, await request.read(), None)
        return web.json_response({"error": "not found", "path": request.path}, status=404)

    async def _stats(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "total": self.total,
                "by_vendor": dict(self.by_vendor),
                "chunks_sent": self.chunks_sent,
                "pending_script": self.pending,
            }
        )

    async def _reset_endpoint(self, request: web.Request) -> web.StreamResponse:
        self.reset()
        return web.json_response({"reset": True})


# --------------------------------------------------------------------------- helpers


def _abort(request: web.Request) -> web.Response:
    """Close the connection with a RST; the returned response is never delivered."""
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    return web.Response(status=500)

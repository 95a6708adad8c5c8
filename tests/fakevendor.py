"""A fake web-search vendor: one real aiohttp application that stands in for every vendor.

Tests start it on loopback (``aiohttp_server(vendor.make_app())``, ``await vendor.start()``,
``vendor.start_in_thread()``) or as a separate process (``python -m tests.fakevendor --port 0``,
or ``FakeVendorProcess``), point the proxy's routes at it and assert on what it received.

Routes (every vendor is served under ``/<vendor>/...`` and, where paths do not clash, bare):

=========  ===================================================  ==============================
vendor     prefixed path (bare path)                            results
=========  ===================================================  ==============================
tavily     POST /tavily/search  (POST /search, see below)       results[] url/title/content
serper     POST|GET /serper/search  (POST /search)              organic[] title/link/snippet
exa        POST /exa/search  (POST /search with x-api-key)      results[] url/title/text
brave      GET /brave/res/v1/web/search  (/res/v1/web/search)   web.results[] title/url/desc.
serpapi    GET /serpapi/search.json, /serpapi/search            organic_results[] link/title
           (GET /search.json; GET /search with engine/api_key)
scavio     POST /scavio/api/v2/google  (POST /api/v2/google)    organic_results[]
searxng    GET|POST /searxng/search  (GET /search otherwise)    results[] url/title/content
linkup     POST /linkup/v1/search  (POST /v1/search)            results[] url/name/content
jina       POST|GET /jina/, GET /jina/<query>  (POST /)         data[] url/title/description
firecrawl  POST /firecrawl/v2/search  (POST /v2/search)         data.web[] url/title/desc.
=========  ===================================================  ==============================

Bare ``/search`` is decided by what the request carries, first match wins:

1. GET: ``engine`` or ``api_key`` in the query string -> serpapi; ``apiKey`` -> serper;
   otherwise searxng.
2. POST with a form body (``application/x-www-form-urlencoded``) -> searxng.
3. POST with ``q`` in the query string, or a JSON body that has a ``q`` key or is a list
   (Serper batch) -> serper.
4. POST with an ``X-API-KEY`` header: JSON body with a ``query`` key -> exa, else -> serper
   (Exa and Serper both use that header; only Exa sends ``query``).
5. Anything else -> tavily (``query`` in the body, ``Authorization: Bearer`` or ``api_key``).

Other routes: ``/echo`` and ``/echo/...`` (any method) answer JSON describing the request;
``GET /stream`` (chunked octet-stream), ``GET /sse`` (text/event-stream), ``POST /mcp`` (MCP
streamable HTTP, JSON-RPC answered as SSE); ``GET /__fake__/stats`` and ``POST /__fake__/reset``
(control, never recorded nor faulted). Unknown paths get 404 and are recorded.

Results are deterministic: ``make_results(query, n)`` gives url ``https://example.com/<slug>/<i>``
for i = 1..n (n = ``FakeVendor(results=3)`` unless the request asks for fewer).

Each request is recorded (``vendor.requests``), then answered by the first matching scripted
fault (FIFO, ``vendor.script(...)``), else by the probabilistic modes in this order: ``down``,
``rate_limit``, Brave quota, ``fail_ratio``, ``hang_ratio``, ``malformed_ratio``,
``empty_when_words_over``; else by the default fault (``Fault.ok()`` unless ``set_default``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gzip
import json
import math
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy, MultiDict, MultiDictProxy

__all__ = [
    "VENDORS",
    "FakeResult",
    "FakeVendor",
    "FakeVendorProcess",
    "FakeVendorServer",
    "Fault",
    "Received",
    "ThreadedFakeVendor",
    "expected_urls",
    "make_results",
    "slugify",
]

VENDORS: tuple[str, ...] = (
    "tavily",
    "serper",
    "exa",
    "brave",
    "serpapi",
    "scavio",
    "searxng",
    "linkup",
    "jina",
    "firecrawl",
)

_CLOSING: web.AppKey[asyncio.Event] = web.AppKey("fakevendor_closing", asyncio.Event)
_JSON = "application/json"


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class FakeResult:
    """One deterministic search result."""

    url: str
    title: str
    snippet: str
    score: float
    position: int


def slugify(query: str) -> str:
    """Lower-case, non-alphanumerics collapsed to '-'; 'q' when nothing is left."""
    slug = re.sub(r"[^a-z0-9]+", "-", query.lower()).strip("-")
    return slug or "q"


def make_results(query: str, n: int = 3) -> list[FakeResult]:
    """The results every vendor shape is built from: url https://example.com/<slug>/<i>."""
    slug = slugify(query)
    return [
        FakeResult(
            url=f"https://example.com/{slug}/{i}",
            title=f"Result {i} for {query}",
            snippet=f"Snippet {i} about {query}.",
            score=round(max(0.05, 1.0 - 0.1 * i), 2),
            position=i,
        )
        for i in range(1, n + 1)
    ]


def expected_urls(query: str, n: int = 3) -> list[str]:
    """The urls a normal answer for ``query`` carries, in order."""
    return [r.url for r in make_results(query, n)]


# --------------------------------------------------------------------------- faults


@dataclass(frozen=True)
class Fault:
    """How to answer one request. Build with the class methods, not the constructor."""

    kind: str
    code: int = 200
    body: Any = None
    headers: Mapping[str, str] | None = None
    seconds: float = 0.0
    error_code: str | None = None

    @classmethod
    def ok(cls) -> Fault:
        """The normal answer (useful as a placeholder inside a script)."""
        return cls("ok")

    @classmethod
    def status(
        cls,
        code: int,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        *,
        error_code: str | None = None,
        retry_after: float | None = None,
    ) -> Fault:
        """Answer ``code``. ``body``: dict/list (JSON), str or bytes; None gives the vendor's
        own error shape (``error_code`` overrides the vendor's code word, e.g. Linkup
        ``INSUFFICIENT_FUNDS_CREDITS``). ``retry_after`` adds a Retry-After header."""
        hdrs = dict(headers or {})
        if retry_after is not None:
            hdrs.setdefault("Retry-After", _fmt_seconds(retry_after))
        return cls("status", code=code, body=body, headers=hdrs or None, error_code=error_code)

    @classmethod
    def hang(cls, seconds: float) -> Fault:
        """Sleep ``seconds`` then answer normally. Cancelled if the client leaves; on server
        shutdown the connection is closed at once."""
        return cls("hang", seconds=seconds)

    @classmethod
    def malformed(cls) -> Fault:
        """200 with the normal JSON cut in half (streams: cut after the first chunk)."""
        return cls("malformed")

    @classmethod
    def empty(cls) -> Fault:
        """The vendor's own empty answer (Brave: no ``web``; SerpAPI: 200 + ``error``;
        Linkup: 400 SEARCH_QUERY_NO_RESULT). Non-search routes answer normally."""
        return cls("empty")

    @classmethod
    def reset(cls) -> Fault:
        """Close the connection (RST) without any answer."""
        return cls("reset")

    @classmethod
    def gzip(cls) -> Fault:
        """The normal answer, gzip-compressed, with ``Content-Encoding: gzip``."""
        return cls("gzip")

    @classmethod
    def missing_results(cls) -> Fault:
        """200 valid JSON without the vendor's result list."""
        return cls("missing_results")


def _fmt_seconds(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else str(seconds)


# --------------------------------------------------------------------------- record


@dataclass(frozen=True)
class Received:
    """One request as the fake received it."""

    method: str
    path: str
    raw_path: str
    query_string: str
    headers: CIMultiDictProxy[str]
    body: bytes
    at: float
    vendor: str | None = None  # vendor name, or "echo", "stream", "sse", "mcp"; None for 404

    @property
    def query(self) -> MultiDictProxy[str]:
        """The query string parsed (repeated keys kept)."""
        return MultiDictProxy(MultiDict(parse_qsl(self.query_string, keep_blank_values=True)))

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body parsed as JSON (raises ValueError if it is not)."""
        return json.loads(self.body)


# --------------------------------------------------------------------------- the fake


class FakeVendor:
    """State and controls of the fake; ``make_app()`` builds the application serving it."""

    def __init__(
        self,
        *,
        seed: int = 0,
        results: int = 3,
        stream_chunks: int = 3,
        record: bool = True,
        client_max_size: int = 16 * 1024 * 1024,
    ) -> None:
        self.seed = seed
        self.results = results
        self.stream_chunks = stream_chunks
        self.record = record
        self.client_max_size = client_max_size
        self.requests: list[Received] = []
        self.total = 0
        self.by_vendor: Counter[str] = Counter()
        self.chunks_sent = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._permits = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._gated = False
        self._sessions = 0
        self._clear_modes()

    # ----------------------------------------------------------------- script / modes

    def _clear_modes(self) -> None:
        self._script: deque[tuple[Fault, str | None]] = deque()
        self._default = Fault.ok()
        self._rng = random.Random(self.seed)
        self._fail: tuple[float, Fault] | None = None
        self._hang_ratio: tuple[float, float] | None = None
        self._malformed_ratio = 0.0
        self._empty_words: int | None = None
        self._down: Fault | None = None
        self._rate: int | None = None
        self._rate_window: deque[float] = deque()
        self._latency = (0.0, 0.0)
        self._gzip_accepted = False
        self._brave: tuple[int, int, int] | None = None
        self._brave_window: deque[float] = deque()
        self._brave_month_used = 0

    def script(self, *faults: Fault, path_prefix: str | None = None) -> FakeVendor:
        """Queue faults for the next requests (FIFO). With ``path_prefix`` a fault is only
        taken by a request whose path starts with it; other requests skip over it."""
        for f in faults:
            self._script.append((f, path_prefix))
        return self

    @property
    def pending(self) -> int:
        """Scripted faults not yet used."""
        return len(self._script)

    def set_default(self, fault: Fault) -> FakeVendor:
        """What to answer when neither script nor a mode decides (initially ``Fault.ok()``)."""
        self._default = fault
        return self

    def fail_ratio(
        self,
        ratio: float,
        status: int = 503,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> FakeVendor:
        """Answer ``status`` to a seeded-random ``ratio`` of requests."""
        self._fail = (ratio, Fault.status(status, body, headers)) if ratio > 0 else None
        return self

    def hang_ratio(self, ratio: float, seconds: float = 20.0) -> FakeVendor:
        """Hang ``seconds`` on a seeded-random ``ratio`` of requests."""
        self._hang_ratio = (ratio, seconds) if ratio > 0 else None
        return self

    def malformed_ratio(self, ratio: float) -> FakeVendor:
        """Truncated JSON on a seeded-random ``ratio`` of requests."""
        self._malformed_ratio = ratio
        return self

    def empty_when_words_over(self, words: int | None) -> FakeVendor:
        """Vendor-correct empty answer for queries of more than ``words`` words."""
        self._empty_words = words
        return self

    def down(self, status: int = 503) -> FakeVendor:
        """Every request gets ``status`` until ``up()``."""
        self._down = Fault.status(status)
        return self

    def up(self) -> FakeVendor:
        self._down = None
        return self

    def rate_limit(self, per_second: int | None) -> FakeVendor:
        """Sliding 1 s window over admitted requests; beyond ``per_second`` answer 429 with
        Retry-After. ``None`` switches it off."""
        self._rate = per_second
        self._rate_window.clear()
        return self

    def latency(self, seconds: float, jitter: float = 0.0) -> FakeVendor:
        """Delay every answer by ``seconds`` +- a seeded-random ``jitter``."""
        self._latency = (seconds, jitter)
        return self

    def gzip_when_accepted(self, enabled: bool = True) -> FakeVendor:
        """gzip JSON answers whenever the request's Accept-Encoding allows it."""
        self._gzip_accepted = enabled
        return self

    def brave_rate_limits(
        self, per_second: int = 1, per_month: int = 2000, month_reset: int = 1_000_000
    ) -> FakeVendor:
        """Brave answers carry X-RateLimit-Limit/-Policy/-Remaining/-Reset ("<second>, <month>")
        and 429 RATE_LIMITED once either window is exhausted (only 200s use the month)."""
        self._brave = (per_second, per_month, month_reset)
        self._brave_window.clear()
        self._brave_month_used = 0
        return self

    def reset(self) -> None:
        """Forget script, record, modes and stream gate (seeded RNG restarts)."""
        self._clear_modes()
        self.requests.clear()
        self.total = 0
        self.by_vendor.clear()
        self.chunks_sent = 0
        self._permits = 0
        self._gated = False
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

    # ----------------------------------------------------------------- stream gate

    def gate_streams(self, enabled: bool = True) -> FakeVendor:
        """When gated, /stream, /sse and /mcp send each chunk/event only after a
        ``release_chunk()``. Permits are shared by all open streams, first come first served."""
        self._gated = enabled
        if not enabled:
            self._call_in_loop(self._wake_waiters)
        return self

    def release_chunk(self, n: int = 1) -> None:
        """Let ``n`` more chunks/events out (thread-safe)."""
        self._call_in_loop(self._release, n)

    async def wait_chunks_sent(self, n: int, within: float = 2.0) -> None:
        """Wait until ``chunks_sent >= n``."""
        deadline = time.monotonic() + within
        while self.chunks_sent < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.chunks_sent} of {n} chunks after {within}s")
            await asyncio.sleep(0.005)

    def _call_in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is not None and loop is not running and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)
        else:
            fn(*args)

    def _release(self, n: int) -> None:
        self._permits += n
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _gate(self, app: web.Application) -> bool:
        """Wait for a permit; False when the server is shutting down."""
        closing = app[_CLOSING]
        while self._gated and self._permits <= 0 and not closing.is_set():
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
        if closing.is_set():
            return False
        if self._gated:
            self._permits -= 1
        return True

    # ----------------------------------------------------------------- app

    def make_app(self) -> web.Application:
        """A fresh ``web.Application`` serving this fake (state is shared by all its apps)."""
        app = web.Application(client_max_size=self.client_max_size)
        app[_CLOSING] = asyncio.Event()

        async def on_startup(app: web.Application) -> None:
            self._loop = asyncio.get_running_loop()

        async def on_shutdown(app: web.Application) -> None:
            app[_CLOSING].set()
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
            at=time.monotonic(),
            vendor=vendor,
        )
        self.total += 1
        self.by_vendor[vendor or "unknown"] += 1
        if self.record:
            self.requests.append(rec)
        return rec

    def _take_scripted(self, path: str) -> Fault | None:
        for i, (fault, prefix) in enumerate(self._script):
            if prefix is None or path.startswith(prefix):
                del self._script[i]
                return fault
        return None

    def _decide(self, rec: Received) -> Fault:
        scripted = self._take_scripted(rec.path)
        if scripted is not None:
            return scripted
        if self._down is not None:
            return self._down
        now = time.monotonic()
        if self._rate is not None:
            window = self._rate_window
            while window and window[0] <= now - 1.0:
                window.popleft()
            if len(window) >= self._rate:
                wait = max(1, math.ceil(window[0] + 1.0 - now))
                return Fault.status(
                    429,
                    headers={"X-RateLimit-Limit": str(self._rate), "X-RateLimit-Remaining": "0"},
                    retry_after=wait,
                )
            window.append(now)
        if rec.vendor == "brave" and self._brave is not None:
            per_second, per_month, _ = self._brave
            window = self._brave_window
            while window and window[0] <= now - 1.0:
                window.popleft()
            if len(window) >= per_second or self._brave_month_used >= per_month:
                return Fault.status(429, retry_after=1)
            window.append(now)
        if self._fail is not None and self._rng.random() < self._fail[0]:
            return self._fail[1]
        if self._hang_ratio is not None and self._rng.random() < self._hang_ratio[0]:
            return Fault.hang(self._hang_ratio[1])
        if self._malformed_ratio > 0 and self._rng.random() < self._malformed_ratio:
            return Fault.malformed()
        if self._empty_words is not None and rec.vendor in VENDORS:
            query = _query_of(rec)
            if query is not None and len(query.split()) > self._empty_words:
                return Fault.empty()
        return self._default

    async def _pause(self, app: web.Application, seconds: float) -> bool:
        """Sleep; False if the server started shutting down meanwhile."""
        if seconds <= 0:
            return True
        try:
            await asyncio.wait_for(app[_CLOSING].wait(), seconds)
        except TimeoutError:
            return True
        return False

    def _latency_now(self) -> float:
        base, jitter = self._latency
        if jitter:
            base += self._rng.uniform(-jitter, jitter)
        return max(0.0, base)

    async def _prelude(
        self, request: web.Request, rec: Received, fault: Fault
    ) -> tuple[web.StreamResponse | None, Fault]:
        """Handle reset, latency, hang and status; else hand back the fault to apply."""
        if fault.kind == "reset":
            return _abort(request), fault
        if not await self._pause(request.app, self._latency_now()):
            return _abort(request), fault
        if fault.kind == "hang":
            if not await self._pause(request.app, fault.seconds):
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
        return fault.code, _error_payload(rec.vendor, fault.code, fault.error_code), headers

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
        now = time.monotonic()
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
            vendor = _route_bare_search(request, body)
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
            batch = _json_or_none(rec.body)
            if isinstance(batch, list):
                answers = [self._serper_one(q, mode) for q in batch if isinstance(q, dict)]
                return 200, answers, {}
        params = _params(rec)
        query = _query_of(rec, params)
        if query is None or not query.strip():
            code = 422 if vendor == "brave" else 400
            return code, _error_payload(vendor, code, None, "query is missing"), {}
        count = _int_or_none(params.get(_COUNT_PARAM.get(vendor, ""), None))
        n = self.results if count is None else max(0, min(count, self.results))
        if mode == "empty":
            n = 0
        results = make_results(query, n)
        if vendor == "serper":
            return 200, self._serper_one(params, mode), {}
        status, payload = _BUILDERS[vendor](query, results, params, rec)
        if mode == "missing_results" and status == 200:
            _drop_results(vendor, payload)
        if isinstance(payload, str):  # SearXNG without format=json answers HTML
            return status, payload, {"Content-Type": "text/html; charset=utf-8"}
        return status, payload, {}

    def _serper_one(self, params: dict[str, Any], mode: str) -> dict[str, Any]:
        query = str(params.get("q", ""))
        count = _int_or_none(params.get("num"))
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
    ) -> web.StreamResponse:
        """Write ``pieces`` one by one through the gate, flushing each."""
        compressor = zlib.compressobj(wbits=31) if fault.kind == "gzip" else None
        if compressor is not None:
            headers = headers | {"Content-Encoding": "gzip"}
        resp = web.StreamResponse(status=status, headers=headers)
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i, piece in enumerate(pieces):
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
        n = _int_or_none(request.query.get("chunks")) or self.stream_chunks
        size = _int_or_none(request.query.get("size")) or 0
        pieces = []
        for i in range(n):
            piece = f"chunk-{i}\n".encode()
            if size > len(piece):
                piece = piece[:-1] + b"." * (size - len(piece)) + b"\n"
            pieces.append(piece)
        headers = {"Content-Type": "application/octet-stream"}
        return await self._stream_out(request, rec, fault, pieces, headers)

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        rec = self._record(request, await request.read(), "sse")
        resp, fault = await self._prelude(request, rec, self._decide(rec))
        if resp is not None:
            return resp
        n = _int_or_none(request.query.get("events")) or self.stream_chunks
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
        msg = _json_or_none(body)
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
        messages = _mcp_messages(msg, self)
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


# --------------------------------------------------------------------------- vendor shapes

_COUNT_PARAM = {
    "tavily": "max_results",
    "serper": "num",
    "exa": "numResults",
    "brave": "count",
    "serpapi": "num",
    "scavio": "num_results",
    "searxng": "",
    "linkup": "maxResults",
    "jina": "num",
    "firecrawl": "limit",
}

_QUERY_PARAM = {"tavily": "query", "exa": "query", "scavio": "query", "firecrawl": "query"}

# where the result list lives, for missing_results()
_RESULTS_PATH = {
    "tavily": ("results",),
    "exa": ("results",),
    "brave": ("web",),
    "serpapi": ("organic_results",),
    "scavio": ("organic_results",),
    "searxng": ("results",),
    "linkup": ("results",),
    "jina": ("data",),
    "firecrawl": ("data", "web"),
}


def _tavily(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    return 200, {
        "query": q,
        "follow_up_questions": None,
        "answer": None,
        "images": [],
        "results": [
            {
                "url": r.url,
                "title": r.title,
                "content": r.snippet,
                "score": r.score,
                "raw_content": None,
            }
            for r in res
        ],
        "response_time": 0.01,
    }


def _exa(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    return 200, {
        "requestId": f"fake-{slugify(q)}",
        "resolvedSearchType": "neural",
        "results": [
            {
                "id": r.url,
                "url": r.url,
                "title": r.title,
                "text": r.snippet,
                "score": r.score,
                "publishedDate": None,
                "author": None,
            }
            for r in res
        ],
        "costDollars": {"total": 0.005},
    }


def _brave(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    payload: dict[str, Any] = {
        "type": "search",
        "query": {"original": q, "more_results_available": False},
    }
    if res:
        payload["web"] = {
            "type": "search",
            "results": [
                {
                    "title": r.title,
                    "url": r.url,
                    "description": r.snippet,
                    "type": "search_result",
                    "language": "en",
                    "family_friendly": True,
                }
                for r in res
            ],
            "family_friendly": True,
        }
    return 200, payload


def _serpapi(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    engine = str(p.get("engine", "google"))
    base = f"https://serpapi.com/search.json?engine={engine}&q={quote(q)}"
    payload: dict[str, Any] = {
        "search_metadata": {
            "id": f"fake-{slugify(q)}",
            "status": "Success",
            "json_endpoint": f"https://serpapi.com/searches/fake-{slugify(q)}.json",
        },
        "search_parameters": {"engine": engine, "q": q},
    }
    if not res:
        payload["search_information"] = {"organic_results_state": "Fully empty"}
        payload["error"] = "Google hasn't returned any results for this query."
        return 200, payload
    payload["search_information"] = {
        "organic_results_state": "Results for exact spelling",
        "total_results": len(res),
    }
    payload["organic_results"] = [
        {
            "position": r.position,
            "title": r.title,
            "link": r.url,
            "displayed_link": r.url.removeprefix("https://"),
            "snippet": r.snippet,
        }
        for r in res
    ]
    payload["serpapi_pagination"] = {"current": 1, "next": f"{base}&start=10"}
    return 200, payload


def _scavio(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    return 200, {
        "query": q,
        "organic_results": [
            {"position": r.position, "title": r.title, "link": r.url, "snippet": r.snippet}
            for r in res
        ],
        "credits_used": 1,
    }


def _searxng(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    if p.get("format") != "json":
        items = "".join(f'<article><a href="{r.url}">{r.title}</a></article>' for r in res)
        return 200, f"<!DOCTYPE html><html><body>{items}</body></html>"
    return 200, {
        "query": q,
        "number_of_results": len(res),
        "results": [
            {
                "url": r.url,
                "title": r.title,
                "content": r.snippet,
                "engine": "fake",
                "engines": ["fake"],
                "score": r.score,
                "category": "general",
            }
            for r in res
        ],
        "answers": [],
        "corrections": [],
        "infoboxes": [],
        "suggestions": [],
        "unresponsive_engines": [],
    }


LINKUP_FAVICON = "https://example.com/favicon.ico"


def _linkup(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    if not res:
        return 400, {
            "statusCode": 400,
            "error": {
                "code": "SEARCH_QUERY_NO_RESULT",
                "message": "The query did not yield any result",
                "details": [],
            },
        }
    if p.get("outputType") == "sourcedAnswer":
        return 200, {
            "answer": f"Fake answer about {q}.",
            "sources": [
                {"name": r.title, "url": r.url, "snippet": r.snippet, "favicon": LINKUP_FAVICON}
                for r in res
            ],
        }
    return 200, {
        "results": [
            {
                "type": "text",
                "name": r.title,
                "url": r.url,
                "content": r.snippet,
                "favicon": LINKUP_FAVICON,  # linkup-sdk requires it
            }
            for r in res
        ]
    }


def _jina(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    return 200, {
        "code": 200,
        "status": 20000,
        "data": [
            {
                "title": r.title,
                "url": r.url,
                "description": r.snippet,
                "content": r.snippet,
                "usage": {"tokens": 10},
            }
            for r in res
        ],
        "meta": {"usage": {"tokens": 10 * len(res)}},
    }


def _firecrawl(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    return 200, {
        "success": True,
        "data": {
            "web": [
                {
                    "url": r.url,
                    "title": r.title,
                    "description": r.snippet,
                    "position": r.position,
                }
                for r in res
            ]
        },
        "creditsUsed": 1,
    }


_BUILDERS: dict[str, Callable[[str, list[FakeResult], dict[str, Any], Received], tuple[int, Any]]]
_BUILDERS = {
    "tavily": _tavily,
    "exa": _exa,
    "brave": _brave,
    "serpapi": _serpapi,
    "scavio": _scavio,
    "searxng": _searxng,
    "linkup": _linkup,
    "jina": _jina,
    "firecrawl": _firecrawl,
}


def _drop_results(vendor: str, payload: Any) -> None:
    path = _RESULTS_PATH.get(vendor)
    if not path or not isinstance(payload, dict):
        return
    target = payload
    for key in path[:-1]:
        target = target.get(key, {})
    if isinstance(target, dict):
        target.pop(path[-1], None)


_BRAVE_CODES = {
    400: "VALIDATION",
    401: "SUBSCRIPTION_TOKEN_INVALID",
    403: "OPTION_NOT_IN_PLAN",
    422: "SUBSCRIPTION_TOKEN_INVALID",
    429: "RATE_LIMITED",
}
_LINKUP_CODES = {
    400: "BAD_REQUEST",
    401: "UNAUTHORIZED",
    403: "FORBIDDEN",
    429: "TOO_MANY_REQUESTS",
}
_SCAVIO_CODES = {
    400: "bad_request",
    401: "unauthorized",
    402: "insufficient_credits",
    429: "rate_limited",
}
_EXA_TAGS = {401: "INVALID_API_KEY", 402: "NO_MORE_CREDITS", 429: "RATE_LIMIT_EXCEEDED"}
_JINA_NAMES = {
    400: "ParamValidationError",
    401: "AuthenticationRequiredError",
    402: "InsufficientBalanceError",
    429: "RateLimitTriggeredError",
}
_TAVILY_REASONS = {
    432: "This request exceeds your plan's set usage limit. Please upgrade your plan.",
    433: "This request exceeds the pay-as-you-go limit. You can increase your limit.",
}


def _reason(code: int) -> str:
    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return f"Error {code}"


def _error_payload(
    vendor: str | None, code: int, error_code: str | None, message: str | None = None
) -> Any:
    """The vendor's own error body for ``code``."""
    if message is None and vendor == "tavily":
        message = _TAVILY_REASONS.get(code)
    msg = message or _reason(code)
    upper = error_code or msg.upper().replace(" ", "_")
    if vendor == "tavily":
        return {"detail": {"error": msg}}
    if vendor == "serper":
        return {"message": msg, "statusCode": code}
    if vendor == "brave":
        word = error_code or _BRAVE_CODES.get(code, "INTERNAL_ERROR")
        error = {"id": "fake", "status": code, "code": word, "detail": msg, "meta": {}}
        return {"type": "ErrorResponse", "error": error, "time": int(time.time())}
    if vendor == "exa":
        return {"requestId": "fake", "error": msg, "tag": error_code or _EXA_TAGS.get(code, upper)}
    if vendor == "linkup":
        word = error_code or _LINKUP_CODES.get(code, upper)
        return {"statusCode": code, "error": {"code": word, "message": msg, "details": []}}
    if vendor == "scavio":
        return {"error": {"code": error_code or _SCAVIO_CODES.get(code, upper), "message": msg}}
    if vendor == "jina":
        name = error_code or _JINA_NAMES.get(code, "InternalServerError")
        return {
            "data": None,
            "code": code,
            "name": name,
            "status": code * 100 + 1,
            "message": msg,
            "readableMessage": f"{name}: {msg}",
        }
    if vendor == "firecrawl":
        return {"success": False, "error": msg}
    if vendor == "searxng":
        return msg
    return {"error": error_code or msg, "status": code}


# --------------------------------------------------------------------------- helpers


def _json_or_none(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _params(rec: Received) -> dict[str, Any]:
    """Query string, then form or JSON-object body, merged (body wins)."""
    out: dict[str, Any] = dict(parse_qsl(rec.query_string, keep_blank_values=True))
    if rec.body:
        ctype = rec.headers.get("Content-Type", "")
        if "application/x-www-form-urlencoded" in ctype:
            out.update(parse_qsl(rec.body.decode("utf-8", "replace"), keep_blank_values=True))
        else:
            obj = _json_or_none(rec.body)
            if isinstance(obj, dict):
                out.update(obj)
    return out


def _query_of(rec: Received, params: dict[str, Any] | None = None) -> str | None:
    """The search query of a vendor request, or None."""
    params = _params(rec) if params is None else params
    if rec.vendor == "jina" and "q" not in params:
        tail = rec.path.removeprefix("/jina").lstrip("/")
        return tail or None
    value = params.get(_QUERY_PARAM.get(rec.vendor or "", "q"))
    if value is None and rec.vendor == "serper":
        batch = _json_or_none(rec.body)
        if isinstance(batch, list) and batch and isinstance(batch[0], dict):
            value = batch[0].get("q")
    return None if value is None else str(value)


def _route_bare_search(request: web.Request, body: bytes) -> str:
    """Which vendor a bare ``/search`` request is for (rule in the module docstring)."""
    query = request.query
    if request.method != "POST":
        if "engine" in query or "api_key" in query:
            return "serpapi"
        return "serper" if "apiKey" in query else "searxng"
    if request.content_type == "application/x-www-form-urlencoded":
        return "searxng"
    obj = _json_or_none(body)
    if "q" in query or isinstance(obj, list) or (isinstance(obj, dict) and "q" in obj):
        return "serper"
    if "X-API-KEY" in request.headers:
        return "exa" if isinstance(obj, dict) and "query" in obj else "serper"
    return "tavily"


def _mcp_messages(msg: dict[str, Any], vendor: FakeVendor) -> list[dict[str, Any]]:
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
        n = _int_or_none(args.get("max_results"))
        n = vendor.results if n is None else max(0, min(n, vendor.results))
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


# --------------------------------------------------------------------------- running it


class FakeVendorServer:
    """The fake served by ``web.AppRunner`` + ``TCPSite`` in the current loop."""

    def __init__(self, vendor: FakeVendor, host: str = "127.0.0.1", port: int = 0) -> None:
        self.vendor = vendor
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> FakeVendorServer:
        runner = web.AppRunner(
            self.vendor.make_app(),
            handler_cancellation=True,
            shutdown_timeout=1.0,
            access_log=None,
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self._runner = runner
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``."""
        return f"http://{self.host}:{self.port}"

    def url_for(self, vendor: str = "", path: str = "") -> str:
        """``url_for("tavily")`` -> ``http://127.0.0.1:PORT/tavily``; path is appended."""
        prefix = f"/{vendor}" if vendor else ""
        return f"{self.url}{prefix}{path}"

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> FakeVendorServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


@dataclass
class ThreadedFakeVendor:
    """The fake served from a daemon thread with its own event loop."""

    vendor: FakeVendor
    host: str = "127.0.0.1"
    port: int = 0
    _server: FakeVendorServer | None = field(default=None, init=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def start(self) -> ThreadedFakeVendor:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(self.vendor.start(self.host, self.port))
                self.port = self._server.port
            except BaseException as exc:  # reported to the starting thread
                errors.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._server.close())
            loop.close()

        self._thread = threading.Thread(target=run, name="fakevendor", daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            raise errors[0]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> ThreadedFakeVendor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeVendorProcess:
    """``python tests/fakevendor.py ARGS`` in a child process; ``with`` starts and stops it."""

    def __init__(self, *args: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.args = list(args)
        self.host = host
        self.port = port
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 20.0) -> FakeVendorProcess:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--host", self.host]
        cmd += ["--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            self.stop()
            raise RuntimeError(f"fake vendor did not start: {line!r}")
        self.port = int(line)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> FakeVendorProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Fake search vendor (prints its port when ready).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=int, default=3)
    p.add_argument("--fail-ratio", type=float, default=0.0)
    p.add_argument("--fail-status", type=int, default=503)
    p.add_argument("--hang-ratio", type=float, default=0.0)
    p.add_argument("--hang-seconds", type=float, default=20.0)
    p.add_argument("--malformed-ratio", type=float, default=0.0)
    p.add_argument("--empty-words-over", type=int, default=None)
    p.add_argument("--down", action="store_true")
    p.add_argument("--rate-limit", type=int, default=None, help="requests per second")
    p.add_argument("--latency", type=float, default=0.0, help="seconds added to each answer")
    p.add_argument("--jitter", type=float, default=0.0)
    p.add_argument("--gzip", action="store_true", help="gzip when Accept-Encoding allows")
    p.add_argument("--record", action="store_true", help="keep every request (memory grows)")
    return p.parse_args(argv)


def vendor_from_args(args: argparse.Namespace) -> FakeVendor:
    """Build a configured ``FakeVendor`` from parsed command-line arguments."""
    v = FakeVendor(seed=args.seed, results=args.results, record=args.record)
    v.fail_ratio(args.fail_ratio, status=args.fail_status)
    v.hang_ratio(args.hang_ratio, seconds=args.hang_seconds)
    v.malformed_ratio(args.malformed_ratio)
    v.empty_when_words_over(args.empty_words_over)
    v.rate_limit(args.rate_limit)
    v.latency(args.latency, args.jitter)
    v.gzip_when_accepted(args.gzip)
    if args.down:
        v.down()
    return v


async def _serve_forever(args: argparse.Namespace) -> None:
    server = await vendor_from_args(args).start(args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    print(server.port, flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m tests.fakevendor``."""
    asyncio.run(_serve_forever(_parse_args(argv)))


if __name__ == "__main__":
    main()

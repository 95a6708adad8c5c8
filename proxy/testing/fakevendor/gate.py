"""The fake vendor's stream gate: when gated, /stream, /sse and /mcp send each chunk or event
only once a test lets it out, so a test decides what of a stream the proxy has seen."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Self

from aiohttp import web

# Set when the fake vendor's application shuts down: a gated stream stops waiting.
CLOSING: web.AppKey[asyncio.Event] = web.AppKey("fakevendor_closing", asyncio.Event)


class StreamGate:
    """The gate's state and controls, mixed into FakeVendor (which owns `_loop`, the loop its
    application runs on, and `_waiters`)."""

    _loop: asyncio.AbstractEventLoop | None
    _waiters: list[asyncio.Future[None]]
    chunks_sent: int
    _permits: int
    _gated: bool

    def _clear_gate(self) -> None:
        """Open, with nothing sent and no permit left."""
        self.chunks_sent = 0
        self._permits = 0
        self._gated = False

    def gate_streams(self, enabled: bool = True) -> Self:
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
        closing = app[CLOSING]
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

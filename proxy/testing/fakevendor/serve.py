"""Ways to run the fake vendor: in the running loop, or from a thread with its own loop (as a
child process: ``python -m proxy.testing.fakevendor``)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from proxy.testing.fakevendor.app import FakeVendor


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

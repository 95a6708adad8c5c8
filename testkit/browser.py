"""A headless Chromium (Debian's `chromium`) driven through its DevTools protocol, for tests that
must see a page as a browser runs it: its script, its style, its Content-Security-Policy."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from testkit.procs import Child, StartError
from testkit.waiting import eventually

# What Chromium needs to run headless here: no sandbox (root, no user namespaces), no GPU, and
# nothing of its own that would reach out to the network.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
)


def chromium() -> str | None:
    """The browser's command, if it is installed (`make test` installs it)."""
    return shutil.which("chromium")


class Browser:
    """One Chromium with one page open at `url`; `evaluate` runs JavaScript in it."""

    def __init__(self, url: str, *, width: int = 1400, height: int = 1000) -> None:
        self.url = url
        self.size = (width, height)
        self.profile = tempfile.mkdtemp(prefix="testkit-chromium-")
        self.child: Child | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)

    async def start(self, within: float = 20.0) -> Browser:
        command = chromium()
        if command is None:
            raise StartError("chromium is not installed: `make test` installs it")
        argv = [command, *FLAGS, f"--user-data-dir={self.profile}"]
        argv += [f"--window-size={self.size[0]},{self.size[1]}", self.url]
        self.child = Child("chromium", argv)
        port_file = Path(self.profile) / "DevToolsActivePort"
        try:
            await eventually(lambda: port_file.exists() and "\n" in port_file.read_text(), within)
        except AssertionError:
            raise StartError(f"chromium did not start: {self.child.output_tail()}") from None
        port = int(port_file.read_text().split("\n")[0])
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as r:
            targets = await r.json()
        page = next(t for t in targets if t["type"] == "page")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await eventually(self._loaded, within)
        return self

    async def _loaded(self) -> bool:
        """Whether the page at `url` has loaded (while it navigates there, its JavaScript
        context is replaced and an evaluation fails)."""
        try:
            where = await self.evaluate("location.href + ' ' + document.readyState")
        except RuntimeError:
            return False
        return bool(where == f"{self.url} complete")

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events arriving meanwhile are skipped)."""
        assert self._ws is not None, "start() first"
        number = next(self._ids)
        await self._ws.send_str(json.dumps({"id": number, "method": method, "params": params}))
        async for message in self._ws:
            reply = json.loads(message.data)
            if reply.get("id") == number:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply["result"]
                return result
        raise RuntimeError("the browser closed its DevTools connection")

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        found = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in found:
            raise RuntimeError(f"{expression}: {found['exceptionDetails']}")
        return found["result"].get("value")

    async def screenshot(self) -> bytes:
        """A PNG of what the page shows now."""
        shot = await self.call("Page.captureScreenshot", format="png")
        return base64.b64decode(shot["data"])

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self.child is not None:
            self.child.stop()
        shutil.rmtree(self.profile, ignore_errors=True)

    async def __aenter__(self) -> Browser:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

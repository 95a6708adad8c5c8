"""The admin listener's status page in a real headless Chromium (Debian's `chromium`, driven
through its DevTools protocol): it renders every route under its own strict
Content-Security-Policy with no internet, and shows a breaker turning open within 2 s."""

from __future__ import annotations

import time
from typing import Any

import pytest

from proxy.app import build_admin_app
from testkit.browser import Browser, chromium
from testkit.fakevendor import Fault
from tests.test_status import config

ROUTES = {"tavily", "brave", "exa"}


async def test_the_page_renders_the_routes_and_a_breaker_opening_within_two_seconds(
    vendor: Any, start_proxy: Any, aiohttp_server: Any
) -> None:
    if chromium() is None:
        pytest.fail("chromium is not installed: `make test` installs it (Debian's chromium)")
    client = await start_proxy(config(vendor))
    admin = await aiohttp_server(build_admin_app(client.app))
    assert (await client.post("/tavily/search", json={"query": "warm"})).status == 200
    async with Browser(str(admin.make_url("/"))) as page:
        names = "[...document.querySelectorAll('[data-route]')].map(e => e.dataset.route)"
        await until(page, f"{names}.length === 3")
        assert set(await page.evaluate(names)) == ROUTES
        breaker = "document.querySelector('[data-route=tavily] [data-breaker]').dataset.breaker"
        assert await page.evaluate(breaker) == "closed"
        # The page's own stylesheet applies under its CSP: a closed breaker's chip is green.
        colour = "getComputedStyle(document.querySelector('[data-breaker]')).color"
        assert await page.evaluate(colour) == "rgb(43, 138, 62)"
        assert await page.evaluate("document.querySelectorAll('svg.spark').length") >= 6
        vendor.script(Fault.status(503))
        assert (await client.post("/tavily/search", json={"query": "trip"})).status == 503
        tripped = time.monotonic()
        await until(page, f"{breaker} === 'open'", within=2.0)
        assert time.monotonic() - tripped < 2.0
        card = "document.querySelector('[data-route=tavily]')"
        assert await page.evaluate(f"{card}.classList.contains('bad')")
        assert "retry in" in await page.evaluate(f"{card}.textContent")
        providers = "[...document.querySelectorAll('[data-provider]')].map(e => e.dataset.provider)"
        # brave ready; tavily skipped (its circuit is open), exa too (no key configured).
        assert sorted(await page.evaluate(providers)) == ["ready", "skipped", "skipped"]
        errors = await page.evaluate("document.getElementById('errors').textContent")
        assert "vendor" in errors and "503" in errors


async def until(page: Browser, condition: str, within: float = 10.0) -> None:
    """Poll a JavaScript condition in the page every 50 ms until it holds."""
    deadline = time.monotonic() + within
    while not await page.evaluate(f"Boolean({condition})"):
        if time.monotonic() > deadline:
            text = await page.evaluate("document.body.innerText")
            raise AssertionError(f"{condition} did not hold within {within}s; the page:\n{text}")
        await page.evaluate("new Promise(r => setTimeout(r, 50))")

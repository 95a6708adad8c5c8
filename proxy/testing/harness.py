"""The proxy with a fake vendor behind each route, for an agent's tests and for `make demo`: any
config (yours, with the vendors' real origins) is served as written but for each route's upstream,
which becomes a fake vendor of its own on loopback; a test makes one vendor fail and sees what
its agent does."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

from proxy.config import Config, RouteConfig
from proxy.embed import ConfigSource, RunningProxy, in_thread, load, serve
from proxy.testing.fakevendor import FakeVendor, Fault, Received

# `make demo`'s config, and the pytest fixture's unless a test suite chooses its own.
DEMO_CONFIG = Path(__file__).with_name("demo.yaml")


class ProxyHarness:
    """A running proxy and the fake vendor behind each of its routes.

    `url_for(route)` is the base URL an SDK takes; `fail()`, `hang()`, `disconnect()`,
    `malformed()` and `empty()` make a route's vendor misbehave, for `times` calls or until
    `heal()`; `calls(route)` counts what reached that vendor. These name what the vendor does,
    not how the fake does it, so the same calls can later drive the proxy's own fault injection.
    """

    def __init__(self, proxy: RunningProxy, vendors: Mapping[str, FakeVendor]) -> None:
        self.proxy = proxy
        self.vendors = MappingProxyType(dict(vendors))

    @property
    def url(self) -> str:
        """The agents' port: `http://127.0.0.1:PORT` (/v1/search, /mcp and the routes)."""
        return self.proxy.url

    @property
    def admin_url(self) -> str:
        """The admin listener (`/admin/breakers` ...)."""
        return self.proxy.admin_url

    @property
    def config(self) -> Config:
        """The config served, upstreams swapped for the fake vendors."""
        return self.proxy.config

    def url_for(self, route: str) -> str:
        """The base URL of `route` (`http://127.0.0.1:PORT/tavily`)."""
        return self.proxy.url_for(route)

    def vendor(self, route: str) -> FakeVendor:
        """The fake vendor behind `route`, with all its switches and its record."""
        try:
            return self.vendors[route]
        except KeyError:
            raise KeyError(f"no route {route!r}; routes: {', '.join(self.vendors)}") from None

    def fail(
        self,
        route: str,
        status: int = 503,
        *,
        times: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        """The vendor answers `status` (in its own error shape, with `Retry-After` if given)."""
        self._inject(route, Fault.status(status, retry_after=retry_after), times)

    def hang(self, route: str, seconds: float = 60.0, *, times: int | None = None) -> None:
        """The vendor answers only after `seconds`: past the route's timeouts, a timeout."""
        self._inject(route, Fault.hang(seconds), times)

    def disconnect(self, route: str, *, times: int | None = None) -> None:
        """The vendor closes the connection without answering."""
        self._inject(route, Fault.reset(), times)

    def malformed(self, route: str, *, times: int | None = None) -> None:
        """The vendor answers 200 with half a body."""
        self._inject(route, Fault.malformed(), times)

    def empty(self, route: str, *, times: int | None = None) -> None:
        """The vendor finds nothing (its own empty answer)."""
        self._inject(route, Fault.empty(), times)

    def heal(self, route: str | None = None) -> None:
        """Back to normal answers: one route's vendor, or every one."""
        for name in self.vendors if route is None else (route,):
            self.vendor(name).set_default(Fault.ok()).clear_script()

    def calls(self, route: str) -> int:
        """Requests that reached `route`'s vendor."""
        return self.vendor(route).count()

    def requests(self, route: str) -> list[Received]:
        """The requests `route`'s vendor received, in order (headers, body, query ...)."""
        return list(self.vendor(route).requests)

    def _inject(self, route: str, fault: Fault, times: int | None) -> None:
        vendor = self.vendor(route)
        if times is None:
            vendor.set_default(fault)
        else:
            vendor.script(*[fault] * times)


def with_fakes(config: Config, urls: Mapping[str, str]) -> Config:
    """`config` with each route's upstream at its fake vendor (`urls` by route), the vendor's
    path prefix added: the fake serves each vendor under `/<vendor>/...`."""
    routes = {
        name: dataclasses.replace(route, upstream=f"{urls[name]}/{_vendor_of(route)}")
        for name, route in config.routes.items()
    }
    return dataclasses.replace(config, routes=MappingProxyType(routes))


def _vendor_of(route: RouteConfig) -> str:
    searching = route.section("search")
    return searching.vendor if searching is not None else route.name


@asynccontextmanager
async def harness(
    config: ConfigSource,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    admin_port: int = 0,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[ProxyHarness]:
    """`config` served in the running loop with a fake vendor behind each route, until the block
    ends. Options are `proxy.embed.serve()`'s; nothing leaves loopback."""
    parsed = await load(config, env)
    async with AsyncExitStack() as stack:
        vendors: dict[str, FakeVendor] = {}
        urls: dict[str, str] = {}
        for name in parsed.routes:
            vendor = vendors[name] = FakeVendor()
            server = await vendor.start(host)
            stack.push_async_callback(server.close)
            urls[name] = server.url
        running = await stack.enter_async_context(
            serve(with_fakes(parsed, urls), host=host, port=port, admin_port=admin_port)
        )
        yield ProxyHarness(running, vendors)


@contextmanager
def harness_in_thread(config: ConfigSource, **options: Any) -> Iterator[ProxyHarness]:
    """`harness()` for synchronous code: the proxy and its fakes run an event loop of their own
    in a thread while the block runs (what the pytest fixture uses)."""
    with in_thread(harness(config, **options)) as running:
        yield running

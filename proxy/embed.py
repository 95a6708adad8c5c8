"""The proxy inside your own process: `serve()` starts it from a config (a YAML-shaped dict, a
file or a parsed Config) on loopback ports and stops it, for an agent's tests or a tool that
bundles the proxy; `serve_in_thread()` does the same for synchronous code.

    async with serve({"routes": {...}}) as proxy:
        client = TavilyClient(api_key="...", api_base_url=proxy.url_for("tavily"))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from proxy.app import STATE, build_admin_app, build_app
from proxy.config import Config, load_config, parse_config
from proxy.guard import CUT_MARGIN_S, GuardedRunner
from proxy.listeners import address
from proxy.startup import check_startup

T = TypeVar("T")
ConfigSource = Mapping[str, Any] | str | Path | Config
# How long starting or stopping may take from another thread before it is called stuck.
THREAD_WAIT_S = 30.0


@dataclass(frozen=True)
class RunningProxy:
    """A proxy serving in this process: where agents reach it, and its admin endpoints."""

    url: str  # the agents' port, http://127.0.0.1:PORT
    admin_url: str  # the admin listener, http://127.0.0.1:PORT
    config: Config
    app: web.Application

    def url_for(self, route: str) -> str:
        """The base URL an SDK takes for `route` (`http://127.0.0.1:PORT/tavily`)."""
        return self.url + self.config.routes[route].prefix


async def load(config: ConfigSource, env: Mapping[str, str] | None = None) -> Config:
    """`config` parsed and built as start-up builds it: a mapping as YAML would give it, a file,
    or a Config. `env` is what `${VAR}`s read (default: the process environment). Every
    mistake is one ConfigErrors, each line with its YAML path."""
    if isinstance(config, Config):
        parsed = config
    elif isinstance(config, str | Path):
        parsed = load_config(config, env)
    else:
        parsed = parse_config(dict(config), env)
    await check_startup(parsed)
    return parsed


@asynccontextmanager
async def serve(
    config: ConfigSource,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    admin_port: int = 0,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[RunningProxy]:
    """Serve `config` in the running event loop until the block ends: the agents' port and the
    admin listener, each on a free port unless given (the config's own ports are not used).
    Leaving the block closes both; requests still running get a moment to finish."""
    parsed = await load(config, env)
    app = build_app(parsed)
    runner = GuardedRunner(
        app, parsed.server, access_log=None, shutdown_timeout=CUT_MARGIN_S, handle_signals=False
    )
    admin = GuardedRunner(
        build_admin_app(app),
        parsed.server,
        access_log=None,
        shutdown_timeout=CUT_MARGIN_S,
        handle_signals=False,
    )
    await runner.setup()  # the app's start-up: its routes, which the admin app acts on
    try:
        await admin.setup()
        await web.TCPSite(runner, host, port).start()
        await web.TCPSite(admin, host, admin_port).start()
        bound, admin_bound = runner.addresses[0], admin.addresses[0]
        state = app[STATE]
        state.agents_address = address(bound[0], bound[1])
        state.admin_address = address(admin_bound[0], admin_bound[1])
        yield RunningProxy(
            f"http://{state.agents_address}", f"http://{state.admin_address}", parsed, app
        )
    finally:
        if admin.server is not None:
            await admin.cleanup()
        await runner.cleanup()


@contextmanager
def serve_in_thread(config: ConfigSource, **options: Any) -> Iterator[RunningProxy]:
    """`serve()` for synchronous code (a sync test, a sync SDK): the proxy runs its own event
    loop in a thread of its own while the block runs. Options are `serve()`'s."""
    with in_thread(serve(config, **options)) as running:
        yield running


@contextmanager
def in_thread(manager: AbstractAsyncContextManager[T]) -> Iterator[T]:
    """Enter an async context manager on an event loop of its own, in a thread, for the length
    of the block; entering and leaving happen in one task. What it raises is raised here."""
    loop = asyncio.new_event_loop()
    entered: concurrent.futures.Future[tuple[T, asyncio.Event]] = concurrent.futures.Future()

    async def hold() -> None:
        release = asyncio.Event()
        try:
            async with manager as value:
                entered.set_result((value, release))
                await release.wait()
        except BaseException as exc:
            if entered.done():
                raise
            entered.set_exception(exc)

    failed: list[BaseException] = []

    def run() -> None:
        try:
            loop.run_until_complete(hold())
        except BaseException as exc:  # leaving failed: raised in the caller's thread below
            failed.append(exc)
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="search-proxy", daemon=True)
    thread.start()
    value, release = entered.result(THREAD_WAIT_S)
    try:
        yield value
    finally:
        loop.call_soon_threadsafe(release.set)
        thread.join(THREAD_WAIT_S)
        if failed:
            raise failed[0]

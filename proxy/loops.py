"""The event loop the proxy runs on: uvloop (libuv, faster sockets and scheduling) when it is
installed, else asyncio's own; `server.event_loop` can name either."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable
from typing import Any

from policies.core.settings import ConfigError, choice

EVENT_LOOPS = ("auto", "asyncio", "uvloop")


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def parse_event_loop(value: Any, path: str) -> str:
    """`auto`, `asyncio` or `uvloop`; `uvloop` must be installed (`pip install uvloop`, or
    the package's `fast` extra)."""
    loop = choice(value, path, EVENT_LOOPS)
    if loop == "uvloop" and not uvloop_installed():
        raise ConfigError(
            path,
            "uvloop is not installed: pip install uvloop (or search-proxy[fast]), or set "
            "event_loop: auto to use it when it is there",
        )
    return loop


def chosen(setting: str) -> str:
    """The loop `setting` resolves to here: uvloop or asyncio."""
    if setting == "asyncio" or (setting == "auto" and not uvloop_installed()):
        return "asyncio"
    return "uvloop"


def loop_factory(setting: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What asyncio.Runner makes its loop with; None: asyncio's default."""
    if chosen(setting) == "asyncio":
        return None
    import uvloop

    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory

"""Waiting for a condition instead of sleeping a fixed time: poll until it holds, fail after a
bound. `eventually` is for tests on an event loop, `wait_until` for code driving processes."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], within: float = 2.0, interval: float = 0.01
) -> None:
    """Poll `check` (a plain or async predicate) until it holds; AssertionError after `within` s.

    The bound is a failure deadline, not a measurement: a passing test waits only as long as the
    condition takes.
    """
    deadline = time.monotonic() + within
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(interval)


def wait_until(check: Callable[[], T], within: float, interval: float = 0.02) -> T:
    """Call `check` until it returns something true, and return that; TimeoutError after
    `within` s. Blocking: for process start-up, never on an event loop."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {within}s")
        time.sleep(interval)

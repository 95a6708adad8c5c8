"""Time as an injectable dependency, so policies can be tested without sleeping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Cancellable(Protocol):
    def cancel(self) -> object: ...


class Clock(Protocol):
    """What a policy needs of time: a monotonic and a wall-clock reading, a sleep and a timer."""

    def now(self) -> float:
        """Monotonic seconds; only differences mean anything."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch (for HTTP dates and cache ages)."""
        ...

    async def sleep(self, seconds: float) -> None: ...

    def timer(self, seconds: float) -> asyncio.Future[None]:
        """A future done `seconds` from now, to race against other work (`asyncio.wait`);
        cancelled by whoever no longer waits for it."""
        ...

    def later(self, seconds: float, callback: Callable[[], object]) -> Cancellable:
        """Call `callback` `seconds` from now, unless cancelled first."""
        ...


class SystemClock:
    """The real clock."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    def timer(self, seconds: float) -> asyncio.Future[None]:
        # A loop timer, no task: a race its work wins (the common case) cancels it without
        # waking the loop again.
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if seconds <= 0:
            done.set_result(None)
            return done
        handle = loop.call_later(seconds, _set_done, done)
        done.add_done_callback(lambda _: handle.cancel())
        return done

    def later(self, seconds: float, callback: Callable[[], object]) -> Cancellable:
        # A loop timer: cancelling it schedules nothing (a future's callbacks would run).
        return asyncio.get_running_loop().call_later(max(0.0, seconds), callback)


class ManualClock:
    """A clock that only moves when told to; `sleep` advances it at once and records the wait, and
    a timer is that sleep in a task."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_start - start
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        self._now += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self._now += max(0.0, seconds)
        await asyncio.sleep(0)

    def timer(self, seconds: float) -> asyncio.Future[None]:
        return asyncio.ensure_future(self.sleep(seconds))

    def later(self, seconds: float, callback: Callable[[], object]) -> Cancellable:
        async def fire() -> None:
            await self.sleep(seconds)
            callback()

        return asyncio.ensure_future(fire())


def _set_done(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


SYSTEM_CLOCK = SystemClock()

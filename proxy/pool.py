"""Our own queue in front of the upstream connection pool: a slot per pooled connection, held
from before a request until its response is released, so that waiting for a busy pool is timed
and reported on its own (`UpstreamPoolExhausted`), not counted as a slow connect."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable


class Slot:
    """One pooled connection's worth of room, held from before the request until its response
    is released; `release` is idempotent."""

    __slots__ = ("_held",)

    def __init__(self, *held: asyncio.Semaphore) -> None:
        self._held = held

    def release(self) -> None:
        for semaphore in self._held:
            semaphore.release()
        self._held = ()

    def hand_over(self) -> Slot:
        """A new slot holding what this one held; this one is left empty."""
        taken, self._held = Slot(*self._held), ()
        return taken


class PoolFull(Exception):
    """No slot within the wait; `scope` names the limit: "host" or "total"."""

    def __init__(self, scope: str, limit: int) -> None:
        super().__init__(scope)
        self.scope = scope
        self.limit = limit


class PoolSlots:
    """How many upstream connections may be busy at once, per host and in all
    (server.upstream_connections_per_host, server.upstream_connections): a request holds a
    slot of each from before its connection is taken until its answer is released, so the
    wait for a busy pool is timed and reported on its own (`UpstreamPoolExhausted`), never
    counted as a slow connect."""

    def __init__(self, limit: int, per_host: int) -> None:
        self.limit = limit
        self.per_host = per_host
        self._total = asyncio.Semaphore(limit) if limit else None
        self._hosts: dict[Hashable, asyncio.Semaphore] = {}

    async def acquire(self, host: Hashable, wait: float) -> Slot:
        """A slot for one request to `host`, or PoolFull after `wait` seconds."""
        held: list[asyncio.Semaphore] = []
        try:
            if self.per_host:
                semaphore = self._hosts.get(host)
                if semaphore is None:
                    semaphore = self._hosts[host] = asyncio.Semaphore(self.per_host)
                await self._take(semaphore, wait, "host", self.per_host)
                held.append(semaphore)
            if self._total is not None:
                await self._take(self._total, wait, "total", self.limit)
                held.append(self._total)
        except BaseException:
            Slot(*held).release()
            raise
        return Slot(*held)

    @staticmethod
    async def _take(semaphore: asyncio.Semaphore, wait: float, scope: str, limit: int) -> None:
        if not semaphore.locked():
            await semaphore.acquire()  # free: returns without yielding
            return
        try:
            async with asyncio.timeout(wait):
                await semaphore.acquire()
        except TimeoutError:
            raise PoolFull(scope, limit) from None

"""Our own queue in front of the upstream connection pool: a slot per pooled connection, held
from before a request until its response is released, so that waiting for a busy pool is timed
and reported on its own (`UpstreamPoolExhausted`), not counted as a slow connect."""

from __future__ import annotations

import asyncio
import weakref

import aiohttp


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
    """Our own queue in front of a connector's pool, with the same limits (per host, in all).

    aiohttp counts the wait for a free pooled connection in its connect timeout, so pool
    exhaustion looked like a slow vendor. Waiting here first, for as many slots as aiohttp has
    connections, makes the pool wait ours: timed and reported on its own (`UpstreamPoolExhausted`)
    while aiohttp's own wait stays empty.
    """

    def __init__(self, limit: int, per_host: int) -> None:
        self.limit = limit
        self.per_host = per_host
        self._total = asyncio.Semaphore(limit) if limit else None
        self._hosts: dict[tuple[str, int, bool], asyncio.Semaphore] = {}

    async def acquire(self, host: tuple[str, int, bool], wait: float) -> Slot:
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


# One PoolSlots per connector (the process's one session), made on first use.
_POOLS: weakref.WeakKeyDictionary[aiohttp.BaseConnector, PoolSlots] = weakref.WeakKeyDictionary()


def pool_slots(session: aiohttp.ClientSession) -> PoolSlots | None:
    """The slots mirroring `session`'s connector limits; None when it has no connector."""
    connector = session.connector
    if connector is None:
        return None
    slots = _POOLS.get(connector)
    if slots is None:
        slots = _POOLS[connector] = PoolSlots(connector.limit, connector.limit_per_host)
    return slots

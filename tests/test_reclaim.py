"""The reclaimer that gives a drained burst's memory back (proxy/capacity.py): one collection
however many ask, what only a full collection frees is freed, and the next one waits its turn."""

from __future__ import annotations

import asyncio
import weakref

import structlog

from proxy.capacity import Reclaimer
from testkit.waiting import eventually


class Body:
    """Stands for a failed exchange's body, kept alive by a reference cycle."""

    def __init__(self) -> None:
        self.me = self


async def test_many_asks_make_one_collection_that_frees_what_sits_in_cycles() -> None:
    reclaimer = Reclaimer(delay=0.01)
    body = Body()
    gone = weakref.ref(body)
    del body
    assert gone() is not None  # only a full collection finds it
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            reclaimer.soon("bodies")

        async def reclaimed() -> bool:
            return gone() is None

        await eventually(reclaimed, 2.0, 0.01)
    lines = [e for e in logs if e["event"] == "memory_reclaimed"]
    assert len(lines) == 1 and lines[0]["after"] == "bodies" and lines[0]["objects"] >= 1


async def test_the_next_collection_waits_for_every_seconds_after_the_last() -> None:
    reclaimer = Reclaimer(delay=0.01)
    with structlog.testing.capture_logs() as logs:
        reclaimer.soon("bodies", every=0)

        async def collected(n: int) -> bool:
            return sum(e["event"] == "memory_reclaimed" for e in logs) >= n

        await eventually(lambda: collected(1), 2.0, 0.01)
        await asyncio.sleep(0.05)  # the trim after it
        reclaimer.soon("bodies", every=60.0)  # the last was moments ago: not before a minute
        await asyncio.sleep(0.05)
        assert not await collected(2)
        reclaimer.soon("connections", every=60.0)  # one is due already: nothing more asked
        fresh = Reclaimer(delay=0.01)
        fresh.soon("connections", every=0, peak_connections=600, open=3)
        await eventually(lambda: collected(2), 2.0, 0.01)
    last = [e for e in logs if e["event"] == "memory_reclaimed"][-1]
    assert last["after"] == "connections" and last["peak_connections"] == 600

"""The process's memory budget (server.max_buffered_bytes, policies/core/memory.py) as the
server applies it: the error past it, what gives a dropped answer's bytes back, and the heap
given back to the OS once a burst has drained. Each agent request's hold, charged with its body
and its buffered answers, is made and given back (once its answer is written) by its
connection (proxy/guard.py)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable

import structlog

from policies.core.errors import MemoryBudgetFull
from policies.core.memory import Hold, MemoryBudget
from proxy.capacity import trim_heap

log = structlog.get_logger("search_proxy")


def over_budget(route: str | None, attempts: int, hold: Hold) -> MemoryBudgetFull:
    """The error of a body that would take the process past its memory budget."""
    limit = hold.budget.limit
    return MemoryBudgetFull(
        f"{route or 'search-proxy'}: the bodies search-proxy holds at once would pass its "
        f"memory budget of {limit} bytes (server.max_buffered_bytes); retry shortly",
        route=route,
        attempts=attempts,
        retry_after_s=1.0,
    )


def giving_back(hold: Hold | None, size: int) -> Callable[[], None] | None:
    """What gives a buffered answer's `size` bytes back to `hold` when it is dropped."""
    if hold is None:
        return None
    return lambda: hold.give(size)


RECLAIM_DELAY_S = 1.0  # a burst's answers are still referenced as it drains: look after them
RECLAIM_EVERY_S = 10.0  # a full collection at most this often, however busy the proxy


def budget_for(limit: int) -> MemoryBudget:
    """The process's budget; each time a burst has drained, its memory goes back to the OS."""
    pending: list[asyncio.TimerHandle] = []
    last = [-RECLAIM_EVERY_S]

    def reclaim() -> None:
        # A failed or cut exchange keeps its body alive in a reference cycle (its exception's
        # traceback, its task) that only a full collection finds; glibc then keeps the freed
        # pages unless asked.
        pending.clear()
        last[0] = asyncio.get_running_loop().time()
        gc.collect()
        trim_heap()

    def drained() -> None:
        loop = asyncio.get_running_loop()
        if not pending:
            due = max(loop.time() + RECLAIM_DELAY_S, last[0] + RECLAIM_EVERY_S)
            pending.append(loop.call_at(due, reclaim))

    return MemoryBudget(limit, on_drained=drained)


def charge_body(hold: Hold | None, size: int, where: str) -> None:
    """Count an agent's request body of `size` bytes; MemoryBudgetFull past the budget."""
    if hold is not None and not hold.take(size):
        raise over_budget(where, 0, hold)

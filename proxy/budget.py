"""The process's memory budget (server.max_buffered_bytes, policies/core/memory.py) as the
server applies it: the error past it, what gives a dropped answer's bytes back, and the heap
given back to the OS once a burst has drained. Each agent request's hold, charged with its body
and its buffered answers, is made and given back (once its answer is written) by its
connection (proxy/guard.py)."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from policies.core.errors import MemoryBudgetFull
from policies.core.memory import Hold, MemoryBudget
from proxy.capacity import RECLAIMER

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


def budget_for(limit: int) -> MemoryBudget:
    """The process's budget; each time a burst has drained, its memory goes back to the OS."""
    return MemoryBudget(limit, on_drained=lambda: RECLAIMER.soon("bodies"))


def charge_body(hold: Hold | None, size: int, where: str) -> None:
    """Count an agent's request body of `size` bytes; MemoryBudgetFull past the budget."""
    if hold is not None and not hold.take(size):
        raise over_budget(where, 0, hold)

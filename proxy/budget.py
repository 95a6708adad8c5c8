"""The process's memory budget (server.max_buffered_bytes, policies/core/memory.py) as the
server applies it: the error past it, what gives a dropped answer's bytes back, and the heap
given back to the OS once a burst has drained. Each agent request's hold, charged with its body
and its buffered answers, is made and given back (once its answer is written) by its
connection (proxy/guard.py)."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from policies.core.errors import MemoryBudgetFull
from policies.core.memory import Hold, MemoryBudget, parse_cost
from proxy.capacity import RECLAIMER
from proxy.errors import PayloadTooLarge

log = structlog.get_logger("search_proxy")


def over_budget(route: str | None, attempts: int, hold: Hold) -> MemoryBudgetFull:
    """The error of a body that would take the process past its memory budget."""
    return MemoryBudgetFull.over(route, attempts, hold.budget.limit)


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


def charge_parse(hold: Hold | None, body: bytes, where: str) -> None:
    """Count what an agent's large JSON body will take once parsed, beyond its bytes (counted
    already): PayloadTooLarge past the whole budget, MemoryBudgetFull past what is free now."""
    cost = parse_cost(body) if hold is not None else 0
    if not cost or hold is None or hold.take(cost):
        return
    need = len(body) + cost
    if need > hold.budget.limit:
        raise PayloadTooLarge(
            f"{where}: the JSON body of {len(body)} bytes would take some {need} bytes of memory "
            "once read (it holds many small values), more than the memory budget of "
            f"{hold.budget.limit} bytes (server.max_buffered_bytes); send a smaller body"
        )
    raise over_budget(where, 0, hold)

"""The process's memory budget (server.max_buffered_bytes, policies/core/memory.py) as the
server applies it: each agent request's hold, charged with its body and its buffered answers
and given back once the answer is written; the error past it; and the heap given back to the
OS once a burst has drained."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import Token

import structlog
from aiohttp import web

from policies.core.errors import MemoryBudgetFull
from policies.core.memory import HOLD, Hold, MemoryBudget
from proxy.capacity import trim_heap

log = structlog.get_logger("search_proxy")

HOLD_KEY = web.RequestKey("search_proxy_hold", Hold)


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
    """The process's budget; its heap goes back to the OS each time a burst has drained."""
    return MemoryBudget(limit, on_drained=trim_heap)


def hold_request(request: web.BaseRequest, budget: MemoryBudget) -> Token[Hold | None]:
    """A hold for this request, found by everything its handler (and the tasks it starts)
    runs until the returned token resets it: given back by `release_request` once its answer
    is written."""
    hold = request[HOLD_KEY] = Hold(budget)
    return HOLD.set(hold)


def release_request(request: web.BaseRequest) -> None:
    """Give back what the request held (its answer is written, or it is gone)."""
    hold = request.get(HOLD_KEY)
    if hold is not None:
        hold.close()


def charge_body(hold: Hold | None, size: int, where: str) -> None:
    """Count an agent's request body of `size` bytes; MemoryBudgetFull past the budget."""
    if hold is not None and not hold.take(size):
        raise over_budget(where, 0, hold)

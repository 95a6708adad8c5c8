"""One budget for the bodies the process holds in memory at once (server.max_buffered_bytes):
agents' request bodies, vendors' buffered answers (counted as they are decompressed), until each
answer has been written to its agent. A request holds its share in a `Hold`, found through the
context its task runs in, so every flow it starts (retries, hedges, batches) charges the same.
A large JSON body is charged what it will cost once parsed too (`parse_cost`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

# Below this size a body's parse costs at most a couple of MB: not worth counting.
PARSE_COUNTED_FROM = 64 * 1024
# What parsing adds per mark in the text, from sizes in CPython 3.11 measured with tracemalloc
# (tests/hostile/test_memory.py): an object or array ("{", "[": an empty one with its GC
# header), more for an object with keys ('{"': a dict of up to five), a string (its two quotes:
# the str object, its characters being counted as the body's bytes; an escaped quote is text),
# a key's colon, and each comma (a slot, and the number it may end: arrays of numbers are
# counted so). Commas, colons and braces in text count the same: prose such as results' content
# is counted at up to its own size again.
_COST_PER = (
    (b"{", 72),
    (b'{"', 128),
    (b"[", 72),
    (b'"', 32),
    (b'\\"', -32),
    (b":", 24),
    (b",", 32),
)


def parse_cost(body: bytes) -> int:
    """What the objects of JSON `body` will take once parsed beyond its own bytes, estimated
    from the marks in its text (over, never far under); 0 when it is small or does not begin as
    JSON. A vendor's answer of 7 MB of tiny results parses to some 170 MB: charged only by its
    bytes, a few such answers at once would pass any container's memory limit."""
    if len(body) < PARSE_COUNTED_FROM or body.lstrip()[:1] not in (b"{", b"["):
        return 0
    return sum(body.count(mark) * cost for mark, cost in _COST_PER)


class MemoryBudget:
    """Bytes held at once, and the most allowed; `take` refuses past the limit. `on_drained`
    is called when usage falls back to zero after half the limit or more went through since
    the last call: the moment to give a burst's freed memory back to the OS."""

    __slots__ = ("_churn", "limit", "on_drained", "on_refused", "peak", "used")

    def __init__(self, limit: int, on_drained: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.on_drained = on_drained
        self.on_refused: Callable[[], None] | None = None  # each refusal (a metric counts them)
        self._churn = 0  # bytes taken since on_drained was last called

    def take(self, n: int) -> bool:
        """Hold `n` more bytes; False, holding nothing more, when that would pass the limit."""
        if self.used + n > self.limit:
            if self.on_refused is not None:
                self.on_refused()
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        self._churn += n
        return True

    def give(self, n: int) -> None:
        self.used = max(0, self.used - n)
        if self.used == 0 and self._churn * 2 >= self.limit:
            self._churn = 0
            if self.on_drained is not None:
                self.on_drained()


class Hold:
    """What one agent request holds of the budget: taken as its bodies arrive, given back
    whole (`close`) once its answer is written, or as one of them is dropped (`give`)."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.held = 0

    def take(self, n: int) -> bool:
        if not self.budget.take(n):
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        n = min(n, self.held)
        self.held -= n
        self.budget.give(n)

    def close(self) -> None:
        """Give back everything held (idempotent)."""
        self.give(self.held)


# The hold of the agent request the running task serves (None outside one: a breaker's probe).
HOLD: ContextVar[Hold | None] = ContextVar("search_proxy_hold", default=None)


def holding() -> Hold | None:
    """The hold of the agent request being served here, if any."""
    return HOLD.get()

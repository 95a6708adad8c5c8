"""One budget for the bodies the process holds in memory at once (server.max_buffered_bytes):
agents' request bodies, vendors' buffered answers (counted as they are decompressed), until each
answer has been written to its agent. A request holds its share in a `Hold`, found through the
context its task runs in, so every flow it starts (retries, hedges, batches) charges the same.
A large JSON body is charged what it will cost once parsed too (`parse_cost`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextvars import ContextVar

# Below this size a body's parse takes at most some 10 MB, and the policies hold one parse at a
# time (policies/profiles/reading.py): not worth counting, where counting costs more than
# parsing.
PARSE_COUNTED_FROM = 256 * 1024
# What parsing adds per mark in the text, from sizes in CPython 3.11 measured with tracemalloc
# (tests/hostile/test_memory.py): a string (32 a quote: the str object, its characters being
# counted as the body's bytes; an escaped quote in text counts too) and an object with keys (128
# more a '{"', or a "{" whose next mark is a quote: a dict of up to five). Then marks that text
# may hold too: any object or array ("{", "[": an empty one with its GC header), a key's colon,
# and each comma (a slot, and the number it may end: arrays of numbers are counted so).
_LOOSE_MARKS = ((b"{", 72), (b"[", 72), (b":", 24), (b",", 32))
# Only the marks are counted, in the body with everything else left out (one pass in C): a few
# percent of a body of prose, nearly all of one built to parse large.
_NOT_MARKS = bytes(b for b in range(256) if b not in b'"{[:,')
# When the loose marks cost more than twice the body's size, those inside its strings (a CSV
# page; prose costs about its size) are left out, if the strings are few: many strings with
# dense marks look like the answers this guards against, and are charged as read.
_STRINGS_READ = 20_000
_STRING = re.compile(rb'"[^"]*"')
# A string's characters take 1 byte each in CPython when all are below U+0100, 2 when one is
# below U+10000, 4 when one is above: a body with such characters may parse to 2 or 4 times its
# size. UTF-8 begins a character above U+FFFF with F0-F4; an escape, with a surrogate.
_ASTRAL_LEADS = (b"\xf0", b"\xf1", b"\xf2", b"\xf3", b"\xf4")
_ESCAPE = re.compile(rb"\\u")  # (a regex finds it twice as fast as `in`)
_WIDE_ESCAPE = re.compile(rb"\\u(?!00)")
_SURROGATE = re.compile(rb"\\u[dD][89abAB]")


def parse_cost(body: bytes) -> int:
    """What the objects of JSON `body` will take once parsed beyond its own bytes, estimated
    from the marks in its text (over, never far under); 0 when it is small or does not begin as
    JSON. A vendor's answer of 7 MB of tiny results parses to some 170 MB: charged only by its
    bytes, a few such answers at once would pass any container's memory limit. About twice as
    long as parsing a body of prose takes."""
    if len(body) < PARSE_COUNTED_FROM:
        return 0
    head = body[:8]
    if b"\0" in head:  # JSON as UTF-16 or UTF-32, which json.loads reads: not estimated
        opens = head.replace(b"\0", b"").lstrip(b"\xff\xfe \t\r\n")[:1] in (b"{", b"[")
        return _WORST * len(body) if opens else 0
    start = body.lstrip()
    if start.startswith(_BOM):
        start = start[len(_BOM) :].lstrip()
    if start[:1] not in (b"{", b"["):
        return 0
    marks = body.translate(None, _NOT_MARKS)
    quotes = marks.count(b'"')
    cost = quotes * 32 + marks.count(b'{"') * 128
    loose = sum(marks.count(mark) * each for mark, each in _LOOSE_MARKS)
    if loose > 2 * len(body) and quotes <= 2 * _STRINGS_READ:
        # Escaped backslashes and quotes out first, so that each quote left opens or closes.
        unescaped = body
        if b"\\" in unescaped:
            unescaped = unescaped.replace(b"\\\\", b"").replace(b'\\"', b"")
        outside = _STRING.sub(b"", unescaped.translate(None, _NOT_MARKS))
        loose = sum(outside.count(mark) * each for mark, each in _LOOSE_MARKS)
    return cost + loose + _width_cost(body)


_BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark, which json.loads passes over
_WORST = 40  # what a byte can parse to at most (empty objects; 4-byte characters)


def _width_cost(body: bytes) -> int:
    """What wide characters may add to the strings of `body`, beyond a byte each (a Latin-1
    character outside ASCII is counted as wide)."""
    if body.isascii():
        if _ESCAPE.search(body) is None:
            return 0
        if _SURROGATE.search(body) is not None:
            return 3 * len(body)
        return len(body) if _WIDE_ESCAPE.search(body) is not None else 0
    return 3 * len(body) if any(lead in body for lead in _ASTRAL_LEADS) else len(body)


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

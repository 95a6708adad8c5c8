"""How the fake decides to answer a request: the scripted faults (FIFO) and the modes a test
switches (down, rate limit, failure and hang ratios, latency ...), and the clock it waits on."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol, Self

from proxy.testing.fakevendor.faults import Fault, Received
from proxy.testing.fakevendor.vendors import VENDORS, query_of


class Clock(Protocol):
    """What the fake needs of time (a policies ``ManualClock`` has both)."""

    def now(self) -> float:
        """Monotonic seconds."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """The monotonic clock and real sleeps."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class Modes:
    """The switches of a fake vendor and its decision: the first matching scripted fault, else
    the modes in a fixed order, else the default fault."""

    seed: int
    clock: Clock

    def _clear_modes(self) -> None:
        self._script: deque[tuple[Fault, str | None]] = deque()
        self._default = Fault.ok()
        self._rng = random.Random(self.seed)
        self._fail: tuple[float, Fault] | None = None
        self._hang_ratio: tuple[float, float] | None = None
        self._malformed_ratio = 0.0
        self._empty_words: int | None = None
        self._down: Fault | None = None
        self._down_paths: dict[str, Fault] = {}
        self._failing_pages: dict[str, frozenset[str] | None] = {}
        self._rate: int | None = None
        self._rate_window: deque[float] = deque()
        self._latency = (0.0, 0.0, 0.0)
        self._gzip_accepted = False
        self._brave: tuple[int, int, int] | None = None
        self._brave_window: deque[float] = deque()
        self._brave_month_used = 0
        self._key_faults: dict[str, Fault] = {}

    def fault_for_key(self, key: str, fault: Fault | None) -> Self:
        """Answer ``fault`` to every request carrying ``key`` (in a header value or the query
        string), as a vendor answers a key that is out of credits or paused; None clears it.
        Scripted faults still come first."""
        if fault is None:
            self._key_faults.pop(key, None)
        else:
            self._key_faults[key] = fault
        return self

    def script(self, *faults: Fault, path_prefix: str | None = None) -> Self:
        """Queue faults for the next requests (FIFO). With ``path_prefix`` a fault is only
        taken by a request whose path starts with it; other requests skip over it."""
        for f in faults:
            self._script.append((f, path_prefix))
        return self

    def clear_script(self) -> Self:
        """Drop the scripted faults not yet used."""
        self._script.clear()
        return self

    @property
    def pending(self) -> int:
        """Scripted faults not yet used."""
        return len(self._script)

    def set_default(self, fault: Fault) -> Self:
        """What to answer when neither script nor a mode decides (initially ``Fault.ok()``)."""
        self._default = fault
        return self

    def fail_ratio(
        self,
        ratio: float,
        status: int = 503,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Self:
        """Answer ``status`` to a seeded-random ``ratio`` of requests."""
        self._fail = (ratio, Fault.status(status, body, headers)) if ratio > 0 else None
        return self

    def hang_ratio(self, ratio: float, seconds: float = 20.0) -> Self:
        """Hang ``seconds`` on a seeded-random ``ratio`` of requests."""
        self._hang_ratio = (ratio, seconds) if ratio > 0 else None
        return self

    def malformed_ratio(self, ratio: float) -> Self:
        """Truncated JSON on a seeded-random ``ratio`` of requests."""
        self._malformed_ratio = ratio
        return self

    def empty_when_words_over(self, words: int | None) -> Self:
        """Vendor-correct empty answer for queries of more than ``words`` words."""
        self._empty_words = words
        return self

    def down(self, status: int = 503, path_prefix: str | None = None) -> Self:
        """Every request (with ``path_prefix``: every one whose path starts with it) gets
        ``status`` until ``up()``."""
        if path_prefix is None:
            self._down = Fault.status(status)
        else:
            self._down_paths[path_prefix] = Fault.status(status)
        return self

    def up(self) -> Self:
        self._down = None
        self._down_paths.clear()
        return self

    def fail_page(self, url: str, *vendors: str) -> Self:
        """The extract APIs of ``vendors`` (all, when none is named) cannot read ``url``: each
        says so in its own shape (pages.py), the other URLs of a batch still read."""
        self._failing_pages[url] = frozenset(vendors) if vendors else None
        return self

    def rate_limit(self, per_second: int | None) -> Self:
        """Sliding 1 s window over admitted requests; beyond ``per_second`` answer 429 with
        Retry-After. ``None`` switches it off."""
        self._rate = per_second
        self._rate_window.clear()
        return self

    def latency(self, seconds: float, jitter: float = 0.0, *, sigma: float = 0.0) -> Self:
        """Delay every answer by ``seconds`` +- a seeded-random ``jitter``. With ``sigma`` the
        delay is lognormal instead: median ``seconds``, ``sigma`` the spread of its logarithm
        (0.7: the p99 is about 5x the median, the long tail search vendors have)."""
        self._latency = (seconds, jitter, sigma)
        return self

    def gzip_when_accepted(self, enabled: bool = True) -> Self:
        """gzip JSON answers whenever the request's Accept-Encoding allows it."""
        self._gzip_accepted = enabled
        return self

    def brave_rate_limits(
        self, per_second: int = 1, per_month: int = 2000, month_reset: int = 1_000_000
    ) -> Self:
        """Brave answers carry X-RateLimit-Limit/-Policy/-Remaining/-Reset ("<second>, <month>")
        and 429 RATE_LIMITED once either window is exhausted (only 200s use the month)."""
        self._brave = (per_second, per_month, month_reset)
        self._brave_window.clear()
        self._brave_month_used = 0
        return self

    def _take_scripted(self, path: str) -> Fault | None:
        for i, (fault, prefix) in enumerate(self._script):
            if prefix is None or path.startswith(prefix):
                del self._script[i]
                return fault
        return None

    def _decide(self, rec: Received, *, scripted: bool = True) -> Fault:
        taken = self._take_scripted(rec.path) if scripted else None
        if taken is not None:
            return taken
        for key, fault in self._key_faults.items():
            if key in rec.query_string or any(key in v for v in rec.headers.values()):
                return fault
        if self._down is not None:
            return self._down
        for prefix, fault in self._down_paths.items():
            if rec.path.startswith(prefix):
                return fault
        now = self.clock.now()
        if self._rate is not None:
            window = self._rate_window
            while window and window[0] <= now - 1.0:
                window.popleft()
            if len(window) >= self._rate:
                wait = max(1, math.ceil(window[0] + 1.0 - now))
                return Fault.status(
                    429,
                    headers={"X-RateLimit-Limit": str(self._rate), "X-RateLimit-Remaining": "0"},
                    retry_after=wait,
                )
            window.append(now)
        if rec.vendor == "brave" and self._brave is not None:
            per_second, per_month, _ = self._brave
            window = self._brave_window
            while window and window[0] <= now - 1.0:
                window.popleft()
            if len(window) >= per_second or self._brave_month_used >= per_month:
                return Fault.status(429, retry_after=1)
            window.append(now)
        if self._fail is not None and self._rng.random() < self._fail[0]:
            return self._fail[1]
        if self._hang_ratio is not None and self._rng.random() < self._hang_ratio[0]:
            return Fault.hang(self._hang_ratio[1])
        if self._malformed_ratio > 0 and self._rng.random() < self._malformed_ratio:
            return Fault.malformed()
        if self._empty_words is not None and rec.vendor in VENDORS:
            query = query_of(rec)
            if query is not None and len(query.split()) > self._empty_words:
                return Fault.empty()
        return self._default

    def _latency_now(self) -> float:
        base, jitter, sigma = self._latency
        if sigma:
            return base * math.exp(sigma * self._rng.gauss(0.0, 1.0))
        if jitter:
            base += self._rng.uniform(-jitter, jitter)
        return max(0.0, base)

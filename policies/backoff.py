"""The pure decisions of retrying: backoff delays, Retry-After, deadlines and the retry budget.

No I/O and no aiohttp here: the retry loop asks these functions and does the sleeping itself.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Literal, Protocol, TypeAlias

from policies.core.clock import Clock

Jitter = Literal["full", "decorrelated", "none"]
_JITTERS: frozenset[str] = frozenset({"full", "decorrelated", "none"})


class RandomLike(Protocol):
    """The part of `random.Random` backoff needs, so tests can pass a seeded generator."""

    def uniform(self, a: float, b: float) -> float: ...


@dataclass(frozen=True, slots=True)
class Backoff:
    """How long to wait before each retry; built once from config and shared by all requests.

    - ``none``: ``min(max, initial * multiplier**(n-1))``, the plain exponential schedule.
    - ``full``: uniform in ``[0, min(max, initial * multiplier**(n-1))]`` (AWS "full jitter").
    - ``decorrelated``: ``min(max, uniform(initial, prev * 3))`` with ``prev = initial`` before
      the first retry (AWS "decorrelated jitter"); it ignores ``n`` and ``multiplier``.
    """

    initial: float
    max: float
    multiplier: float
    jitter: Jitter

    def __post_init__(self) -> None:
        if not (self.initial > 0 and math.isfinite(self.initial)):
            raise ValueError(f"initial must be a positive number, got {self.initial!r}")
        if not self.max >= self.initial:
            raise ValueError(f"max ({self.max!r}) must be >= initial ({self.initial!r})")
        if not self.multiplier >= 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier!r}")
        if self.jitter not in _JITTERS:
            raise ValueError(f"jitter must be one of {sorted(_JITTERS)}, got {self.jitter!r}")

    def delay(self, n: int, prev: float | None, rng: RandomLike) -> float:
        """Seconds to wait before retry number `n` (1 = first retry); `prev` is the last delay."""
        if n < 1:
            raise ValueError(f"retry number starts at 1, got {n!r}")
        if self.jitter == "decorrelated":
            last = self.initial if prev is None else prev
            return min(self.max, rng.uniform(self.initial, last * 3))
        ceiling = self._exponential(n)
        if self.jitter == "full":
            return rng.uniform(0.0, ceiling)
        return ceiling

    def _exponential(self, n: int) -> float:
        try:
            return min(self.max, self.initial * self.multiplier ** (n - 1))
        except OverflowError:
            # multiplier**(n-1) overflows long after the cap is reached, so the cap is the answer.
            return self.max


# RFC 9110 §10.2.3 says delta-seconds is 1*DIGIT; a decimal is accepted because vendors send it.
_DELTA_SECONDS = re.compile(r"\d+(?:\.\d+)?")


_MAX_DELTA_SECONDS = float(2**31)


def parse_retry_after(value: str | None, now_wall: float) -> float | None:
    """Seconds the vendor asks us to wait (RFC 9110 §10.2.3), or None if absent or unreadable."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if _DELTA_SECONDS.fullmatch(text):
        # RFC 9111 §1.2.2: a delta-seconds too large to represent counts as 2^31 (a long run of
        # digits would otherwise be an infinite wait no arithmetic downstream survives).
        return min(float(text), _MAX_DELTA_SECONDS)
    try:
        # Handles IMF-fixdate and the obsolete RFC 850 / asctime forms RFC 9110 §5.6.7 allows.
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        # HTTP-dates are always GMT; "-0000" parses as naive but means the same.
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now_wall)


@dataclass(frozen=True, slots=True)
class Wait:
    """Sleep this long, then retry."""

    seconds: float


@dataclass(frozen=True, slots=True)
class GiveUpRetryAfterTooLong:
    """The vendor asked for a longer pause than the route will wait; fail now instead."""

    retry_after: float


WaitDecision: TypeAlias = Wait | GiveUpRetryAfterTooLong


def wait_for_retry(
    backoff_delay: float, retry_after: float | None, honor: bool, max_wait: float
) -> WaitDecision:
    """Combine our backoff with the vendor's Retry-After; only Retry-After can exceed `max_wait`."""
    if not honor or retry_after is None:
        return Wait(backoff_delay)
    if retry_after > max_wait:
        return GiveUpRetryAfterTooLong(retry_after)
    return Wait(max(backoff_delay, retry_after))


def fits_deadline(now: float, deadline: float, wait: float, min_attempt: float) -> bool:
    """True if sleeping `wait` and then an attempt of `min_attempt` seconds ends by `deadline`."""
    # Finishing exactly at the deadline counts as fitting; starting a doomed attempt does not.
    return now + max(0.0, wait) + min_attempt <= deadline


def attempt_timeout(now: float, deadline: float, per_try: float) -> float:
    """The timeout for an attempt starting `now`: the per-try limit, cut to the time left."""
    return max(0.0, min(per_try, deadline - now))


# Ratio products such as 0.57 * 100 land just below the integer; this keeps them whole.
_EPSILON = 1e-9


class RetryBudget:
    """Envoy-style retry budget over a sliding window of whole seconds.

    A retry is allowed if fewer than `min_per_s` retries have been allowed in the current
    second (the floor, so a quiet route can always retry), or else if the retries charged to
    the ratio in the last `window_s` seconds, counting this one, would not exceed
    `ratio` x the requests recorded in those seconds. Floor retries are not charged to the ratio.

    With `floor="least"` (the hedge budget) the floor is a least allowance for the whole window
    instead, `min_per_s` x `window_s`, and every grant is charged: a busy route's grants never
    exceed `ratio` x its requests, a quiet route still gets the floor's.
    """

    __slots__ = (
        "_clock",
        "_floor_used",
        "_least",
        "_min_per_s",
        "_ratio",
        "_requests",
        "_requests_total",
        "_retries",
        "_retries_total",
        "_second",
        "_slots",
    )

    def __init__(
        self,
        ratio: float,
        min_per_s: int,
        clock: Clock,
        window_s: float = 10.0,
        *,
        floor: Literal["added", "least"] = "added",
    ) -> None:
        if not (ratio >= 0 and math.isfinite(ratio)):
            raise ValueError(f"ratio must be a non-negative number, got {ratio!r}")
        if min_per_s < 0 or int(min_per_s) != min_per_s:
            raise ValueError(f"min_per_s must be a non-negative integer, got {min_per_s!r}")
        if not (window_s >= 1 and math.isfinite(window_s)) or int(window_s) != window_s:
            raise ValueError(f"window_s must be a whole number of seconds >= 1, got {window_s!r}")
        self._ratio = ratio
        self._min_per_s = int(min_per_s)
        self._clock = clock
        self._slots = int(window_s)
        # One bucket per second in a ring: memory is fixed by window_s, not by traffic.
        self._requests = [0] * self._slots
        self._retries = [0] * self._slots
        # Running sums over the ring, so a decision never walks the buckets.
        self._requests_total = 0
        self._retries_total = 0
        self._floor_used = 0
        self._second = math.floor(clock.now())
        self._least = floor == "least"

    def record_request(self) -> None:
        """Count one new agent request (not a retry) towards the ratio."""
        slot = self._rotate()
        self._requests[slot] += 1
        self._requests_total += 1

    def try_acquire_retry(self) -> bool:
        """Spend budget for one retry and return True, or return False if none is left."""
        slot = self._rotate()
        if self._least:
            allowed = max(self._ratio * self._requests_total, self._min_per_s * self._slots)
            if self._retries_total + 1 > allowed + _EPSILON:
                return False
            self._retries[slot] += 1
            self._retries_total += 1
            return True
        # The floor is use-it-or-lose-it each second, so spend it before the ratio allowance.
        if self._floor_used < self._min_per_s:
            self._floor_used += 1
            return True
        if self._retries_total + 1 <= self._ratio * self._requests_total + _EPSILON:
            self._retries[slot] += 1
            self._retries_total += 1
            return True
        return False

    @property
    def requests_in_window(self) -> int:
        """Requests recorded in the current window."""
        self._rotate()
        return self._requests_total

    @property
    def ratio_retries_in_window(self) -> int:
        """Retries charged to the ratio (not the floor) in the current window."""
        self._rotate()
        return self._retries_total

    def _rotate(self) -> int:
        """Expire the buckets of seconds that left the window; return the current bucket."""
        second = math.floor(self._clock.now())
        # A monotonic clock never goes back; if one does, keep counting in the current second.
        if second > self._second:
            self._floor_used = 0
            # Clearing more than one full ring would revisit the same buckets.
            for s in range(max(self._second + 1, second - self._slots + 1), second + 1):
                slot = s % self._slots
                self._requests_total -= self._requests[slot]
                self._retries_total -= self._retries[slot]
                self._requests[slot] = 0
                self._retries[slot] = 0
            self._second = second
        return self._second % self._slots

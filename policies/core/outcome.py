"""What one upstream answer (or attempt) was, as every policy and metric names it.

A route's classifier turns each reply into an `Outcome` once; retry `on:` conditions, the
breaker, the cache and the `upstream_attempts_total{outcome}` label all read that one value.
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """The values are the metric label values (and the retry `on:` words where they overlap)."""

    OK = "ok"
    EMPTY = "empty"  # a 2xx search answer with no results
    MALFORMED = "malformed"  # a 2xx body that is not a usable answer
    TERMINAL = "terminal"  # the vendor says this request will never succeed (quota, bad key)
    RATE_LIMITED = "429"
    SERVER_ERROR = "5xx"
    CLIENT_ERROR = "client_error"
    TIMEOUT = "timeout"
    CONNECT_ERROR = "connect_error"
    RESET = "reset"

    @classmethod
    def of_status(cls, status: int) -> Outcome:
        """ok, 429, 5xx or client_error, by the status code alone."""
        if status < 400:
            return cls.OK
        if status == 429:
            return cls.RATE_LIMITED
        if status >= 500:
            return cls.SERVER_ERROR
        return cls.CLIENT_ERROR

    @property
    def is_vendor_failure(self) -> bool:
        """Whether it is evidence that the vendor is unwell (counted by the breaker, and the
        moment a stale entry stands in)."""
        return self in _VENDOR_FAILURES


_VENDOR_FAILURES = frozenset(
    {
        Outcome.RATE_LIMITED,
        Outcome.SERVER_ERROR,
        Outcome.MALFORMED,
        Outcome.TIMEOUT,
        Outcome.CONNECT_ERROR,
        Outcome.RESET,
    }
)

# Conditions a retry `on:` list may name besides status codes (429 and 5xx are statuses).
RETRY_CONDITIONS: tuple[Outcome, ...] = (
    Outcome.TIMEOUT,
    Outcome.CONNECT_ERROR,
    Outcome.RESET,
    Outcome.MALFORMED,
)

# Statuses that mean "this exact request will fail again": bad key, no credits, bad input.
TERMINAL_STATUSES = frozenset({400, 401, 402, 403, 422})

"""Errors the proxy answers itself, as classes whose category decides what policies do with them.

Three categories, read by `isinstance`, never by message text:
- `ClientFault`: the request itself is wrong; never retried, never answered stale.
- `LocalRefusal`: the proxy refused without calling the vendor (our limiter, our open circuit);
  not evidence about the vendor, so the breaker ignores it; a stale entry may stand in.
- `VendorFailure`: a vendor call failed; counted by the breaker, a stale entry may stand in.

Every error renders as `{"error": {"type", "message", "route", "attempts", "upstream_status",
"retry_after_s"}}`; the message is one sentence saying what happened and what to do, and
`reason` is the same in a few words (`timed out after 10s`), for summaries such as /v1/search's.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from policies.core.outcome import Outcome

# The shortest wait an agent is told to make: "retry in 0ms" or `Retry-After: 0` is no advice.
MIN_RETRY_S = 1.0


class ProxyError(Exception):
    """Base of every error answered by the proxy rather than by a vendor."""

    status: ClassVar[int] = 502
    type: ClassVar[str] = "proxy_error"
    summary: ClassVar[str] = ""  # the default `reason`; else the type in words
    injected: ClassVar[bool] = False  # a fault the agent asked for (fault injection)

    def __init__(
        self,
        message: str,
        *,
        route: str | None = None,
        attempts: int = 0,
        upstream_status: int | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.route = route
        self.attempts = attempts
        self.upstream_status = upstream_status
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})
        self.reason = reason or self.summary or self.type.replace("_", " ")

    def payload(self) -> dict[str, Any]:
        """The JSON body an agent receives."""
        retry = None if self.retry_after_s is None else round(self.retry_after_s, 3)
        return {
            "error": {
                "type": self.type,
                "message": self.message,
                "route": self.route,
                "attempts": self.attempts,
                "upstream_status": self.upstream_status,
                "retry_after_s": retry,
            }
        }

    def response_headers(self) -> dict[str, str]:
        """Headers to send with the error; Retry-After in whole seconds when known, at least 1."""
        headers = dict(self.headers)
        if self.retry_after_s is not None and "Retry-After" not in headers:
            headers["Retry-After"] = str(math.ceil(max(MIN_RETRY_S, self.retry_after_s)))
        return headers


# ---------------------------------------------------------------------------------------------
# Categories


class ClientFault(ProxyError):
    """The request is at fault: sending it again unchanged fails the same way."""

    status = 400
    type = "bad_request"


class LocalRefusal(ProxyError):
    """The proxy declined to call the vendor; the vendor itself may be fine."""

    status = 503
    type = "refused"


class VendorFailure(ProxyError):
    """A call to the vendor failed; `outcome` says how (the attempt metric's label)."""

    outcome: Outcome = Outcome.SERVER_ERROR


class AttemptFailed(VendorFailure):
    """One upstream attempt failed in a way the retry loop may retry (`outcome` in `on:`).

    `transient` is False when another attempt cannot help (the vendor's host name does not
    resolve, its TLS certificate is refused): the retry loop gives up at once.
    """

    transient: bool = True


# ---------------------------------------------------------------------------------------------
# The errors policies raise


class BadRequest(ClientFault):
    status = 400
    type = "bad_request"


class RateLimited(LocalRefusal):
    """The proxy's own token bucket refused the request."""

    status = 429
    type = "rate_limited"
    summary = "429"


class CallBudgetSpent(LocalRefusal):
    """The agent request made all the vendor calls it may (a route's max_calls_per_request,
    search_api's or fetch_api's): no more are made for it (a cache may still answer)."""

    status = 503
    type = "call_budget_spent"
    summary = "call budget spent"


class QuotaExceeded(RateLimited):
    """The caller's daily quota (`clients.<name>.daily_requests`) is used up until the day
    ends; `retry_after_s` is the time until then. A rate limit to every SDK (429)."""

    type = "quota_exceeded"
    summary = "daily quota used"


class KeysBenched(LocalRefusal):
    """Every key of the route's key pool is benched (paused by the vendor, or out of credits):
    no call is made; `retry_after_s` is when the first is free again. Failover takes over."""

    status = 429
    type = "keys_benched"
    summary = "every key benched"


class UpstreamPoolExhausted(LocalRefusal):
    """Every pooled connection to the vendor stayed busy for the whole pool wait.

    Our own resource ran out, not the vendor: the breaker ignores it, a stale entry may stand in.
    """

    status = 503
    type = "upstream_pool_exhausted"
    summary = "all upstream connections busy"


class MemoryBudgetFull(LocalRefusal):
    """The bodies the process holds at once would pass server.max_buffered_bytes: our own
    memory ran out, not the vendor; the breaker ignores it, a stale entry may stand in."""

    status = 503
    type = "memory_budget"
    summary = "memory budget full"

    @classmethod
    def over(cls, route: str | None, attempts: int, limit: int) -> MemoryBudgetFull:
        """The error of a body that would take the process past its budget of `limit`."""
        return cls(
            f"{route or 'search-proxy'}: the bodies search-proxy holds at once would pass its "
            f"memory budget of {limit} bytes (server.max_buffered_bytes); retry shortly",
            route=route,
            attempts=attempts,
            retry_after_s=1.0,
        )


class AnswerTooCostly(LocalRefusal):
    """A vendor's answer whose parse alone would pass server.max_buffered_bytes, so it is not
    read: our own limit, not the vendor's fault (the breaker ignores it, a stale entry may stand
    in), and no retry, which would get the same answer."""

    status = 502
    type = "upstream_too_large"
    summary = "answered a body too costly to read"


class CircuitOpen(LocalRefusal):
    status = 503
    type = "circuit_open"
    summary = "circuit open"


class UpstreamRetryAfterTooLong(VendorFailure):
    """The vendor asked us to wait longer than the route allows holding an agent."""

    status = 429
    type = "upstream_rate_limited"
    summary = "429"
    outcome = Outcome.RATE_LIMITED


class DeadlineExceeded(VendorFailure):
    status = 504
    type = "deadline_exceeded"
    summary = "ran out of time"
    outcome = Outcome.TIMEOUT


class OutOfTime(DeadlineExceeded):
    """The request's deadline passed before an attempt could start: nothing reached the vendor,
    so the attempt is not counted (the retry loop gives back its vendor call)."""


class UpstreamTimeout(AttemptFailed):
    status = 504
    type = "upstream_timeout"
    summary = "timed out"
    outcome = Outcome.TIMEOUT


class UpstreamUnreachable(AttemptFailed):
    """Connection refused, DNS failure, TLS failure or a connection reset before an answer."""

    status = 502
    type = "upstream_unreachable"
    summary = "unreachable"

    def __init__(
        self,
        message: str,
        *,
        outcome: Outcome = Outcome.CONNECT_ERROR,
        transient: bool = True,
        **kw: Any,
    ) -> None:
        super().__init__(message, **kw)
        self.outcome = outcome  # connect_error, or reset when the connection dropped mid-answer
        self.transient = transient


class UpstreamInvalidResponse(AttemptFailed):
    """The vendor's bytes are not HTTP: a bad status line, chunk size, Content-Length or
    encoding, or headers past the parser's limits. Retried as `reset`: it is usually a proxy,
    load balancer or connection of the vendor's that broke mid-answer."""

    status = 502
    type = "upstream_invalid_response"
    summary = "sent an invalid response"
    outcome = Outcome.RESET


class UpstreamTooLarge(AttemptFailed):
    """The vendor's answer (decompressed) outgrew the route's `max_response_bytes`.

    Counted as `malformed` (no search answer is that large) but never retried: the same request
    gets the same answer, so another attempt would only read the same bytes again.
    """

    status = 502
    type = "upstream_too_large"
    summary = "answered too large a body"
    outcome = Outcome.MALFORMED
    transient = False


class UpstreamMalformed(AttemptFailed):
    """The vendor answered 2xx with a body that is not a usable search response."""

    status = 502
    type = "upstream_malformed"
    summary = "answered a malformed body"
    outcome = Outcome.MALFORMED


class StreamCut(Exception):
    """A streamed reply's body failed after the agent's response began (the upstream broke off,
    or outgrew `max_response_bytes`). The status line is sent: the server can only end the
    connection before the final chunk, so the agent sees a cut answer; `error` says why."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(error.message)
        self.error = error


def is_rate_limit(err: ProxyError) -> bool:
    """A 429 of the proxy's: its limiter or a quota refused, the vendor asked for a longer wait
    than the route allows, every key of a pool is benched (or an agent injected one). Vendors'
    error shapes give it their own rate-limit code."""
    return err.status == 429


def seconds_text(seconds: float) -> str:
    """Render a duration the way an agent reads it: 250ms, 10s, 1.5s, 27s."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds >= 10 or float(seconds).is_integer():
        return f"{math.ceil(seconds - 1e-9)}s"
    return f"{seconds:.1f}s"

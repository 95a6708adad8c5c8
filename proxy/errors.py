"""Errors the proxy itself produces, each knowing its HTTP status and the JSON an agent reads.

Every error renders as `{"error": {"type", "message", "route", "attempts", "upstream_status",
"retry_after_s"}}`; the message is one sentence saying what happened and what to do.
"""

from __future__ import annotations

import math
from typing import Any


class ProxyError(Exception):
    """Base of every error answered by the proxy rather than by a vendor."""

    status = 502
    type = "proxy_error"

    def __init__(
        self,
        message: str,
        *,
        route: str | None = None,
        attempts: int = 0,
        upstream_status: int | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.route = route
        self.attempts = attempts
        self.upstream_status = upstream_status
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})

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
        """Headers to send with the error; Retry-After in whole seconds when known."""
        headers = dict(self.headers)
        if self.retry_after_s is not None and "Retry-After" not in headers:
            headers["Retry-After"] = str(max(0, math.ceil(self.retry_after_s)))
        return headers


class BadRequest(ProxyError):
    status = 400
    type = "bad_request"


class NotFound(ProxyError):
    status = 404
    type = "no_route"


class MethodNotAllowed(ProxyError):
    status = 405
    type = "method_not_allowed"


class PayloadTooLarge(ProxyError):
    status = 413
    type = "body_too_large"


class Unauthorized(ProxyError):
    status = 401
    type = "unauthorized"


class RateLimited(ProxyError):
    """The proxy's own token bucket refused the request."""

    status = 429
    type = "rate_limited"


class UpstreamRetryAfterTooLong(ProxyError):
    """The vendor asked us to wait longer than the route allows holding an agent."""

    status = 429
    type = "upstream_rate_limited"


class CircuitOpen(ProxyError):
    status = 503
    type = "circuit_open"


class UpstreamTimeout(ProxyError):
    status = 504
    type = "upstream_timeout"
    condition = "timeout"


class DeadlineExceeded(ProxyError):
    status = 504
    type = "deadline_exceeded"


class UpstreamUnreachable(ProxyError):
    """Connection refused, DNS failure, TLS failure or a connection reset before an answer."""

    status = 502
    type = "upstream_unreachable"

    def __init__(self, message: str, *, condition: str = "connect_error", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.condition = condition  # connect_error, or reset when the connection dropped mid-answer


class UpstreamMalformed(ProxyError):
    """The vendor answered 2xx with a body that is not a usable search response."""

    status = 502
    type = "upstream_malformed"
    condition = "malformed"


class ProvidersExhausted(ProxyError):
    """Every provider of a /v1/search call failed."""

    status = 503
    type = "all_providers_failed"


class RepeatedFailure(ProxyError):
    """The loop guard answered with an error remembered from an identical recent request."""

    type = "repeated_failure"

    def __init__(self, status: int, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.status = status


def seconds_text(seconds: float) -> str:
    """Render a duration the way an agent reads it: 250ms, 10s, 1.5s, 27s."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds >= 10 or float(seconds).is_integer():
        return f"{math.ceil(seconds - 1e-9)}s"
    return f"{seconds:.1f}s"

"""Errors only the server produces (no route, wrong method, body too large, all providers
failed); each extends a category of the core hierarchy in policies/core/errors.py."""

from __future__ import annotations

from policies.core.errors import ClientFault, LocalRefusal, ProxyError, VendorFailure


class NotFound(ClientFault):
    status = 404
    type = "no_route"


class MethodNotAllowed(ClientFault):
    status = 405
    type = "method_not_allowed"


class PayloadTooLarge(ClientFault):
    status = 413
    type = "body_too_large"


class UnsupportedMediaType(ClientFault):
    """A body of a media type the endpoint does not take (/mcp: JSON only)."""

    status = 415
    type = "unsupported_media_type"


class ExpectationFailed(ClientFault):
    """An `Expect` other than 100-continue: nothing the proxy can meet."""

    status = 417
    type = "expectation_failed"


class Unauthorized(ClientFault):
    status = 401
    type = "unauthorized"


class Forbidden(ClientFault):
    """The caller may not use this endpoint from where it is (the MCP server's access rule, a
    browser page of another site)."""

    status = 403
    type = "forbidden"


class ProvidersExhausted(VendorFailure):
    """Every provider of a /v1/search call failed."""

    status = 503
    type = "all_providers_failed"


class ProvidersRefused(ProxyError):
    """Every provider of a /v1/search call refused for good: bad key, no credits, no key."""

    status = 502
    type = "all_providers_refused"


# Errors of the connection itself (proxy/guard.py), answered before or instead of a route.


class RequestTimeout(ClientFault):
    """The agent's request headers or body stalled past server.header_timeout/body_timeout."""

    status = 408
    type = "request_timeout"


class HttpVersionNotSupported(ClientFault):
    status = 505
    type = "http_version_not_supported"


class TooManyConnections(LocalRefusal):
    """server.max_connections agents' connections are open; this one is refused at once."""

    status = 503
    type = "too_many_connections"


class ShuttingDown(LocalRefusal):
    """The proxy is stopping and this request outlived server.shutdown_grace."""

    status = 503
    type = "shutting_down"


class InternalError(ProxyError):
    """A bug: the request met an exception nothing else handled (its traceback is logged)."""

    status = 500
    type = "internal_error"

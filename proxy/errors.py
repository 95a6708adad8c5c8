"""Errors only the server produces (no route, wrong method, body too large, all providers
failed); each extends a category of the core hierarchy in policies/core/errors.py."""

from __future__ import annotations

from policies.core.errors import ClientFault, ProxyError, VendorFailure


class NotFound(ClientFault):
    status = 404
    type = "no_route"


class MethodNotAllowed(ClientFault):
    status = 405
    type = "method_not_allowed"


class PayloadTooLarge(ClientFault):
    status = 413
    type = "body_too_large"


class Unauthorized(ClientFault):
    status = 401
    type = "unauthorized"


class ProvidersExhausted(VendorFailure):
    """Every provider of a /v1/search call failed."""

    status = 503
    type = "all_providers_failed"


class ProvidersRefused(ProxyError):
    """Every provider of a /v1/search call refused for good: bad key, no credits, no key."""

    status = 502
    type = "all_providers_refused"

"""Proxy errors in each vendor's own error shape, so the vendor's SDK shows the agent our message.

SDKs read their vendor's error body (tavily-python: `detail.error`; linkup-sdk: `error.code`
and `error.message`; scavio: `error.message`; exa-py: the raw body), and some read only the HTTP
reason phrase (requests' `raise_for_status`, LangChain's async Tavily tool). So an error on a
route with a vendor profile is answered in that vendor's body shape, with the message as the
reason phrase too. The proxy's structured fields travel beside it: the `X-Proxy-Error` header
(the error type) and a `search_proxy` key in the body, which no SDK reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from policies.core.errors import (
    BadRequest,
    ClientFault,
    DeadlineExceeded,
    ProxyError,
    RateLimited,
    UpstreamRetryAfterTooLong,
    UpstreamTimeout,
)

# (error, request id) -> the vendor-shaped body
Shape = Callable[[ProxyError, str], dict[str, Any]]
MAX_REASON = 300  # every client seen keeps a reason phrase this long intact


def reason_phrase(err: ProxyError) -> str:
    """The HTTP reason phrase: the message on one ASCII line (clients garble anything else)."""
    text = " ".join(f"search-proxy: {err.message}".split())
    # Printable ASCII only: a vendor's words may carry control bytes the status line refuses.
    text = "".join(c if " " <= c <= "~" else "?" for c in text)
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def _rate_limited(err: ProxyError) -> bool:
    return isinstance(err, RateLimited | UpstreamRetryAfterTooLong)


def _tavily(err: ProxyError, rid: str) -> dict[str, Any]:
    # Never an `error.code` here: tavily-python reads that as its keyless-limit error.
    return {"detail": {"error": err.message}}


def _exa(err: ProxyError, rid: str) -> dict[str, Any]:
    return {"requestId": rid, "error": err.message, "tag": err.type.upper()}


def _linkup_code(err: ProxyError) -> str:
    # linkup-sdk picks its exception class by status and this code.
    if _rate_limited(err):
        return "TOO_MANY_REQUESTS"
    if isinstance(err, DeadlineExceeded | UpstreamTimeout):
        return "REQUEST_DEADLINE_EXCEEDED"
    if isinstance(err, BadRequest):
        return "INVALID_REQUEST"
    if isinstance(err, ClientFault):
        return err.type.upper()
    return "SERVICE_UNAVAILABLE"


def _linkup(err: ProxyError, rid: str) -> dict[str, Any]:
    return {
        "statusCode": err.status,
        "error": {"code": _linkup_code(err), "message": err.message, "details": []},
    }


def _scavio(err: ProxyError, rid: str) -> dict[str, Any]:
    return {"error": {"code": err.type, "message": err.message}}


def _brave(err: ProxyError, rid: str) -> dict[str, Any]:
    code = "RATE_LIMITED" if _rate_limited(err) else err.type.upper()
    return {
        "type": "ErrorResponse",
        "error": {
            "id": rid,
            "status": err.status,
            "code": code,
            "detail": err.message,
            "meta": {"component": "search-proxy"},
        },
    }


def _serper(err: ProxyError, rid: str) -> dict[str, Any]:
    return {"message": err.message, "statusCode": err.status}


def _serpapi(err: ProxyError, rid: str) -> dict[str, Any]:
    return {"error": err.message}


def _jina(err: ProxyError, rid: str) -> dict[str, Any]:
    name = "TooManyRequestsError" if _rate_limited(err) else "ServiceUnavailableError"
    return {
        "data": None,
        "code": err.status,
        "name": name,
        "status": err.status * 100,
        "message": err.message,
        "readableMessage": err.message,
    }


def _firecrawl(err: ProxyError, rid: str) -> dict[str, Any]:
    return {"success": False, "error": err.message}


# Keyed by vendor profile name; SearXNG has no JSON error shape of its own.
SHAPES: dict[str, Shape] = {
    "tavily": _tavily,
    "exa": _exa,
    "linkup": _linkup,
    "scavio": _scavio,
    "brave": _brave,
    "serper": _serper,
    "serpapi": _serpapi,
    "jina": _jina,
    "firecrawl": _firecrawl,
}


def error_body(err: ProxyError, request_id: str, vendor: str | None) -> dict[str, Any]:
    """The body: the vendor's shape with our fields under `search_proxy`, or our own shape."""
    shape = SHAPES.get(vendor) if vendor is not None else None
    if shape is None:
        return err.payload()
    body = shape(err, request_id)
    body["search_proxy"] = err.payload()["error"]
    return body


def error_response(err: ProxyError, request_id: str, vendor: str | None = None) -> web.Response:
    """Every proxy-made failure: status, reason phrase, headers and body, in `vendor`'s dialect
    when the route has one (our generic `{"error": {...}}` otherwise)."""
    headers = err.response_headers()
    headers["X-Request-Id"] = request_id
    headers["X-Proxy-Error"] = err.type
    return web.Response(
        status=err.status,
        reason=reason_phrase(err),
        body=orjson.dumps(error_body(err, request_id, vendor)),
        content_type="application/json",
        headers=headers,
    )

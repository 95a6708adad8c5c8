"""Proxy errors in each vendor's own error shape, so the vendor's SDK shows the agent our message.

SDKs read their vendor's error body (tavily-python: `detail.error`; linkup-sdk: `error.code`
and `error.message`; scavio: `error.message`; exa-py: the raw body), and some read only the HTTP
reason phrase (requests' `raise_for_status`, LangChain's async Tavily tool). So an error on a
route with a vendor profile is answered in that vendor's body shape, with the message as the
reason phrase too. The proxy's structured fields travel beside it: the `X-Proxy-Error` header
(the error type) and a `search_proxy` key in the body, which no SDK reads. Each vendor's shape
is in its record (policies/vendors/); this module builds the response around it.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from policies.core.errors import ProxyError
from policies.core.profile import VendorProfile

MAX_REASON = 300  # every client seen keeps a reason phrase this long intact


def reason_phrase(err: ProxyError) -> str:
    """The HTTP reason phrase: the message on one ASCII line (clients garble anything else)."""
    text = " ".join(f"search-proxy: {err.message}".split())
    # Printable ASCII only: a vendor's words may carry control bytes the status line refuses.
    text = "".join(c if " " <= c <= "~" else "?" for c in text)
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def error_body(err: ProxyError, request_id: str, profile: VendorProfile | None) -> dict[str, Any]:
    """The body: the vendor's shape with our fields under `search_proxy`, or our own shape."""
    shape = profile.error_shape if profile is not None else None
    if shape is None:
        return err.payload()
    body = shape(err, request_id)
    body["search_proxy"] = err.payload()["error"]
    return body


def error_response(
    err: ProxyError, request_id: str, profile: VendorProfile | None = None
) -> web.Response:
    """Every proxy-made failure: status, reason phrase, headers and body, in the error shape of
    the route's vendor record when it has one (our generic `{"error": {...}}` otherwise)."""
    headers = err.response_headers()
    headers["X-Request-Id"] = request_id
    headers["X-Proxy-Error"] = err.type
    return web.Response(
        status=err.status,
        reason=reason_phrase(err),
        body=orjson.dumps(error_body(err, request_id, profile)),
        content_type="application/json",
        headers=headers,
    )


def json_answer(data: Any) -> web.Response:
    """A 200 of the proxy's own (/v1/search's, /v1/fetch's), encoded once: orjson's bytes are
    the body, as error_response's are."""
    return web.Response(body=orjson.dumps(data), content_type="application/json")

"""What an OAuth-capable MCP client finds when it looks for this proxy's authorization server:
there is none. The proxy takes a static bearer token, and every discovery and registration
path no route serves answers an OAuth error (RFC 6749 §5.2's shape, which the clients parse
and show their user) saying so and how to send one."""

from __future__ import annotations

from aiohttp import web

# RFC 9728 (protected resource), RFC 8414 (authorization server) and OpenID discovery, each
# also with the resource's path after it; then the endpoints a client falls back to.
DISCOVERY = (
    "/.well-known/oauth-protected-resource",
    "/.well-known/oauth-authorization-server",
    "/.well-known/openid-configuration",
)
ENDPOINTS = ("/register", "/authorize", "/token")

MESSAGE = (
    "search-proxy does not do OAuth: it takes a static bearer token. Configure your MCP "
    "client to send the header `Authorization: Bearer <token>` on every request instead of "
    "signing in (the TS SDK's requestInit.headers, MCP Inspector's --header, a `headers` "
    "entry in an mcpServers config): a client token of the proxy's `clients:` when it has "
    "them, else your vendor key on a route that passes it, or none on a loopback /mcp."
)


def is_oauth_path(path: str) -> bool:
    """Whether `path` is where an OAuth client looks for metadata or registers."""
    return path in ENDPOINTS or any(path == p or path.startswith(p + "/") for p in DISCOVERY)


def oauth_answer(path: str, request_id: str) -> web.Response:
    """The OAuth error for `path`: 404 for metadata (the client then tries its fallbacks, the
    last being /register), 400 for the endpoints (the client stops and shows the message)."""
    status = 400 if path in ENDPOINTS else 404
    body = {"error": "invalid_request", "error_description": MESSAGE}
    return web.json_response(
        body, status=status, headers={"X-Request-Id": request_id, "Cache-Control": "no-store"}
    )

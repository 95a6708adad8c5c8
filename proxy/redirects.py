"""Redirects an upstream answers: where its `Location` points on the agent's side of the proxy
(nginx's `proxy_redirect default`), so no agent is handed an upstream address; and which ones an
MCP route follows itself. Pure functions of URLs and the route's prefix."""

from __future__ import annotations

from typing import NamedTuple

from yarl import URL

# Redirects that keep the method and the body (RFC 9110 §15.4.8, §15.4.9): the only ones a
# POSTed JSON-RPC message can follow.
FOLLOWED = frozenset({307, 308})
MAX_HOPS = 3  # a Starlette trailing-slash redirect takes one


class RoutePath(NamedTuple):
    """A target on the route's own upstream, as `Flow.request` holds it: the path below the
    upstream's base path, and the raw query string."""

    path: str
    query_string: str


def on_upstream(location: str, requested: URL, base_path: str) -> RoutePath | None:
    """Where `location`, answered to a request for `requested`, points on the same upstream
    origin under its base path; None when it points at another origin, outside the base path,
    or cannot be read."""
    try:
        target = requested.join(URL(location))
    except (ValueError, TypeError):
        return None
    if not target.is_absolute() or (target.scheme, target.host, target.port) != (
        requested.scheme,
        requested.host,
        requested.port,
    ):
        return None
    path = target.raw_path
    if base_path and not (path == base_path or path.startswith(base_path + "/")):
        return None
    return RoutePath(path[len(base_path) :], target.raw_query_string)


def agent_location(target: RoutePath, prefix: str, strip_prefix: bool) -> str | None:
    """The path on the proxy that reaches `target` through the route (path-absolute: the
    agent's own origin); None when the route cannot reach it (a route that keeps its prefix,
    and a target outside it)."""
    path = target.path  # "" or "/...", below the upstream's base path
    if strip_prefix:
        path = prefix + path
    elif not (path == prefix or path.startswith(prefix + "/")):
        return None
    return path + (f"?{target.query_string}" if target.query_string else "")

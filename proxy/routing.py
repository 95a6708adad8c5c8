"""Matching a request target to a route, and confining the forwarded path to that route's upstream.

Only configured upstreams are ever contacted: the target must be origin-form (`/path?query`),
and a path that could be read as another host or another route (`//host`, `..`, `%2F`, `\\`)
is refused before any policy runs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar
from urllib.parse import unquote

from policies.core.errors import BadRequest
from proxy.errors import NotFound

R = TypeVar("R")

# Percent-escapes that would change the path's structure once a server decodes them.
_STRUCTURAL_ESCAPE = re.compile(r"%(2[fF]|5[cC]|00|2[eE])")


@dataclass(frozen=True, slots=True)
class Target:
    """A confined request target: the path below the route's prefix and the raw query string."""

    rest: str  # "" or a path starting with "/"
    query_string: str


def target_parts(raw: str) -> tuple[str, str]:
    """A request target's path and query, as they are routed, forwarded and logged: a
    fragment (which no client sends) runs from the first '#' to the end, a '?' in it
    included, and is part of neither."""
    path, _, query = raw.partition("#")[0].partition("?")
    return path, query


def split_target(raw: str) -> tuple[str, str]:
    """Split an origin-form request target into path and query, refusing every other form."""
    if not raw.startswith("/") or raw.startswith("//"):
        raise BadRequest(
            "request target must be a path like /tavily/search; absolute URIs and "
            "protocol-relative paths are refused"
        )
    path, query = target_parts(raw)
    if "\\" in path or _STRUCTURAL_ESCAPE.search(path) or "\x00" in unquote(path):
        raise BadRequest("request path must not contain encoded slashes, dots or backslashes")
    if any(seg in (".", "..") for seg in path.split("/")):
        raise BadRequest("request path must not contain '.' or '..' segments")
    if "//" in path:
        raise BadRequest("request path must not contain empty segments ('//')")
    return path, query


class Router(Generic[R]):
    """Longest-prefix match from path to route; a prefix matches whole segments only."""

    def __init__(self, routes: Sequence[tuple[str, R]]) -> None:
        self._by_length = sorted(routes, key=lambda pr: len(pr[0]), reverse=True)
        self.prefixes = tuple(sorted(p for p, _ in routes))

    def _lookup(self, path: str) -> tuple[str, R] | None:
        """The longest prefix `path` falls under (whole segments), and its route."""
        for prefix, route in self._by_length:
            if path.startswith(prefix) and (len(path) == len(prefix) or path[len(prefix)] == "/"):
                return prefix, route
        return None

    def find(self, path: str) -> R | None:
        """The route whose prefix `path` falls under, if any, without checking the path (a
        quick look: `match` refuses what it must before a request is served)."""
        found = self._lookup(path)
        return found[1] if found is not None else None

    def match(self, raw_target: str) -> tuple[R, Target]:
        """The route for `raw_target` and the confined remainder; NotFound lists the prefixes."""
        path, query = split_target(raw_target)
        found = self._lookup(path)
        if found is None:
            raise NotFound(
                f"no route for {path}; configured route prefixes: {', '.join(self.prefixes)}"
            )
        prefix, route = found
        return route, Target(rest=path[len(prefix) :], query_string=query)

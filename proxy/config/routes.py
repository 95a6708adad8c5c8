"""A route as the document holds it: where it listens and sends, each policy section parsed by
its own module (policies/chain.py lists them), and what routes say of one another."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from policies import chain
from policies.core.route import RouteConfig, parse_headers, parse_timeouts
from policies.core.settings import (
    PATH_CHARS,
    Collector,
    ConfigError,
    Parser,
    boolean,
    is_host,
    join,
    parse_size,
    text,
    whole,
    whole_in,
)

# Paths the proxy answers itself; no route may claim them.
RESERVED_PATHS = (
    "/healthz",
    "/readyz",
    "/metrics",
    "/admin",
    "/v1/search",
    "/v1/fetch",
    "/openapi.json",
)
# Upper bound of a route's max_calls_per_request: every call holds an upstream connection.
MAX_ROUTE_CALLS = 1000
_ROUTE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
# The one kind of route other routes and /v1/search name as providers.
SEARCH = "search"


def parse_upstream(value: Any, path: str) -> str:
    url = text(value, path)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # `http://[::1`, a port out of range or not a number
        raise ConfigError(path, f"not a usable URL ({exc}): {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(path, f"expected an http(s) URL like https://api.tavily.com, got {url!r}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(path, "must not carry a query, fragment or credentials")
    if not is_host(parts.hostname):
        raise ConfigError(
            path, f"{parts.hostname!r} is not a host name (ASCII, or xn--) or an IP address"
        )
    if port == 0:
        raise ConfigError(path, f"the port must be from 1 to 65535, got 0 in {url!r}")
    return url.rstrip("/")


def parse_prefix(value: Any, path: str) -> str:
    prefix = text(value, path)
    if not prefix.startswith("/") or prefix == "/" or "//" in prefix or prefix.endswith("/"):
        raise ConfigError(path, f"expected a path like /tavily (no trailing slash), got {prefix!r}")
    if any(seg in (".", "..") for seg in prefix.split("/")) or "%" in prefix:
        raise ConfigError(path, f"must not contain dot segments or percent-escapes: {prefix!r}")
    bad = sorted(set(prefix) - PATH_CHARS)
    if bad:
        raise ConfigError(
            path,
            f"{', '.join(map(repr, bad))} cannot appear in a path prefix (RFC 3986 path "
            f"characters only: letters, digits, -._~!$&'()*+,;=:@ and /): {prefix!r}",
        )
    for reserved in RESERVED_PATHS:
        if (
            prefix == reserved
            or prefix.startswith(reserved + "/")
            or reserved.startswith(prefix + "/")
        ):
            raise ConfigError(path, f"{prefix!r} collides with the proxy's own {reserved}")
    return prefix


# A route's own keys; its policies' sections follow them (chain.sections()).
_ROUTE_KEYS: dict[str, Parser] = {
    "prefix": parse_prefix,
    "upstream": parse_upstream,
    "strip_prefix": boolean,
    "timeouts": parse_timeouts,
    "headers": parse_headers,
}
_LAST_KEYS: dict[str, Parser] = {
    "max_response_bytes": lambda v, p: whole(parse_size(v, p), p, 1),
    "max_calls_per_request": whole_in(1, MAX_ROUTE_CALLS),
}


def name_problem(name: Any, what: str = "route") -> str | None:
    """Why `name` cannot name a route (or client), or None."""
    if not isinstance(name, str):
        # A bare `123:` is a number in YAML; metrics, logs and Redis keys need a string.
        return f'a {what} name must be a string: quote it, as in "{name}":'
    if not _ROUTE_NAME.match(name):
        return (
            f"a {what} name is 1-63 lower-case letters, digits, - and _, starting with a letter "
            f"or digit, got {name!r}"
        )
    return None


def parse_route(name: Any, raw: Any, path: str, collect: Collector) -> dict[str, Any]:
    """The parts of one route that parse, its own keys and its policies' sections by key; each
    bad part is recorded with its own errors."""
    problem = name_problem(name)
    if problem is not None:
        collect.add(path, problem)
    sections = chain.sections()
    parsers = {
        **_ROUTE_KEYS,
        **{key: section.parse for key, section in sections.items()},
        **_LAST_KEYS,
    }
    data = collect.keys(raw, path, tuple(parsers), required=("prefix", "upstream"))
    return collect.parse(data, path, parsers)


def route_config(name: str, parts: Mapping[str, Any]) -> RouteConfig:
    """The route from its parsed parts."""
    sections = chain.sections()
    own = {k: v for k, v in parts.items() if k not in sections}
    found = {k: v for k, v in parts.items() if k in sections}
    return RouteConfig(name=name, **own, sections=MappingProxyType(found))


def check_routes(routes: Mapping[str, RouteConfig], named: Mapping[Any, Any]) -> list[ConfigError]:
    """What is wrong with each route next to its own sections and to the other routes: each
    section's own checks, then the routes it names as providers (they must exist and search).
    Fallbacks may name each other: failover is one level deep (policies/failover.py). `named`
    is every route the document names, parsed or not: a broken route has its own errors and is
    not reported again by those that name it."""
    errors: list[ConfigError] = []
    sections = chain.sections()
    for name, route in routes.items():
        for key, cfg in route.sections.items():
            section = sections[key]
            where = f"routes.{name}.{key}"
            problems = list(section.check(cfg, route, where))
            errors += problems
            if problems:
                continue  # a section its route refuses is not followed further
            errors += _references(name, where, section.refers(cfg), routes, named)
    return errors


def check_references(
    broken: Mapping[str, Mapping[str, Any]],
    routes: Mapping[str, RouteConfig],
    named: Mapping[Any, Any],
) -> list[ConfigError]:
    """The routes named by the sections that parsed of routes that did not (`broken`: each
    one's parsed parts): a fallback to a route that does not exist is reported in the same run
    as the field error beside it."""
    sections = chain.sections()
    errors: list[ConfigError] = []
    for name, parts in broken.items():
        for key, cfg in parts.items():
            if key in sections:
                where = f"routes.{name}.{key}"
                errors += _references(name, where, sections[key].refers(cfg), routes, named)
    return errors


def _references(
    name: Any,
    where: str,
    refers: Iterable[tuple[str, str]],
    routes: Mapping[str, RouteConfig],
    named: Mapping[Any, Any],
) -> list[ConfigError]:
    """What is wrong with the routes a section of route `name` names (`refers`: each with its
    path under the section): each must be another route with a search section."""
    errors = []
    for sub, other in refers:
        if other not in routes and other in named:
            continue  # that route's own errors are reported
        if other == name or other not in routes or not routes[other].has(SEARCH):
            errors.append(
                ConfigError(
                    join(where, sub), f"{other!r} is not another route with a search section"
                )
            )
    return errors

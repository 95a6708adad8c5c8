"""A route's config as every policy reads it: where it sends requests, its timeouts and headers,
and the sections of the policies it configures (each parsed by its own policy module)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, TypeVar, cast

from policies.core.errors import seconds_text
from policies.core.settings import (
    FIELD_CONTROL,
    HEADER_NAME,
    Collector,
    ConfigError,
    join,
    mapping,
    positive_duration,
    section,
    texts,
)

# Hop-by-hop headers (RFC 9110 §7.6.1), stripped both ways.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
    }
)
# What the proxy itself writes on an upstream request, never an agent's or a route's: aiohttp
# derives Host from the URL and frames the body, and negotiates the Accept-Encoding it decodes.
# A `Content-Length: 5` set by a route on a 16-byte body desyncs the pooled connection.
PROXY_OWNED = HOP_BY_HOP | {"host", "content-length", "accept-encoding", "expect"}

C = TypeVar("C")
C_co = TypeVar("C_co", covariant=True)


class Keyed(Protocol[C_co]):
    """What a route needs of a policy's section to hand it its config: its YAML key, and the
    parser whose result it holds (policies/core/section.py's Section)."""

    @property
    def key(self) -> str: ...

    @property
    def parse(self) -> Callable[[Any, str], C_co]: ...


@dataclass(frozen=True)
class Timeouts:
    connect: float = 2.0
    per_try: float = 10.0  # to the response headers (and the whole body of a buffered answer)
    total: float = 30.0  # the attempt-and-retry phase
    idle: float = 300.0  # the longest gap between two chunks of a streamed answer
    stream: float = 3600.0  # the longest a streamed answer may run once it started


@dataclass(frozen=True)
class HeaderRules:
    set: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    remove: tuple[str, ...] = ()
    # A `set` header -> the environment variable its value was read from (`${TAVILY_API_KEY:-}`),
    # so that a key left empty can name what to export. Where a value came from, not config.
    variables: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({}), compare=False
    )


@dataclass(frozen=True)
class RouteConfig:
    """One route. `sections` holds each configured policy's own config by its YAML key; read one
    with `route.get(SECTION)`, typed by the policy's section."""

    name: str
    prefix: str
    upstream: str
    strip_prefix: bool = True
    timeouts: Timeouts = Timeouts()
    headers: HeaderRules = HeaderRules()
    # The largest answer read from the vendor, counted after decompression.
    max_response_bytes: int = 8 * 1024 * 1024
    # Vendor calls one agent request may cause: its retries, hedges, simplified variants and
    # failovers (each fallback's own calls included) all spend from it.
    max_calls_per_request: int = 20
    sections: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def get(self, section: Keyed[C]) -> C | None:
        """This route's config of `section`, or None when the route does not configure it."""
        return cast("C | None", self.sections.get(section.key))

    def has(self, key: str) -> bool:
        """Whether the route configures the section with YAML key `key`."""
        return key in self.sections

    def section(self, key: str) -> Any:
        """The config of the section with YAML key `key` (None when not configured): for code
        that knows a section only by name (tests, tools)."""
        return self.sections.get(key)


def parse_timeouts(raw: Any, path: str) -> Timeouts:
    t = section(
        raw,
        path,
        Timeouts,
        {
            "connect": positive_duration,
            "per_try": positive_duration,
            "total": positive_duration,
            "idle": positive_duration,
            "stream": positive_duration,
        },
    )
    if t.per_try > t.total:
        raise ConfigError(join(path, "per_try"), "must not exceed timeouts.total")
    if t.stream < t.idle:
        raise ConfigError(
            join(path, "stream"),
            f"must be at least timeouts.idle ({seconds_text(t.idle)}); raise stream or lower idle",
        )
    return t


def parse_headers(raw: Any, path: str) -> HeaderRules:
    data = mapping(raw, path, ("set", "remove"))
    set_raw = mapping(data.get("set"), join(path, "set"), tuple(data.get("set") or {}))
    collect = Collector()  # every bad header in one run
    for name, value in set_raw.items():
        where = join(path, f"set.{name}")
        if not isinstance(name, str) or not HEADER_NAME.match(name):
            collect.add(where, "not a valid header name")
        elif name.lower() in PROXY_OWNED:
            collect.add(where, _owned(name))
        elif not isinstance(value, str) or FIELD_CONTROL.search(value):
            collect.add(where, "expected a one-line string value")
    remove = texts(data.get("remove", []), join(path, "remove"))
    for i, name in enumerate(remove):
        if name.lower() in PROXY_OWNED:
            collect.add(join(path, f"remove[{i}]"), _owned(name))
    collect.raise_any()
    return HeaderRules(set=MappingProxyType(dict(set_raw)), remove=remove)


def _owned(name: str) -> str:
    return (
        f"{name} is the proxy's own to write (hop-by-hop, or the request's framing or target): "
        "a route may neither set nor remove it"
    )

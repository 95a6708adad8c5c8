"""The YAML config, parsed once at start-up into frozen, typed objects.

Every error names the YAML path and the reason (`routes.tavily.timeouts.per_try: expected a
duration like 10s, got "ten"`). Unknown keys are errors: a typo must not silently disable a policy.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from decimal import Decimal
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

import yaml

from policies.breaker import SECTION as _BREAKER
from policies.breaker import BreakerConfig
from policies.cache import CacheConfig
from policies.core.credentials import is_credential_name
from policies.core.errors import seconds_text
from policies.core.outcome import RETRY_CONDITIONS, Outcome
from policies.core.route import HeaderRules, Timeouts, parse_headers, parse_timeouts
from policies.core.settings import (
    DURATION_UNITS as _DURATION_UNITS,
)
from policies.core.settings import (
    PATH_CHARS as _PATH_CHARS,
)
from policies.core.settings import (
    Collector as _Collector,
)
from policies.core.settings import (
    ConfigError as ConfigError,
)
from policies.core.settings import (
    ConfigErrors as ConfigErrors,
)
from policies.core.settings import (
    boolean as _bool,
)
from policies.core.settings import (
    choice as _choice,
)
from policies.core.settings import (
    fields as _fields,
)
from policies.core.settings import (
    header_names as _header_names,
)
from policies.core.settings import (
    host as _host,
)
from policies.core.settings import (
    is_host as _is_host,
)
from policies.core.settings import (
    join as _join,
)
from policies.core.settings import (
    mapping as _mapping,
)
from policies.core.settings import (
    methods as _methods,
)
from policies.core.settings import (
    number as _float,
)
from policies.core.settings import (
    one_line as _one_line,
)
from policies.core.settings import (
    optional as _optional,
)
from policies.core.settings import (
    parse_duration as parse_duration,
)
from policies.core.settings import (
    parse_rate as parse_rate,
)
from policies.core.settings import (
    parse_size as parse_size,
)
from policies.core.settings import (
    port as _port,
)
from policies.core.settings import (
    positive_duration as _positive_duration,
)
from policies.core.settings import (
    section as _section,
)
from policies.core.settings import (
    status as _status,
)
from policies.core.settings import (
    statuses as _statuses,
)
from policies.core.settings import (
    text as _str,
)
from policies.core.settings import (
    texts as _str_list,
)
from policies.core.settings import (
    whole as _int,
)
from policies.failover import FallbackConfig
from policies.hedge import HedgeBudgetConfig, HedgeConfig
from policies.mcp import KNOWN_SERVERS, McpConfig
from policies.profiles import (
    BUILTIN_PROFILES,
    QUERY_KINDS,
    ProfileError,
    QueryLocation,
    VendorProfile,
)
from policies.ratelimit import RateLimitConfig
from policies.retry import BackoffConfig, BudgetConfig, RetryAfterConfig, RetryConfig
from policies.search import SearchConfig
from proxy.redact import REDACTED, redact_url

T = TypeVar("T")

# Upper bounds of search_api.max_batch and max_calls_per_request: a batch is answered in one
# response, and every call it makes holds an upstream connection.
MAX_BATCH_LIMIT = 100
MAX_CALLS_LIMIT = 10_000
# Paths the proxy answers itself; no route may claim them.
RESERVED_PATHS = ("/healthz", "/readyz", "/metrics", "/admin", "/v1/search", "/openapi.json")
# The words a retry `on:` list takes besides status codes.
RETRY_WORDS = ("429", "5xx", *RETRY_CONDITIONS)


# A config is a few levels deep; yaml's composer recurses once per level and overflows the
# stack near 330, and aliases can make a small file expand without bound.
MAX_CONFIG_BYTES = 1024 * 1024
MAX_DEPTH = 64
MAX_VALUES = 100_000


class _Refused(yaml.MarkedYAMLError):
    """A document PyYAML would read, refused because reading it further would exhaust us."""


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans (only true/false, so `on:` (retry.on) stays a key) and
    no timestamps (a date stays a string); it refuses nesting deeper than MAX_DEPTH."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise _Refused(problem=f"nested deeper than {MAX_DEPTH} levels", problem_mark=mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_Loader.yaml_implicit_resolvers = {
    first: [
        (tag, rx)
        for tag, rx in resolvers
        if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


# ---------------------------------------------------------------------------------------------
# The typed config


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 1024 * 1024
    shutdown_grace: float = 20.0
    admin_token: str | None = None
    # The admin endpoints' own listener; off loopback only with admin_token (proxy/admin.py).
    admin_host: str = "127.0.0.1"
    admin_port: int = 8081
    upstream_connections: int = 256
    upstream_connections_per_host: int = 64
    keepalive_timeout: float = 15.0  # the upstream pool's idle connections
    # Limits on agents' connections (nginx's defaults; see proxy/guard.py).
    header_timeout: float = 60.0
    body_timeout: float = 60.0
    send_timeout: float = 60.0
    client_keepalive_timeout: float = 75.0
    max_connections: int = 1000


@dataclass(frozen=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "search-proxy"
    timeout: float = 0.1


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"
    format: str = "json"


@dataclass(frozen=True)
class RouteConfig:
    name: str
    prefix: str
    upstream: str
    strip_prefix: bool = True
    timeouts: Timeouts = field(default_factory=Timeouts)
    headers: HeaderRules = field(default_factory=HeaderRules)
    retry: RetryConfig | None = None
    rate_limit: RateLimitConfig | None = None
    breaker: BreakerConfig | None = None
    cache: CacheConfig | None = None
    search: SearchConfig | None = None
    fallback: FallbackConfig | None = None
    hedge: HedgeConfig | None = None
    mcp: McpConfig | None = None  # a remote MCP server: policies per tool call (policies/mcp.py)
    # The largest answer read from the vendor, counted after decompression.
    max_response_bytes: int = 8 * 1024 * 1024


@dataclass(frozen=True)
class SearchApiConfig:
    providers: tuple[str, ...] = ()  # route names, in the order tried
    max_results: int = 5
    blocked_domains: tuple[str, ...] = ()
    blocked_extensions: tuple[str, ...] = ()
    # Bounds on what one request may ask: queries in a batch, providers it names (None: as many
    # as are configured, each once), and vendor calls in all (retries, variants, failovers).
    max_batch: int = 20
    max_providers: int | None = None
    max_calls_per_request: int = 100


@dataclass(frozen=True)
class ClientConfig:
    """One agent the proxy knows (`clients.<name>`): its token and its daily quota."""

    name: str
    token: str = field(repr=False)
    daily_requests: int | None = None  # None: no quota


@dataclass(frozen=True)
class McpServerConfig:
    """The proxy's own MCP server (`mcp_server:`, proxy/mcp_server.py): a `web_search` tool over
    /v1/search's providers, served at `path` (streamable HTTP)."""

    # Unset in the YAML: on when there is a search provider (parse_config resolves it).
    enabled: bool = True
    path: str = "/mcp"
    # Without clients: tokens, only loopback peers are served unless this is true.
    allow_remote: bool = False


@dataclass(frozen=True)
class Config:
    routes: Mapping[str, RouteConfig]
    server: ServerConfig = ServerConfig()
    redis: RedisConfig | None = None
    log: LogConfig = LogConfig()
    search_api: SearchApiConfig = SearchApiConfig()
    profiles: Mapping[str, VendorProfile] = field(default_factory=lambda: MappingProxyType({}))
    # Empty: callers are not identified (any credential passes through to the vendor).
    clients: Mapping[str, ClientConfig] = field(default_factory=lambda: MappingProxyType({}))
    mcp_server: McpServerConfig = McpServerConfig()


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_ROUTE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_./-]{1,128}$")

# ---------------------------------------------------------------------------------------------
# Sections


def _server(raw: Any, path: str) -> ServerConfig:
    return _section(
        raw,
        path,
        ServerConfig,
        {
            "host": _host,
            "port": _port,
            "max_body_bytes": parse_size,
            "shutdown_grace": parse_duration,
            "admin_token": _str,
            "admin_host": _host,
            "admin_port": _port,
            "upstream_connections": lambda v, p: _int(v, p, 1),
            "upstream_connections_per_host": lambda v, p: _int(v, p, 0),
            "keepalive_timeout": parse_duration,
            "header_timeout": _positive_duration,
            "body_timeout": _positive_duration,
            "send_timeout": _positive_duration,
            "client_keepalive_timeout": _positive_duration,
            "max_connections": lambda v, p: _int(v, p, 1),
        },
    )


def _redis(raw: Any, path: str) -> RedisConfig:
    cfg = _section(
        raw,
        path,
        RedisConfig,
        {"url": _str, "key_prefix": _str, "timeout": _positive_duration},
    )
    where = _join(path, "url")
    try:
        parts = urlsplit(cfg.url)
        port = parts.port
    except ValueError as exc:  # `redis://[::1`, a port out of range or not a number
        raise ConfigError(where, f"{exc}: {redact_url(cfg.url)!r}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(where, f"expected a redis:// URL, got {redact_url(cfg.url)!r}")
    if port == 0:
        raise ConfigError(where, f"port must be from 1 to 65535: {redact_url(cfg.url)!r}")
    return cfg


def _log(raw: Any, path: str) -> LogConfig:
    return _section(
        raw,
        path,
        LogConfig,
        {
            "level": lambda v, p: _choice(v, p, ("debug", "info", "warning", "error")),
            "format": lambda v, p: _choice(v, p, ("json", "console")),
        },
    )


def _retry_on(value: Any, path: str) -> tuple[frozenset[int], frozenset[Outcome]]:
    statuses: set[int] = set()
    conditions: set[Outcome] = set()
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list like [429, 5xx, timeout], got {value!r}")
    for i, item in enumerate(value):
        item_path = f"{path}[{i}]"
        if isinstance(item, int) and not isinstance(item, bool):
            if not 400 <= item <= 599:
                raise ConfigError(item_path, f"expected a 4xx or 5xx status, got {item}")
            statuses.add(item)
        elif item == "5xx":
            statuses.update((500, 502, 503, 504))
        elif item == "429":
            statuses.add(429)
        elif item in RETRY_CONDITIONS:
            conditions.add(Outcome(item))
        else:
            raise ConfigError(
                item_path,
                f"expected a status code or one of {', '.join(RETRY_WORDS)}, got {item!r}",
            )
    return frozenset(statuses), frozenset(conditions)


def _backoff(raw: Any, path: str) -> BackoffConfig:
    cfg = _section(
        raw,
        path,
        BackoffConfig,
        {
            "initial": _positive_duration,
            "max": parse_duration,
            "multiplier": lambda v, p: _float(v, p, 1.0, 100.0),
            "jitter": lambda v, p: _choice(v, p, ("full", "decorrelated", "none")),
        },
    )
    if cfg.initial > cfg.max:
        given = raw if isinstance(raw, dict) else {}
        key, other = ("max", "initial") if "max" in given else ("initial", "max")
        default = "" if other in given else ", the default"
        bound = "at least" if key == "max" else "at most"
        shown = seconds_text(getattr(cfg, other))
        raise ConfigError(_join(path, key), f"must be {bound} backoff.{other} ({shown}{default})")
    return cfg


# More attempts than this only multiply the load on a vendor that is already failing.
MAX_ATTEMPTS = 10

_RETRY_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "attempts": lambda v, p: _int(v, p, 1, MAX_ATTEMPTS),
    "on": _retry_on,
    "backoff": _backoff,
    "retry_after": lambda v, p: _section(
        v, p, RetryAfterConfig, {"honor": _bool, "max_wait": parse_duration}
    ),
    "budget": lambda v, p: _section(
        v, p, BudgetConfig, {"ratio": _float, "min_per_s": lambda v, p: _int(v, p, 0)}
    ),
    "methods": _methods,
}


def _retry(raw: Any, path: str) -> RetryConfig:
    kwargs = _fields(raw, path, _RETRY_PARSERS)
    if "on" in kwargs:
        kwargs["on_statuses"], kwargs["on_conditions"] = kwargs.pop("on")
    return RetryConfig(**kwargs)


def _rate_limit(raw: Any, path: str) -> RateLimitConfig:
    cfg = _section(
        raw,
        path,
        RateLimitConfig,
        {
            "rate": parse_rate,
            "burst": lambda v, p: _int(v, p, 1, 1_000_000),
            "key": lambda v, p: _choice(v, p, ("route", "client")),
            "client_header": _str,
            "max_clients": lambda v, p: _int(v, p, 1, 10_000_000),
            "max_wait": parse_duration,
        },
        required=("rate", "burst"),
    )
    return cfg


def _cache(raw: Any, path: str) -> CacheConfig:
    cfg = _section(
        raw,
        path,
        CacheConfig,
        {
            "ttl": _positive_duration,
            "stale_ttl": parse_duration,
            "max_entry_bytes": parse_size,
            "methods": _methods,
            "ignore_body_fields": _str_list,
            "shared": _bool,
            "max_entries": lambda v, p: _int(v, p, 1),
            "max_bytes": parse_size,
            # 0 is meaningful: no cross-replica fetch lock (see FetchLock.acquire).
            "lock_wait": parse_duration,
            "vary": _header_names,
        },
    )
    given = raw if isinstance(raw, dict) else {}
    if cfg.max_entry_bytes < 1:
        raise ConfigError(_join(path, "max_entry_bytes"), "must be at least 1 byte")
    if cfg.max_entry_bytes > cfg.max_bytes:
        if "max_entry_bytes" in given:
            where, why = "max_entry_bytes", f"must not exceed max_bytes ({cfg.max_bytes} bytes)"
        else:
            where = "max_bytes"
            why = f"must be at least max_entry_bytes ({cfg.max_entry_bytes} bytes, the default)"
        raise ConfigError(_join(path, where), why)
    return cfg


def _search(raw: Any, path: str) -> SearchConfig:
    return _section(
        raw,
        path,
        SearchConfig,
        {
            "vendor": _str,
            "on_empty": lambda v, p: _choice(v, p, ("simplify", "pass")),
            "max_variants": lambda v, p: _int(v, p, 0),
            "max_query_chars": lambda v, p: _int(v, p, 1),
            "loop_guard": parse_duration,
        },
        required=("vendor",),
    )


def _fallback(raw: Any, path: str) -> FallbackConfig:
    cfg = _section(
        raw,
        path,
        FallbackConfig,
        {
            "providers": _str_list,
            "prefer": lambda v, p: _choice(v, p, ("stale", "fresh")),
            "exhausted_for": parse_duration,
        },
        required=("providers",),
    )
    if not cfg.providers:
        raise ConfigError(_join(path, "providers"), "expected at least one route name")
    return cfg


def _hedge_after(value: Any, path: str) -> float | str:
    if value == "auto":
        return "auto"
    try:
        return _positive_duration(value, path)
    except ConfigError:
        raise ConfigError(path, f"expected auto or a duration like 200ms, got {value!r}") from None


def _hedge(raw: Any, path: str) -> HedgeConfig:
    return _section(
        raw,
        path,
        HedgeConfig,
        {
            "after": _hedge_after,
            "percentile": lambda v, p: _float(v, p, 0.5, 0.999),
            # Each extra is one more call per slow request: more than 3 only adds load.
            "max_extra": lambda v, p: _int(v, p, 1, 3),
            "budget": lambda v, p: _section(
                v,
                p,
                HedgeBudgetConfig,
                {"ratio": lambda v, p: _float(v, p, 0.0, 3.0), "min_per_s": _int},
            ),
            "to": lambda v, p: _choice(v, p, ("same", "fallback")),
            "methods": _methods,
        },
    )


def _tool_name(value: Any, path: str) -> str:
    name = _str(value, path)
    if not _TOOL_NAME.match(name):
        raise ConfigError(path, f"expected an MCP tool name (letters, digits, _-./), got {name!r}")
    return name


def _mcp(raw: Any, path: str) -> McpConfig:
    """A route's `mcp:` section; `server:` names a preset (KNOWN_SERVERS) the rest overrides."""
    given = raw if isinstance(raw, dict) else {}
    preset: Mapping[str, Any] = {}
    if "server" in given:
        server = _choice(given["server"], _join(path, "server"), tuple(KNOWN_SERVERS))
        preset = KNOWN_SERVERS[server]

    def tools(v: Any, p: str) -> frozenset[str]:
        return frozenset(_tool_name(t, f"{p}[{i}]") for i, t in enumerate(_str_list(v, p)))

    def search_tools(v: Any, p: str) -> Mapping[str, str]:
        data = _mapping(v, p, tuple(v) if isinstance(v, dict) else ())
        found = {}
        for tool, argument in data.items():
            where = _join(p, str(tool))
            found[_tool_name(tool, where)] = _str(argument, where)
        return MappingProxyType(found)

    def codes(v: Any, p: str) -> frozenset[int]:
        if not isinstance(v, list):
            raise ConfigError(p, f"expected a list of JSON-RPC error codes like -32603, got {v!r}")
        return frozenset(_int(c, f"{p}[{i}]", -(2**31), 2**31 - 1) for i, c in enumerate(v))

    def phrases(v: Any, p: str) -> tuple[str, ...]:
        return tuple(text.lower() for text in _str_list(v, p))

    fields = _fields(
        raw,
        path,
        {
            "server": _str,
            "idempotent_tools": tools,
            "search_tools": search_tools,
            "transient_errors": codes,
            "transient_tool_errors": phrases,
        },
    )
    idempotent = fields.get("idempotent_tools", frozenset(preset.get("idempotent_tools", ())))
    # The preset's search tools that are still idempotent (a narrowed list drops the others).
    searches = {k: v for k, v in preset.get("search_tools", {}).items() if k in idempotent}
    defaults = {"idempotent_tools": idempotent, "search_tools": MappingProxyType(searches)}
    cfg = McpConfig(**{**defaults, **fields})
    for tool in cfg.search_tools:
        if tool not in cfg.idempotent_tools:
            raise ConfigError(
                _join(path, f"search_tools.{tool}"),
                "a search tool must also be in idempotent_tools: only those calls go through "
                "the route's policies",
            )
    return cfg


def _upstream(value: Any, path: str) -> str:
    url = _str(value, path)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # `http://[::1`, a port out of range or not a number
        raise ConfigError(path, f"not a usable URL ({exc}): {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(path, f"expected an http(s) URL like https://api.tavily.com, got {url!r}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(path, "must not carry a query, fragment or credentials")
    if not _is_host(parts.hostname):
        raise ConfigError(
            path, f"{parts.hostname!r} is not a host name (ASCII, or xn--) or an IP address"
        )
    if port == 0:
        raise ConfigError(path, f"the port must be from 1 to 65535, got 0 in {url!r}")
    return url.rstrip("/")


def _prefix(value: Any, path: str) -> str:
    prefix = _str(value, path)
    if not prefix.startswith("/") or prefix == "/" or "//" in prefix or prefix.endswith("/"):
        raise ConfigError(path, f"expected a path like /tavily (no trailing slash), got {prefix!r}")
    if any(seg in (".", "..") for seg in prefix.split("/")) or "%" in prefix:
        raise ConfigError(path, f"must not contain dot segments or percent-escapes: {prefix!r}")
    bad = sorted(set(prefix) - _PATH_CHARS)
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


_ROUTE_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "prefix": _prefix,
    "upstream": _upstream,
    "strip_prefix": _bool,
    "timeouts": parse_timeouts,
    "headers": parse_headers,
    "retry": _retry,
    "rate_limit": _rate_limit,
    "breaker": _BREAKER.parse,
    "cache": _cache,
    "search": _search,
    "fallback": _fallback,
    "hedge": _hedge,
    "mcp": _mcp,
    "max_response_bytes": lambda v, p: _int(parse_size(v, p), p, 1),
}


def _route_sections(name: Any, raw: Any, path: str, collect: _Collector) -> dict[str, Any]:
    """The sections of one route that parse; each bad one is recorded with its own errors."""
    if not isinstance(name, str):
        # A bare `123:` is a number in YAML; metrics, logs and Redis keys need a string.
        collect.add(path, f'a route name must be a string: quote it, as in "{name}":')
    elif not _ROUTE_NAME.match(name):
        collect.add(
            path,
            "a route name is 1-63 lower-case letters, digits, - and _, starting with a letter "
            f"or digit, got {name!r}",
        )
    data = collect.keys(raw, path, tuple(_ROUTE_PARSERS), required=("prefix", "upstream"))
    return collect.parse(data, path, _ROUTE_PARSERS)


def _client(name: Any, raw: Any, path: str) -> ClientConfig:
    if not isinstance(name, str) or not _ROUTE_NAME.match(name):
        raise ConfigError(
            path,
            "a client name is 1-63 lower-case letters, digits, - and _, starting with a letter "
            f"or digit, got {name!r}",
        )
    if isinstance(raw, str):  # `name: ${TOKEN}`, the short form
        raw = {"token": raw}
    parsers = {"token": _one_line, "daily_requests": lambda v, p: _int(v, p, 1)}
    return ClientConfig(name=name, **_fields(raw, path, parsers, required=("token",)))


def _clients(raw: Any, path: str) -> Mapping[str, ClientConfig]:
    """`clients:`: name -> token (or {token, daily_requests}); each bad client is reported."""
    given = _mapping(raw, path, tuple(raw) if isinstance(raw, dict) else ())
    collect = _Collector()
    clients: dict[str, ClientConfig] = {}
    for name, body in given.items():
        with collect.part():
            clients[name] = _client(name, body, _join(path, str(name)))
    collect.raise_any()
    return MappingProxyType(clients)


def _search_api(raw: Any, path: str) -> SearchApiConfig:
    cfg = _section(
        raw,
        path,
        SearchApiConfig,
        {
            "providers": _str_list,
            "max_results": lambda v, p: _int(v, p, 1),
            "blocked_domains": _str_list,
            "blocked_extensions": _str_list,
            "max_batch": lambda v, p: _int(v, p, 1, MAX_BATCH_LIMIT),
            "max_providers": lambda v, p: _int(v, p, 1),
            "max_calls_per_request": lambda v, p: _int(v, p, 1, MAX_CALLS_LIMIT),
        },
    )
    if cfg.max_calls_per_request < cfg.max_batch:
        given = raw if isinstance(raw, dict) else {}
        where = "max_calls_per_request" if "max_calls_per_request" in given else "max_batch"
        raise ConfigError(
            _join(path, where),
            f"max_calls_per_request ({cfg.max_calls_per_request}) must be at least max_batch "
            f"({cfg.max_batch}): a full batch needs one vendor call per query",
        )
    return cfg


def _mcp_path(value: Any, path: str) -> str:
    """Where the MCP server is served: a path like a route prefix, off the proxy's own paths."""
    given = _str(value, path)
    if not given.startswith("/") or given == "/" or given.endswith("/") or "//" in given:
        raise ConfigError(
            path, f"expected a path like /mcp (starting with /, no trailing slash), got {given!r}"
        )
    if given == "/v1" or given.startswith("/v1/"):
        raise ConfigError(
            path, f"{given!r} is under /v1, which the proxy keeps for its own API; use e.g. /mcp"
        )
    return _prefix(given, path)  # a route prefix's characters, and off the reserved paths


def _mcp_server(raw: Any, path: str) -> dict[str, Any]:
    """`mcp_server:` as McpServerConfig's fields; an unset `enabled` is resolved by
    parse_config (on when there is a search provider)."""
    return _fields(raw, path, {"enabled": _bool, "path": _mcp_path, "allow_remote": _bool})


def _mcp_server_config(
    given: Mapping[str, Any], routes: Mapping[str, RouteConfig], providers: tuple[str, ...]
) -> tuple[McpServerConfig, list[ConfigError]]:
    """The MCP server's settings, and what is wrong with them next to the routes: `enabled`
    with nothing to search, or a path a route prefix collides with."""
    errors = []
    cfg = McpServerConfig(**{"enabled": bool(providers), **given})
    if cfg.enabled and not providers:
        errors.append(
            ConfigError(
                "mcp_server.enabled",
                "the MCP server's web_search tool needs a search provider: add a route with a "
                "search section, or set enabled: false",
            )
        )
    for name, route in routes.items() if cfg.enabled else ():
        prefix = route.prefix
        if (
            prefix == cfg.path
            or prefix.startswith(cfg.path + "/")
            or cfg.path.startswith(prefix + "/")
        ):
            errors.append(
                ConfigError(
                    "mcp_server.path",
                    f"{cfg.path!r} collides with routes.{name}.prefix ({prefix!r}): set "
                    "mcp_server.path to another path, or mcp_server.enabled: false",
                )
            )
    return cfg, errors


# ---------------------------------------------------------------------------------------------
# Vendor profiles


def _dotted(value: Any, path: str, *, allow_body: bool) -> tuple[str, ...]:
    """`data.items` as keys; `""` (the body itself) only where `allow_body`."""
    keys = tuple(value.split(".")) if isinstance(value, str) and value else ()
    if not isinstance(value, str) or "" in keys or not (keys or allow_body):
        raise ConfigError(path, f"expected a dotted path, got {value!r}")
    return keys


def _dotted_list(value: Any, path: str, *, allow_body: bool) -> tuple[tuple[str, ...], ...]:
    if not isinstance(value, list):
        return (_dotted(value, path, allow_body=allow_body),)
    if not value:
        raise ConfigError(path, "expected a dotted path or a list of them, got []")
    return tuple(_dotted(v, f"{path}[{i}]", allow_body=allow_body) for i, v in enumerate(value))


def _field_names(value: Any, path: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (_str(value, path),)
    if not isinstance(value, list) or not value:
        raise ConfigError(path, f"expected a field name or a list of them, got {value!r}")
    return _str_list(value, path)


def _codes_by_status(value: Any, path: str) -> dict[int, frozenset[str]]:
    if not isinstance(value, dict):
        raise ConfigError(
            path, f"expected a mapping of status code to a list of body codes, got {value!r}"
        )
    out: dict[int, frozenset[str]] = {}
    for raw_status, codes in value.items():
        where = _join(path, str(raw_status))
        status = _status(raw_status, where)
        out[status] = frozenset(_str_list([codes] if isinstance(codes, str) else codes, where))
    return out


def _query_locations(value: Any, path: str) -> tuple[QueryLocation, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(
            path, f"expected a list of {{json|query|form|path: field}} mappings, got {value!r}"
        )
    locations = []
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(item, dict) or len(item) != 1:
            raise ConfigError(
                where, f"expected one of json, query, form, path mapped to a field, got {item!r}"
            )
        ((kind, name),) = item.items()
        where = _join(where, str(kind))
        if kind not in QUERY_KINDS:
            raise ConfigError(where, "unknown location kind (json, query, form, path)")
        name = _str(name, where)
        try:
            locations.append(QueryLocation(kind, name))
        except ValueError as exc:  # the location's own rules, e.g. a path prefix ends in /
            raise ConfigError(where, str(exc)) from None
    return tuple(locations)


def _search_method(value: Any, path: str) -> str:
    if not isinstance(value, str) or value.upper() not in ("GET", "POST"):
        raise ConfigError(path, f"expected GET or POST, got {value!r}")
    return value.upper()


def _search_path(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(path, f"expected a path starting with '/', got {value!r}")
    return value


def _str_keyed(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(path, f"expected a mapping with string keys, got {value!r}")
    return dict(value)


def _str_values(value: Any, path: str) -> dict[str, str]:
    return {k: _str(v, _join(path, k)) for k, v in _str_keyed(value, path).items()}


# YAML key -> (VendorProfile field, parser), in the order they are checked.
_PROFILE_PARSERS: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    "query": ("query_locations", _query_locations),
    "results": ("results_paths", lambda v, p: _dotted_list(v, p, allow_body=True)),
    "url": ("url_fields", _field_names),
    "title": ("title_fields", _field_names),
    "snippet": ("snippet_fields", _field_names),
    "missing_results_is_empty": ("missing_results_is_empty", _bool),
    "non_json_ok": ("non_json_ok", _bool),
    "empty_when_body_field": ("empty_when_body_field", _optional(_str)),
    "empty_status_codes": ("empty_status_codes", _codes_by_status),
    "terminal_statuses": ("terminal_statuses", _statuses),
    "terminal_body_codes": ("terminal_body_codes", _codes_by_status),
    "error_code_paths": ("error_code_paths", lambda v, p: _dotted_list(v, p, allow_body=False)),
    "ratelimit_headers": ("ratelimit_headers", _bool),
    "search_method": ("search_method", _search_method),
    "search_path": ("search_path", _optional(_search_path)),
    "max_results_field": ("max_results_field", _optional(_str)),
    "max_results_cap": ("max_results_cap", _optional(lambda v, p: _int(v, p, 1))),
    "search_extra": ("search_extra", _str_keyed),
    "search_headers": ("search_headers", _str_values),
}


def _profile(name: str, raw: Any, path: str) -> VendorProfile:
    """Build a custom vendor profile from its YAML mapping. Accepted keys:

    - ``extends``: a built-in profile name to start from; the other keys override it.
    - ``query``: list of one-key mappings ``{json|query|form|path: field}``, tried in order
      (json fields may be dotted; a path location's field is its prefix, e.g. ``/``).
    - ``results``: dotted path of the result list (``""`` = the body itself), or a list of
      alternatives tried in order.
    - ``url``, ``title``, ``snippet``: result field name, or a list of candidates
      (defaults ``url``, ``title``, ``snippet``).
    - ``missing_results_is_empty``: bool (default false): an absent list means EMPTY, not MALFORMED.
    - ``non_json_ok``: bool (default false): a 2xx non-JSON body counts as OK.
    - ``empty_when_body_field``: top-level field whose presence on a 2xx means EMPTY.
    - ``empty_status_codes``: ``{status: [body codes]}`` that mean EMPTY.
    - ``terminal_statuses``: list of statuses that are never worth retrying.
    - ``terminal_body_codes``: ``{status: [body codes]}`` that are never worth retrying.
    - ``error_code_paths``: dotted path, or list of them, where the body's error code lives.
    - ``ratelimit_headers``: bool: the vendor sends X-RateLimit-Remaining / X-RateLimit-Reset.
    - ``search_method`` (GET or POST, default POST), ``search_path``, ``max_results_field``,
      ``max_results_cap``, ``search_extra`` (fixed params or body fields), ``search_headers``:
      how to run a normalised search on this vendor.

    ``query`` and ``results`` are required unless ``extends`` is given.
    """
    parsers = {key: parse for key, (_, parse) in _PROFILE_PARSERS.items()}
    parsers["extends"] = lambda v, p: _choice(v, p, tuple(sorted(BUILTIN_PROFILES)))
    collect = _Collector()
    data = collect.parse(collect.keys(raw, path, tuple(parsers)), path, parsers)
    if isinstance(raw, dict) and "extends" not in raw:
        for key in ("query", "results"):
            if key not in raw:
                collect.add(_join(path, key), "required key is missing (or use extends)")
    collect.raise_any()
    kwargs = {attr: data[key] for key, (attr, _) in _PROFILE_PARSERS.items() if key in data}
    base = BUILTIN_PROFILES[data["extends"]] if "extends" in data else None
    try:
        if base is not None:
            return replace(base, name=name, family=base.dialect, **kwargs)
        return VendorProfile(name=name, **kwargs)
    except ProfileError as exc:  # a rule across keys, e.g. a GET search needs a query location
        raise ConfigError(_join(path, exc.key), exc.reason) from None


# ---------------------------------------------------------------------------------------------
# Whole documents


def interpolate(node: Any, env: Mapping[str, str], path: str = "") -> Any:
    """Replace `${VAR}` (or `${VAR:-default}`) in every string; a missing variable is an error."""
    collect = _Collector()
    done = _interpolate(node, env, path, collect)
    collect.raise_any()
    return done


def _interpolate(node: Any, env: Mapping[str, str], path: str, collect: _Collector) -> Any:
    """`interpolate`, recording each missing variable and leaving its `${VAR}` in place."""
    if isinstance(node, dict):
        return {k: _interpolate(v, env, _join(path, str(k)), collect) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, env, f"{path}[{i}]", collect) for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:

        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            collect.add(path, f"environment variable {name} is not set")
            return m.group(0)

        return _ENV.sub(sub, node)
    return node


def parse_config(raw: Any, env: Mapping[str, str] | None = None) -> Config:
    """Validate a YAML document (already loaded) into a Config.

    Sections, profiles and routes are parsed independently, so one ConfigErrors reports every
    mistake; cross-references (prefixes, vendors, providers) are checked among the parts that
    parsed, so a broken part is reported once, not again by whatever names it.
    """
    env = os.environ if env is None else env
    collect = _Collector()
    doc = _interpolate(raw, env, "", collect)
    interpolated = len(collect.errors)
    unset = {error.path for error in collect.errors}
    data = collect.keys(doc, "", _TOP_LEVEL_KEYS, required=("routes",))
    sections = collect.parse(
        {k: v for k, v in data.items() if k in _SECTION_PARSERS}, "", _SECTION_PARSERS
    )

    profiles = dict(BUILTIN_PROFILES)
    profiles_raw: dict[Any, Any] = {}
    with collect.part():
        given = data.get("profiles")
        profiles_raw = _mapping(given, "profiles", tuple(given) if isinstance(given, dict) else ())
    for name, body in profiles_raw.items():
        with collect.part():
            where = _join("profiles", str(name))
            if not isinstance(name, str):
                hint = f'quote it, as in "{name}":'
                raise ConfigError(where, f"a profile name must be a string: {hint}")
            profiles[name] = _profile(name, body, where)
    vendors = profiles.keys() | profiles_raw.keys()  # a broken profile has its own errors

    routes_raw = data.get("routes", {})
    if "routes" in data and (not isinstance(routes_raw, dict) or not routes_raw):
        collect.add("routes", "expected a mapping of at least one route")
        routes_raw = {}
    routes: dict[str, RouteConfig] = {}
    seen: dict[str, str] = {}
    for name, body in routes_raw.items():
        before = len(collect.errors)
        parts = _route_sections(name, body, f"routes.{name}", collect)
        if len(collect.errors) == before:
            routes[name] = RouteConfig(name=name, **parts)
        # Checked on the sections that parsed, even when the route's others did not.
        prefix, search = parts.get("prefix"), parts.get("search")
        if prefix in seen:
            collect.add(
                f"routes.{name}.prefix",
                f"{prefix!r} is already the prefix of route {seen[prefix]!r}",
            )
        elif prefix is not None:
            seen[prefix] = name
        if search is not None and search.vendor not in vendors:
            collect.add(
                f"routes.{name}.search.vendor",
                f"unknown vendor {search.vendor!r} (known: {', '.join(sorted(profiles))})",
            )

    for name, route in routes.items():
        if route.mcp is not None:
            for section in ("search", "fallback", "hedge"):
                if getattr(route, section) is not None:
                    collect.add(
                        f"routes.{name}.{section}",
                        f"not available on an MCP route: an mcp route applies its policies per "
                        f"tool call (use mcp.search_tools for empty results); remove {section}",
                    )
        hedge = route.hedge
        if hedge is not None and hedge.to == "fallback" and route.fallback is None:
            collect.add(f"routes.{name}.hedge.to", "fallback needs the route's fallback section")
        fixed = hedge.after if hedge is not None and hedge.after != "auto" else None
        if fixed is not None and fixed >= route.timeouts.per_try:
            collect.add(
                f"routes.{name}.hedge.after",
                f"must be shorter than timeouts.per_try ({seconds_text(route.timeouts.per_try)}): "
                "the attempt times out before its hedge would be sent",
            )
        for i, other in enumerate(route.fallback.providers if route.fallback else ()):
            where = f"routes.{name}.fallback.providers[{i}]"
            if route.search is None:
                collect.add(f"routes.{name}.fallback", "needs the route's search section")
                break
            if other not in routes and other in routes_raw:
                continue  # that route's own errors are reported
            if other == name or other not in routes or routes[other].search is None:
                collect.add(where, f"{other!r} is not another route with a search section")

    # A fallback's chain has its own failover: a cycle would pass a search round for ever.
    def fallbacks_of(name: str) -> tuple[str, ...]:
        fallback = routes[name].fallback if name in routes else None
        return fallback.providers if fallback is not None else ()

    for name in routes:
        reached, todo = {name}, list(fallbacks_of(name))
        while todo:
            other = todo.pop()
            if other == name:
                collect.add(
                    f"routes.{name}.fallback",
                    "fallbacks lead back to this route (a cycle); remove one fallback",
                )
                break
            if other not in reached:
                reached.add(other)
                todo.extend(fallbacks_of(other))

    search_api = sections.get("search_api", SearchApiConfig())
    for i, provider in enumerate(search_api.providers):
        named = routes.get(provider)
        if provider not in routes and provider in routes_raw:
            continue  # that route's own errors are reported
        if named is None or named.search is None:
            collect.add(
                f"search_api.providers[{i}]", f"{provider!r} is not a route with a search section"
            )
    if not search_api.providers:
        ordered = tuple(r.name for r in routes.values() if r.search is not None)
        search_api = replace(search_api, providers=ordered)

    if data.get("clients"):  # checked even when a client is broken: it has its own errors
        for name, route in routes.items():
            if route.rate_limit is not None and route.rate_limit.client_header is not None:
                collect.add(
                    f"routes.{name}.rate_limit.client_header",
                    "with clients configured, per-client limits key on the client's name, "
                    "never on a header the caller chooses: remove client_header",
                )

    mcp_server = McpServerConfig(enabled=False)
    if "mcp_server" not in data or "mcp_server" in sections:  # a broken section has its errors
        mcp_server, problems = _mcp_server_config(
            sections.get("mcp_server", {}), routes, search_api.providers
        )
        collect.errors += problems

    # A value whose variable is unset is reported once, as unset, not also as malformed.
    found = [e for i, e in enumerate(collect.errors) if i < interpolated or e.path not in unset]
    if found:
        raise ConfigErrors(found)
    return Config(
        routes=MappingProxyType(routes),
        server=sections.get("server", ServerConfig()),
        redis=sections.get("redis"),
        log=sections.get("log", LogConfig()),
        search_api=search_api,
        profiles=MappingProxyType(profiles),
        clients=sections.get("clients", MappingProxyType({})),
        mcp_server=mcp_server,
    )


_TOP_LEVEL_KEYS = (
    "server",
    "redis",
    "log",
    "routes",
    "search_api",
    "profiles",
    "clients",
    "mcp_server",
)
_SECTION_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "server": _server,
    "redis": _optional(_redis),
    "log": _log,
    "search_api": _search_api,
    "clients": _clients,
    "mcp_server": _mcp_server,
}


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a YAML file; every failure is a ConfigError."""
    return parse_config(read_document(path), env)


def read_document(path: str | Path) -> Any:
    """The YAML document in file `path`. A file that cannot be read, is not UTF-8, is not YAML,
    repeats a key, or is too big, deep or alias-expanded to handle is a ConfigError."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError("", f"cannot read config {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError("", f"config {path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            "", f"{path} is not UTF-8 text: byte 0x{data[exc.start]:02x} on line {line}"
        ) from None
    try:
        loader = _Loader(text)  # refuses non-printable characters already
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            duplicates = _duplicate_keys(loader, node)
            if duplicates:
                raise ConfigErrors(duplicates)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError("", _yaml_problem(path, exc, text)) from None
    except ValueError as exc:  # a scalar its explicit tag cannot hold: `!!timestamp 2024-02-30`
        raise ConfigError("", f"{path} is not valid YAML: {exc}") from None


def _duplicate_keys(loader: _Loader, root: yaml.Node) -> list[ConfigError]:
    """Every key repeated in its mapping (YAML would silently keep the last), walking the
    document as aliases expand it: too deep (an alias inside itself) or too big is refused."""
    problems: list[ConfigError] = []
    checked: set[int] = set()  # an aliased mapping is visited once per alias, checked once
    stack: list[tuple[yaml.Node, str, int]] = [(root, "", 1)]
    visited = 0
    while stack:
        node, path, depth = stack.pop()
        visited += 1
        if depth > MAX_DEPTH:
            limit = f"nested deeper than {MAX_DEPTH} levels"
        elif visited > MAX_VALUES:
            limit = f"more than {MAX_VALUES} values"
        else:
            limit = ""
        if limit:
            raise _Refused(problem=f"{limit} once aliases expand", problem_mark=node.start_mark)
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            check = id(node) not in checked
            checked.add(id(node))
            for key_node, value_node in node.value:
                where = path
                if key_node.tag != "tag:yaml.org,2002:merge":  # `<<: *base` overrides by design
                    key = _scalar_key(loader, key_node)
                    where = _join(path, str(key))
                    if check and key in first:
                        line = first[key].start_mark.line + 1
                        problems.append(ConfigError(where, f"duplicate key (first at line {line})"))
                    elif key is not _NOT_SCALAR:
                        first[key] = key_node
                stack.append((value_node, where, depth + 1))
    return sorted(problems, key=lambda e: e.path)


_NOT_SCALAR = object()  # a collection as a key: construction refuses it as unhashable


def _scalar_key(loader: _Loader, node: yaml.Node) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        return _NOT_SCALAR
    return loader.construct_object(node)


def _yaml_problem(path: str | Path, exc: yaml.YAMLError, text: str) -> str:
    """One line saying where and why PyYAML (or our limits) refused the document."""
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return f"{path} is not valid YAML at line {line}: {exc.reason} (#x{char:04x})"
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    verdict = "is refused" if isinstance(exc, _Refused) else "is not valid YAML"
    return f"{path} {verdict}{where}: {problem}"


# ---------------------------------------------------------------------------------------------
# Showing the effective config


def as_document(config: Config) -> dict[str, Any]:
    """The config as a YAML-shaped mapping that parse_config reads back into an equal Config.

    Durations print as seconds, sizes as bytes, rates per second; built-in profiles are left
    out (they are always there), custom ones print with the keys a profile is written with.
    """
    doc: dict[str, Any] = {"server": _plain(config.server)}
    if config.redis is not None:
        doc["redis"] = _plain(config.redis)
    doc["log"] = _plain(config.log)
    doc["search_api"] = _plain(config.search_api)
    doc["mcp_server"] = _plain(config.mcp_server)
    doc["routes"] = {name: _route_document(route) for name, route in config.routes.items()}
    custom = {
        name: _profile_document(profile)
        for name, profile in config.profiles.items()
        if BUILTIN_PROFILES.get(name) != profile
    }
    if custom:
        doc["profiles"] = custom
    if config.clients:
        doc["clients"] = {
            name: {k: v for k, v in _plain(client).items() if k != "name"}
            for name, client in config.clients.items()
        }
    return doc


def redacted(config: Config) -> dict[str, Any]:
    """`as_document(config)` with secrets replaced by "<redacted>", a placeholder to fill in:
    credential-named server settings (admin_token), the Redis URL's userinfo and credential
    parameters (`?password=`), every `headers.set` value, and a custom profile's
    credential-named search headers and fields (the rule of policies/core/credentials.py)."""
    doc = as_document(config)
    _redact_keys(doc["server"])
    if "redis" in doc:
        doc["redis"]["url"] = redact_url(doc["redis"]["url"])
    for route in doc["routes"].values():
        route["headers"]["set"] = dict.fromkeys(route["headers"]["set"], REDACTED)
    for client in doc.get("clients", {}).values():
        client["token"] = REDACTED
    for profile in doc.get("profiles", {}).values():
        _redact_keys(profile.get("search_headers", {}))
        _redact_keys(profile.get("search_extra", {}))
    return doc


def secret_values(config: Config) -> tuple[str, ...]:
    """The secrets a config holds, for the logs to hide wherever they turn up: every
    `headers.set` value (and the token after its scheme, `Bearer <token>`), the admin token,
    the Redis URL's passwords, clients' tokens, and profiles' credential-named values."""
    found: list[str] = []
    for route in config.routes.values():
        for value in route.headers.set.values():
            found += (value, value.partition(" ")[2].strip())
    if config.server.admin_token:
        found.append(config.server.admin_token)
    if config.redis is not None:
        parts = urlsplit(config.redis.url)
        found += (parts.password or "", parts.username or "")
        found += (v for k, v in parse_qsl(parts.query) if is_credential_name(k))
    found += (client.token for client in config.clients.values())
    for profile in config.profiles.values():
        for key, value in (*profile.search_headers.items(), *profile.search_extra.items()):
            if is_credential_name(key) and isinstance(value, str):
                found.append(value)
    return tuple(dict.fromkeys(v for v in found if v))


def _redact_keys(mapping: dict[str, Any]) -> None:
    for key in mapping:
        if is_credential_name(key):
            mapping[key] = REDACTED


def _plain(obj: Any) -> Any:
    """Dataclasses, enums and frozen collections as plain YAML data; None fields are left out
    (every None is a key's default, and null is not what its parser takes)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        values = ((f.name, getattr(obj, f.name)) for f in fields(obj))
        return {name: _plain(value) for name, value in values if value is not None}
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, frozenset):
        return sorted(_plain(v) for v in obj)
    if isinstance(obj, tuple | list):
        return [_plain(v) for v in obj]
    return obj


_SERVER_ERRORS = frozenset({500, 502, 503, 504})  # what `5xx` stands for in retry.on


def _route_document(route: RouteConfig) -> dict[str, Any]:
    doc: dict[str, Any] = _plain(route)
    del doc["name"]  # the key of the route's mapping
    if route.retry is not None:
        retry = doc["retry"]
        del retry["on_statuses"], retry["on_conditions"]
        statuses: list[int | str] = sorted(route.retry.on_statuses)
        if _SERVER_ERRORS <= route.retry.on_statuses:
            statuses = [s for s in statuses if s not in _SERVER_ERRORS] + ["5xx"]
        on = [*statuses, *sorted(c.value for c in route.retry.on_conditions)]
        doc["retry"] = {"attempts": retry.pop("attempts"), "on": on, **retry}
    if route.rate_limit is not None:
        doc["rate_limit"]["rate"] = _rate_text(route.rate_limit.rate)
    return doc


def _rate_text(per_s: float) -> str:
    """A rate parse_rate reads back as exactly `per_s`: whole per s, m or h if one is exact."""
    for unit in ("s", "m", "h"):
        count = round(per_s * _DURATION_UNITS[unit])
        if count and count / _DURATION_UNITS[unit] == per_s:
            return f"{count}/{unit}"
    # The shortest repr reads back exactly; "f" keeps it out of exponent form, which the
    # rate pattern does not take.
    return f"{format(Decimal(repr(per_s)), 'f')}/s"


def _dotted_text(paths: tuple[tuple[str, ...], ...]) -> list[str]:
    return [".".join(keys) for keys in paths]


# VendorProfile field -> its YAML form, where _plain's is not what the profile parser takes.
_PROFILE_SHOWN: dict[str, Callable[[Any], Any]] = {
    "query_locations": lambda locations: [{loc.kind: loc.field} for loc in locations],
    "results_paths": _dotted_text,
    "error_code_paths": _dotted_text,
}


def _profile_document(profile: VendorProfile) -> dict[str, Any]:
    """A profile as the keys of _PROFILE_PARSERS, written out in full (no `extends`)."""
    doc: dict[str, Any] = {}
    for key, (attr, _) in _PROFILE_PARSERS.items():
        value = getattr(profile, attr)
        if value is None or (attr == "error_code_paths" and not value):
            continue  # the default, and a value the parser has no spelling for
        doc[key] = _PROFILE_SHOWN.get(attr, _plain)(value)
    return doc

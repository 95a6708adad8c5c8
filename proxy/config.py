"""The YAML config, parsed once at start-up into frozen, typed objects.

Every error names the YAML path and the reason (`routes.tavily.timeouts.per_try: expected a
duration like 10s, got "ten"`). Unknown keys are errors: a typo must not silently disable a policy.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass, replace
from decimal import Decimal
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

from policies.breaker import BreakerConfig
from policies.cache import CacheConfig
from policies.core.outcome import RETRY_CONDITIONS, Outcome
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
from proxy.logs import SECRET_KEYS

T = TypeVar("T")

# Paths the proxy answers itself; no route may claim them.
RESERVED_PATHS = ("/healthz", "/readyz", "/metrics", "/admin", "/v1/search")
SECRET_HEADERS = frozenset(
    h.lower()
    for h in (
        "Authorization",
        "Proxy-Authorization",
        "X-API-KEY",
        "X-Subscription-Token",
        "Api-Key",
        "Cookie",
    )
)
# The words a retry `on:` list takes besides status codes.
RETRY_WORDS = ("429", "5xx", *RETRY_CONDITIONS)


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans: only true/false, so `on:` (retry.on) stays a key."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


class ConfigError(Exception):
    """A config problem, located by its YAML path."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason


class ConfigErrors(ConfigError):
    """Every problem found in one config, in the order found; str() gives one per line.

    `errors` holds them one by one. With a single error, `path` and `reason` are its own.
    """

    errors: tuple[ConfigError, ...]

    def __init__(self, errors: Iterable[ConfigError]) -> None:
        flat = tuple(
            single
            for error in errors
            for single in (error.errors if isinstance(error, ConfigErrors) else (error,))
        )
        if len(flat) == 1:
            super().__init__(flat[0].path, flat[0].reason)
        else:
            super().__init__("", "\n".join(str(error) for error in flat))
        self.errors = flat


class _Collector:
    """Gathers ConfigErrors so that parsing goes on past a bad part and one run reports them all."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    @contextmanager
    def part(self) -> Iterator[None]:
        """Run the block; a ConfigError in it is recorded and the rest of the block skipped."""
        try:
            yield
        except ConfigError as exc:
            self.errors.extend(exc.errors if isinstance(exc, ConfigErrors) else (exc,))

    def add(self, path: str, reason: str) -> None:
        self.errors.append(ConfigError(path, reason))

    def keys(
        self, raw: Any, path: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """The allowed keys of mapping `raw`; unknown or missing keys are recorded."""
        with self.part():
            _mapping(raw, path, allowed, required)
        return {k: v for k, v in raw.items() if k in allowed} if isinstance(raw, dict) else {}

    def parse(
        self, data: Mapping[str, Any], path: str, parsers: Mapping[str, Callable[[Any, str], Any]]
    ) -> dict[str, Any]:
        """Each key of `data` parsed by its parser; a key that fails is recorded and left out."""
        out: dict[str, Any] = {}
        for key, value in data.items():
            with self.part():
                out[key] = parsers[key](value, _join(path, key))
        return out

    def raise_any(self) -> None:
        if self.errors:
            raise ConfigErrors(self.errors)


# ---------------------------------------------------------------------------------------------
# The typed config


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 1024 * 1024
    shutdown_grace: float = 20.0
    admin_token: str | None = None
    upstream_connections: int = 256
    upstream_connections_per_host: int = 64
    keepalive_timeout: float = 15.0


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
class Timeouts:
    connect: float = 2.0
    per_try: float = 10.0
    total: float = 30.0


@dataclass(frozen=True)
class HeaderRules:
    set: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    remove: tuple[str, ...] = ()


@dataclass(frozen=True)
class RouteConfig:
    name: str
    prefix: str
    upstream: str
    strip_prefix: bool = True
    timeouts: Timeouts = Timeouts()
    headers: HeaderRules = HeaderRules()
    retry: RetryConfig | None = None
    rate_limit: RateLimitConfig | None = None
    breaker: BreakerConfig | None = None
    cache: CacheConfig | None = None
    search: SearchConfig | None = None


@dataclass(frozen=True)
class SearchApiConfig:
    providers: tuple[str, ...] = ()  # route names, in the order tried
    max_results: int = 5
    blocked_domains: tuple[str, ...] = ()
    blocked_extensions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config:
    routes: Mapping[str, RouteConfig]
    server: ServerConfig = ServerConfig()
    redis: RedisConfig | None = None
    log: LogConfig = LogConfig()
    search_api: SearchApiConfig = SearchApiConfig()
    profiles: Mapping[str, VendorProfile] = field(default_factory=lambda: MappingProxyType({}))


# ---------------------------------------------------------------------------------------------
# Scalars


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|m|h)\s*$")
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_ROUTE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def parse_duration(value: Any, path: str) -> float:
    """`250ms`, `10s`, `5m`, `1h` (or a bare number of seconds) to seconds."""
    if isinstance(value, bool):
        raise ConfigError(path, f"expected a duration like 10s, got {value!r}")
    if isinstance(value, int | float) and value >= 0:
        return float(value)
    m = _DURATION.match(value) if isinstance(value, str) else None
    if not m:
        raise ConfigError(path, f'expected a duration like 10s, got "{value}"')
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def parse_size(value: Any, path: str) -> int:
    """`1MiB`, `512KiB`, `2MB` (or a bare number of bytes) to bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if not m:
        raise ConfigError(path, f'expected a size like 1MiB, got "{value}"')
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


def parse_rate(value: Any, path: str) -> float:
    """`10/s`, `600/m`, `3600/h` to tokens per second."""
    m = _RATE.match(value) if isinstance(value, str) else None
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(path, f'expected a rate like 10/s or 600/m, got "{value}"')
    return float(m.group(1)) / _DURATION_UNITS[m.group(2)]


def _int(value: Any, path: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(path, f"expected a whole number >= {minimum}, got {value!r}")
    return value


def _float(value: Any, path: str, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ConfigError(path, f"expected a number >= {minimum}, got {value!r}")
    return float(value)


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(path, f"expected true or false, got {value!r}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"expected a non-empty string, got {value!r}")
    return value


def _choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(path, f"expected one of {', '.join(choices)}, got {value!r}")
    return value


def _str_list(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list of strings, got {value!r}")
    return tuple(_str(v, f"{path}[{i}]") for i, v in enumerate(value))


def _methods(value: Any, path: str) -> frozenset[str]:
    methods = _str_list(value, path)
    for i, m in enumerate(methods):
        if m.upper() not in {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"}:
            raise ConfigError(f"{path}[{i}]", f"expected an HTTP method, got {m!r}")
    return frozenset(m.upper() for m in methods)


def _mapping(
    value: Any, path: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()
) -> dict[str, Any]:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
    problems = [
        ConfigError(_join(path, str(key)), f"unknown key (allowed: {', '.join(allowed)})")
        for key in value
        if key not in allowed
    ]
    problems += [
        ConfigError(_join(path, key), "required key is missing")
        for key in required
        if key not in value
    ]
    if problems:
        raise ConfigErrors(problems)
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _fields(
    raw: Any,
    path: str,
    parsers: Mapping[str, Callable[[Any, str], Any]],
    required: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Mapping `raw` with each present key parsed by its parser; every bad key is reported."""
    collect = _Collector()
    kwargs = collect.parse(collect.keys(raw, path, tuple(parsers), required), path, parsers)
    collect.raise_any()
    return kwargs


def _section(
    raw: Any,
    path: str,
    cls: Callable[..., T],
    parsers: Mapping[str, Callable[[Any, str], Any]],
    required: tuple[str, ...] = (),
) -> T:
    """Build dataclass `cls` from mapping `raw`, parsing each present key with its parser."""
    return cls(**_fields(raw, path, parsers, required))


# ---------------------------------------------------------------------------------------------
# Sections


def _server(raw: Any, path: str) -> ServerConfig:
    return _section(
        raw,
        path,
        ServerConfig,
        {
            "host": _str,
            "port": lambda v, p: _int(v, p, 0),
            "max_body_bytes": parse_size,
            "shutdown_grace": parse_duration,
            "admin_token": _str,
            "upstream_connections": lambda v, p: _int(v, p, 1),
            "upstream_connections_per_host": lambda v, p: _int(v, p, 0),
            "keepalive_timeout": parse_duration,
        },
    )


def _redis(raw: Any, path: str) -> RedisConfig:
    cfg = _section(
        raw,
        path,
        RedisConfig,
        {"url": _str, "key_prefix": _str, "timeout": parse_duration},
    )
    if urlsplit(cfg.url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(_join(path, "url"), f"expected a redis:// URL, got {cfg.url!r}")
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


def _timeouts(raw: Any, path: str) -> Timeouts:
    t = _section(
        raw,
        path,
        Timeouts,
        {"connect": parse_duration, "per_try": parse_duration, "total": parse_duration},
    )
    if t.per_try > t.total:
        raise ConfigError(_join(path, "per_try"), "must not exceed timeouts.total")
    return t


def _headers(raw: Any, path: str) -> HeaderRules:
    data = _mapping(raw, path, ("set", "remove"))
    set_raw = _mapping(data.get("set"), _join(path, "set"), tuple(data.get("set") or {}))
    for name, value in set_raw.items():
        if not _HEADER_NAME.match(str(name)):
            raise ConfigError(_join(path, f"set.{name}"), "not a valid header name")
        if not isinstance(value, str) or "\n" in value or "\r" in value:
            raise ConfigError(_join(path, f"set.{name}"), "expected a one-line string value")
    remove = _str_list(data.get("remove", []), _join(path, "remove"))
    return HeaderRules(set=MappingProxyType(dict(set_raw)), remove=remove)


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


_RETRY_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "attempts": lambda v, p: _int(v, p, 1),
    "on": _retry_on,
    "backoff": lambda v, p: _section(
        v,
        p,
        BackoffConfig,
        {
            "initial": parse_duration,
            "max": parse_duration,
            "multiplier": lambda v, p: _float(v, p, 1.0),
            "jitter": lambda v, p: _choice(v, p, ("full", "decorrelated", "none")),
        },
    ),
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
            "burst": lambda v, p: _int(v, p, 1),
            "key": lambda v, p: _choice(v, p, ("route", "client")),
            "client_header": _str,
            "max_wait": parse_duration,
        },
        required=("rate", "burst"),
    )
    return cfg


def _breaker(raw: Any, path: str) -> BreakerConfig:
    return _section(
        raw,
        path,
        BreakerConfig,
        {
            "fail_max": lambda v, p: _int(v, p, 1),
            "reset_timeout": parse_duration,
            "success_threshold": lambda v, p: _int(v, p, 1),
            "half_open_probes": lambda v, p: _int(v, p, 1),
        },
    )


def _cache(raw: Any, path: str) -> CacheConfig:
    return _section(
        raw,
        path,
        CacheConfig,
        {
            "ttl": parse_duration,
            "stale_ttl": parse_duration,
            "max_entry_bytes": parse_size,
            "methods": _methods,
            "ignore_body_fields": _str_list,
            "shared": _bool,
            "max_entries": lambda v, p: _int(v, p, 1),
            "max_bytes": parse_size,
            "lock_wait": parse_duration,
        },
    )


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


def _upstream(value: Any, path: str) -> str:
    url = _str(value, path)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(path, f"expected an http(s) URL like https://api.tavily.com, got {url!r}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(path, "must not carry a query, fragment or credentials")
    return url.rstrip("/")


def _prefix(value: Any, path: str) -> str:
    prefix = _str(value, path)
    if not prefix.startswith("/") or prefix == "/" or "//" in prefix or prefix.endswith("/"):
        raise ConfigError(path, f"expected a path like /tavily (no trailing slash), got {prefix!r}")
    if any(seg in (".", "..") for seg in prefix.split("/")) or "%" in prefix:
        raise ConfigError(path, f"must not contain dot segments or percent-escapes: {prefix!r}")
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
    "timeouts": _timeouts,
    "headers": _headers,
    "retry": _retry,
    "rate_limit": _rate_limit,
    "breaker": _breaker,
    "cache": _cache,
    "search": _search,
}


def _route_sections(name: str, raw: Any, path: str, collect: _Collector) -> dict[str, Any]:
    """The sections of one route that parse; each bad one is recorded with its own errors."""
    if not _ROUTE_NAME.match(str(name)):
        collect.add(path, "route names are lower-case letters, digits, - and _")
    data = collect.keys(raw, path, tuple(_ROUTE_PARSERS), required=("prefix", "upstream"))
    return collect.parse(data, path, _ROUTE_PARSERS)


def _search_api(raw: Any, path: str) -> SearchApiConfig:
    return _section(
        raw,
        path,
        SearchApiConfig,
        {
            "providers": _str_list,
            "max_results": lambda v, p: _int(v, p, 1),
            "blocked_domains": _str_list,
            "blocked_extensions": _str_list,
        },
    )


# ---------------------------------------------------------------------------------------------
# Vendor profiles


def _optional(parse: Callable[[Any, str], T]) -> Callable[[Any, str], T | None]:
    """`parse`, but null is accepted too: it clears a value the extended profile set."""
    return lambda value, path: None if value is None else parse(value, path)


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


def _status(value: Any, path: str) -> int:
    # YAML reads the key of `{404: [...]}` as an int but of `{"404": [...]}` as a string.
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 100 <= value <= 599:
        raise ConfigError(path, f"expected an HTTP status code (100-599), got {value!r}")
    return value


def _statuses(value: Any, path: str) -> frozenset[int]:
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list of status codes, got {value!r}")
    return frozenset(_status(s, f"{path}[{i}]") for i, s in enumerate(value))


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
            profiles[name] = _profile(name, body, _join("profiles", str(name)))
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
    )


_TOP_LEVEL_KEYS = ("server", "redis", "log", "routes", "search_api", "profiles")
_SECTION_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "server": _server,
    "redis": _optional(_redis),
    "log": _log,
    "search_api": _search_api,
}


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a YAML file; every failure is a ConfigError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("", f"cannot read config {path}: {exc.strerror}") from None
    try:
        raw = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            "", f"{path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}"
        ) from None
    return parse_config(raw, env)


# ---------------------------------------------------------------------------------------------
# Showing the effective config

REDACTED = "<redacted>"


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
    doc["routes"] = {name: _route_document(route) for name, route in config.routes.items()}
    custom = {
        name: _profile_document(profile)
        for name, profile in config.profiles.items()
        if BUILTIN_PROFILES.get(name) != profile
    }
    if custom:
        doc["profiles"] = custom
    return doc


def redacted(config: Config) -> dict[str, Any]:
    """`as_document(config)` with secrets replaced by "<redacted>", a placeholder to fill in."""
    doc = as_document(config)
    if "admin_token" in doc["server"]:
        doc["server"]["admin_token"] = REDACTED
    if "redis" in doc:
        parts = urlsplit(doc["redis"]["url"])
        if parts.password:
            netloc = parts.netloc.replace(f":{parts.password}@", f":{REDACTED}@")
            doc["redis"]["url"] = parts._replace(netloc=netloc).geturl()
    for route in doc["routes"].values():
        _redact_keys(route["headers"]["set"], SECRET_HEADERS)
    for profile in doc.get("profiles", {}).values():
        _redact_keys(profile.get("search_headers", {}), SECRET_HEADERS)
        _redact_keys(profile.get("search_extra", {}), SECRET_KEYS)
    return doc


def _redact_keys(mapping: dict[str, Any], secret: frozenset[str]) -> None:
    for key in mapping:
        if key.lower() in secret:
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

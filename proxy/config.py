"""The YAML config, parsed once at start-up into frozen, typed objects.

Every error names the YAML path and the reason (`routes.tavily.timeouts.per_try: expected a
duration like 10s, got "ten"`). Unknown keys are errors: a typo must not silently disable a policy.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
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
    for key in value:
        if key not in allowed:
            raise ConfigError(_join(path, str(key)), f"unknown key (allowed: {', '.join(allowed)})")
    for key in required:
        if key not in value:
            raise ConfigError(_join(path, key), "required key is missing")
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _section(
    raw: Any,
    path: str,
    cls: type[T],
    parsers: Mapping[str, Callable[[Any, str], Any]],
    required: tuple[str, ...] = (),
) -> T:
    """Build dataclass `cls` from mapping `raw`, parsing each present key with its parser."""
    data = _mapping(raw, path, tuple(parsers), required)
    kwargs = {key: parsers[key](value, _join(path, key)) for key, value in data.items()}
    return cls(**kwargs)


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


def _retry(raw: Any, path: str) -> RetryConfig:
    data = _mapping(raw, path, ("attempts", "on", "backoff", "retry_after", "budget", "methods"))
    kwargs: dict[str, Any] = {}
    if "attempts" in data:
        kwargs["attempts"] = _int(data["attempts"], _join(path, "attempts"), 1)
    if "on" in data:
        kwargs["on_statuses"], kwargs["on_conditions"] = _retry_on(data["on"], _join(path, "on"))
    if "backoff" in data:
        kwargs["backoff"] = _section(
            data["backoff"],
            _join(path, "backoff"),
            BackoffConfig,
            {
                "initial": parse_duration,
                "max": parse_duration,
                "multiplier": lambda v, p: _float(v, p, 1.0),
                "jitter": lambda v, p: _choice(v, p, ("full", "decorrelated", "none")),
            },
        )
    if "retry_after" in data:
        kwargs["retry_after"] = _section(
            data["retry_after"],
            _join(path, "retry_after"),
            RetryAfterConfig,
            {"honor": _bool, "max_wait": parse_duration},
        )
    if "budget" in data:
        kwargs["budget"] = _section(
            data["budget"],
            _join(path, "budget"),
            BudgetConfig,
            {"ratio": _float, "min_per_s": lambda v, p: _int(v, p, 0)},
        )
    if "methods" in data:
        kwargs["methods"] = _methods(data["methods"], _join(path, "methods"))
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


def _route(name: str, raw: Any, path: str) -> RouteConfig:
    if not _ROUTE_NAME.match(str(name)):
        raise ConfigError(path, "route names are lower-case letters, digits, - and _")
    data = _mapping(raw, path, tuple(_ROUTE_PARSERS), required=("prefix", "upstream"))
    kwargs = {k: _ROUTE_PARSERS[k](v, _join(path, k)) for k, v in data.items()}
    return RouteConfig(name=name, **kwargs)


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
    data = _mapping(raw, path, ("extends", *_PROFILE_PARSERS))
    kwargs = {
        attr: parse(data[key], _join(path, key))
        for key, (attr, parse) in _PROFILE_PARSERS.items()
        if key in data
    }
    base: VendorProfile | None = None
    if "extends" in data:
        builtin = _choice(data["extends"], _join(path, "extends"), tuple(sorted(BUILTIN_PROFILES)))
        base = BUILTIN_PROFILES[builtin]
    else:
        for key in ("query", "results"):
            if key not in data:
                raise ConfigError(_join(path, key), "required key is missing (or use extends)")
    try:
        if base is not None:
            return replace(base, name=name, **kwargs)
        return VendorProfile(name=name, **kwargs)
    except ProfileError as exc:  # a rule across keys, e.g. a GET search needs a query location
        raise ConfigError(_join(path, exc.key), exc.reason) from None


def _profiles(raw: Any, path: str) -> dict[str, VendorProfile]:
    data = _mapping(raw, path, tuple(raw) if isinstance(raw, dict) else ())
    return {name: _profile(name, body, _join(path, str(name))) for name, body in data.items()}


# ---------------------------------------------------------------------------------------------
# Whole documents


def interpolate(node: Any, env: Mapping[str, str], path: str = "") -> Any:
    """Replace `${VAR}` (or `${VAR:-default}`) in every string; a missing variable is an error."""
    if isinstance(node, dict):
        return {k: interpolate(v, env, _join(path, str(k))) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env, f"{path}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:

        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            raise ConfigError(path, f"environment variable {name} is not set")

        return _ENV.sub(sub, node)
    return node


def parse_config(raw: Any, env: Mapping[str, str] | None = None) -> Config:
    """Validate a YAML document (already loaded) into a Config."""
    env = os.environ if env is None else env
    data = _mapping(
        interpolate(raw, env),
        "",
        ("server", "redis", "log", "routes", "search_api", "profiles"),
        required=("routes",),
    )
    profiles = {**BUILTIN_PROFILES, **_profiles(data.get("profiles"), "profiles")}

    routes_raw = data["routes"]
    if not isinstance(routes_raw, dict) or not routes_raw:
        raise ConfigError("routes", "expected a mapping of at least one route")
    routes = {name: _route(name, body, f"routes.{name}") for name, body in routes_raw.items()}
    seen: dict[str, str] = {}
    for route in routes.values():
        if route.prefix in seen:
            raise ConfigError(
                f"routes.{route.name}.prefix",
                f"{route.prefix!r} is already the prefix of route {seen[route.prefix]!r}",
            )
        seen[route.prefix] = route.name
        if route.search and route.search.vendor not in profiles:
            raise ConfigError(
                f"routes.{route.name}.search.vendor",
                f"unknown vendor {route.search.vendor!r} (known: {', '.join(sorted(profiles))})",
            )

    search_api = _search_api(data.get("search_api"), "search_api")
    for i, provider in enumerate(search_api.providers):
        named = routes.get(provider)
        if named is None or named.search is None:
            raise ConfigError(
                f"search_api.providers[{i}]",
                f"{provider!r} is not a route with a search section",
            )
    if not search_api.providers:
        ordered = tuple(r.name for r in routes.values() if r.search is not None)
        search_api = SearchApiConfig(
            providers=ordered,
            max_results=search_api.max_results,
            blocked_domains=search_api.blocked_domains,
            blocked_extensions=search_api.blocked_extensions,
        )

    return Config(
        routes=MappingProxyType(routes),
        server=_server(data.get("server"), "server"),
        redis=_redis(data["redis"], "redis") if data.get("redis") is not None else None,
        log=_log(data.get("log"), "log"),
        search_api=search_api,
        profiles=MappingProxyType(profiles),
    )


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


def redacted(config: Config) -> dict[str, Any]:
    """The effective config as plain data, with secrets replaced by "<redacted>"."""

    def plain(obj: Any) -> Any:
        if is_dataclass(obj):
            return {f.name: plain(getattr(obj, f.name)) for f in fields(obj)}
        if isinstance(obj, Mapping):
            return {str(k): plain(v) for k, v in obj.items()}
        if isinstance(obj, Enum):
            return obj.value
        if isinstance(obj, frozenset):
            return sorted(plain(v) for v in obj)
        if isinstance(obj, tuple | list):
            return [plain(v) for v in obj]
        return obj

    data: dict[str, Any] = plain(config)
    data.pop("profiles", None)
    data["profiles"] = sorted(config.profiles)
    if data["server"].get("admin_token"):
        data["server"]["admin_token"] = "<redacted>"
    if data.get("redis"):
        parts = urlsplit(data["redis"]["url"])
        if parts.password:
            netloc = parts.netloc.replace(f":{parts.password}@", ":<redacted>@")
            data["redis"]["url"] = parts._replace(netloc=netloc).geturl()
    for route in data["routes"].values():
        header_set = route["headers"]["set"]
        for name in header_set:
            if name.lower() in SECRET_HEADERS:
                header_set[name] = "<redacted>"
    return data

"""The document's own sections (server, redis, log, clients, search_api, mcp_server): what the
server is, as frozen dataclasses with their parsers. Routes and their policies are elsewhere."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from policies.core.profile import VendorProfile
from policies.core.route import RouteConfig
from policies.core.settings import (
    Collector,
    ConfigError,
    any_keys,
    boolean,
    fields,
    host,
    join,
    one_line,
    one_of,
    parse_duration,
    parse_size,
    port,
    positive_duration,
    section,
    text,
    texts,
    whole_in,
)
from proxy.config.routes import name_problem, parse_prefix
from proxy.redact import redact_url

# The most providers `mode: merge` asks at once: every configured vendor, with room to spare.
MAX_MERGED = 20
# Upper bounds of search_api.max_batch and max_calls_per_request: a batch is answered in one
# response, and every call it makes holds an upstream connection.
MAX_BATCH_LIMIT = 100
MAX_CALLS_LIMIT = 10_000


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
    merge_providers: int = 3  # `mode: merge` asks this many providers at once


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


def parse_server(raw: Any, path: str) -> ServerConfig:
    return section(
        raw,
        path,
        ServerConfig,
        {
            "host": host,
            "port": port,
            "max_body_bytes": parse_size,
            "shutdown_grace": parse_duration,
            "admin_token": text,
            "admin_host": host,
            "admin_port": port,
            "upstream_connections": whole_in(1),
            "upstream_connections_per_host": whole_in(0),
            "keepalive_timeout": parse_duration,
            "header_timeout": positive_duration,
            "body_timeout": positive_duration,
            "send_timeout": positive_duration,
            "client_keepalive_timeout": positive_duration,
            "max_connections": whole_in(1),
        },
    )


def parse_redis(raw: Any, path: str) -> RedisConfig:
    cfg = section(
        raw,
        path,
        RedisConfig,
        {"url": text, "key_prefix": text, "timeout": positive_duration},
    )
    where = join(path, "url")
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


def parse_log(raw: Any, path: str) -> LogConfig:
    return section(
        raw,
        path,
        LogConfig,
        {
            "level": one_of("debug", "info", "warning", "error"),
            "format": one_of("json", "console"),
        },
    )


def _client(name: Any, raw: Any, path: str) -> ClientConfig:
    problem = name_problem(name, "client")
    if problem is not None:
        raise ConfigError(path, problem)
    if isinstance(raw, str):  # `name: ${TOKEN}`, the short form
        raw = {"token": raw}
    parsers = {"token": one_line, "daily_requests": whole_in(1)}
    return ClientConfig(name=name, **fields(raw, path, parsers, required=("token",)))


def parse_clients(raw: Any, path: str) -> Mapping[str, ClientConfig]:
    """`clients:`: name -> token (or {token, daily_requests}); each bad client is reported."""
    given = any_keys(raw, path)
    collect = Collector()
    clients: dict[str, ClientConfig] = {}
    for name, body in given.items():
        with collect.part():
            clients[name] = _client(name, body, join(path, str(name)))
    collect.raise_any()
    return MappingProxyType(clients)


def parse_search_api(raw: Any, path: str) -> SearchApiConfig:
    cfg = section(
        raw,
        path,
        SearchApiConfig,
        {
            "providers": texts,
            "max_results": whole_in(1),
            "blocked_domains": texts,
            "blocked_extensions": texts,
            "max_batch": whole_in(1, MAX_BATCH_LIMIT),
            "max_providers": whole_in(1),
            "max_calls_per_request": whole_in(1, MAX_CALLS_LIMIT),
            "merge_providers": whole_in(2, MAX_MERGED),
        },
    )
    if cfg.max_calls_per_request < cfg.max_batch:
        given = raw if isinstance(raw, dict) else {}
        where = "max_calls_per_request" if "max_calls_per_request" in given else "max_batch"
        raise ConfigError(
            join(path, where),
            f"max_calls_per_request ({cfg.max_calls_per_request}) must be at least max_batch "
            f"({cfg.max_batch}): a full batch needs one vendor call per query",
        )
    return cfg


def _mcp_path(value: Any, path: str) -> str:
    """Where the MCP server is served: a path like a route prefix, off the proxy's own paths."""
    given = text(value, path)
    if not given.startswith("/") or given == "/" or given.endswith("/") or "//" in given:
        raise ConfigError(
            path, f"expected a path like /mcp (starting with /, no trailing slash), got {given!r}"
        )
    if given == "/v1" or given.startswith("/v1/"):
        raise ConfigError(
            path, f"{given!r} is under /v1, which the proxy keeps for its own API; use e.g. /mcp"
        )
    return parse_prefix(given, path)  # a route prefix's characters, and off the reserved paths


def parse_mcp_server(raw: Any, path: str) -> dict[str, Any]:
    """`mcp_server:` as McpServerConfig's fields; an unset `enabled` is resolved by
    parse_config (on when there is a search provider)."""
    return fields(raw, path, {"enabled": boolean, "path": _mcp_path, "allow_remote": boolean})


def mcp_server_config(
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

"""The document's own sections (server, redis, log, clients, search_api, mcp_server): what the
server is, as frozen dataclasses with their parsers. Routes and their policies are elsewhere."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from policies.core.profile import VendorProfile
from policies.core.redisconfig import (
    DEFAULT_URL,
    ClusterNodes,
    RedisConfig,
    RedisTls,
    SentinelService,
    host_port,
)
from policies.core.route import RouteConfig
from policies.core.settings import (
    Collector,
    ConfigError,
    any_keys,
    boolean,
    duration_at_most,
    fields,
    host,
    is_host,
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
    whole,
    whole_in,
)
from proxy.config.fetch import FetchApiConfig
from proxy.config.routes import name_problem, parse_prefix
from proxy.cores import parse_workers
from proxy.loops import parse_event_loop
from proxy.redact import redact_url

# A tool call the proxy answers itself: past ten minutes no MCP client is still waiting.
MAX_CALL_TIMEOUT = 600.0
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
    # Every body held in memory at once: agents' bodies, buffered answers (proxy/budget.py).
    max_buffered_bytes: int = 32 * 1024 * 1024
    shutdown_grace: float = 20.0
    admin_token: str | None = None
    # The admin endpoints' own listener; off loopback only with admin_token (proxy/admin.py).
    admin_host: str = "127.0.0.1"
    admin_port: int = 8081
    # Without a token: Host names the admin endpoints answer besides loopback ones.
    admin_names: tuple[str, ...] = ()
    upstream_connections: int = 256
    upstream_connections_per_host: int = 64
    keepalive_timeout: float = 15.0  # the upstream pool's idle connections
    # Limits on agents' connections (nginx's defaults; see proxy/guard.py).
    header_timeout: float = 60.0
    body_timeout: float = 60.0
    request_timeout: float = 60.0  # the request line, headers and whole body
    send_timeout: float = 60.0
    client_keepalive_timeout: float = 75.0
    max_connections: int = 1000
    max_connections_per_peer: int | None = None  # None: half of max_connections
    # Reload when the config file changes (proxy/reload.py); SIGHUP and POST /admin/reload
    # reload whatever this says.
    watch_config: bool = True
    # The event loop: uvloop when it is installed (auto), or the one named (proxy/loops.py).
    event_loop: str = "auto"
    # Processes serving the port (SO_REUSEPORT), or `auto`: one per CPU (proxy/supervisor.py).
    workers: int | str = 1


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
    # One web_search call, every provider attempt included: well under the 60 s MCP clients
    # wait by default, so the agent reads the proxy's answer rather than its own timeout.
    call_timeout: float = 25.0


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
    fetch_api: FetchApiConfig = field(default_factory=FetchApiConfig)


def parse_server(raw: Any, path: str) -> ServerConfig:
    cfg = section(
        raw,
        path,
        ServerConfig,
        {
            "host": host,
            "port": port,
            "max_body_bytes": parse_size,
            "max_buffered_bytes": lambda v, p: whole(parse_size(v, p), p, 1),
            "shutdown_grace": parse_duration,
            "admin_token": text,
            "admin_host": host,
            "admin_port": port,
            "admin_names": _names,
            "upstream_connections": whole_in(1),
            "upstream_connections_per_host": whole_in(0),
            "keepalive_timeout": parse_duration,
            "header_timeout": positive_duration,
            "body_timeout": positive_duration,
            "request_timeout": positive_duration,
            "send_timeout": positive_duration,
            "client_keepalive_timeout": positive_duration,
            "max_connections": whole_in(1),
            "max_connections_per_peer": whole_in(1),
            "watch_config": boolean,
            "event_loop": parse_event_loop,
            "workers": parse_workers,
        },
    )
    if cfg.max_body_bytes > cfg.max_buffered_bytes:
        given = raw if isinstance(raw, dict) else {}
        where = "max_body_bytes" if "max_body_bytes" in given else "max_buffered_bytes"
        raise ConfigError(
            join(path, where),
            f"max_body_bytes ({cfg.max_body_bytes}) is more than the process may hold of all "
            f"bodies at once, max_buffered_bytes ({cfg.max_buffered_bytes}): no such body "
            "could ever be read; lower max_body_bytes",
        )
    per_peer = cfg.max_connections_per_peer
    if per_peer is not None and per_peer > cfg.max_connections:
        raise ConfigError(
            join(path, "max_connections_per_peer"),
            f"{per_peer} is more than server.max_connections ({cfg.max_connections}): one "
            "address could take every connection; lower it, or leave it out (half of "
            "max_connections)",
        )
    return cfg


def _names(value: Any, path: str) -> tuple[str, ...]:
    """Host names (DNS names or addresses), as a Host header would carry them."""
    found = texts(value, path)
    for i, name in enumerate(found):
        host(name, f"{path}[{i}]")
    return found


def parse_redis(raw: Any, path: str) -> RedisConfig:
    """`redis:`: one server by `url` (the default), `sentinel` or `cluster`, exactly one."""
    parsers = {
        "url": text,
        "sentinel": _sentinel,
        "cluster": _cluster,
        "username": one_line,
        "password": one_line,
        "tls": _tls,
        "key_prefix": text,
        "timeout": positive_duration,
        "max_connections": whole_in(1, 1024),
    }
    values = fields(raw, path, parsers)
    chosen = [k for k in ("url", "sentinel", "cluster") if k in values]
    if len(chosen) > 1:
        raise ConfigError(
            join(path, chosen[1]),
            f"give one of url, sentinel and cluster, not {' and '.join(chosen)}",
        )
    cfg = RedisConfig(**values) if chosen else RedisConfig(url=DEFAULT_URL, **values)
    if cfg.username is not None and cfg.password is None:
        raise ConfigError(join(path, "username"), "an ACL user needs its password too")
    if cfg.url is not None:
        _check_url(cfg, join(path, "url"))
    return cfg


def _check_url(cfg: RedisConfig, where: str) -> None:
    url = cfg.url
    assert url is not None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # `redis://[::1`, a port out of range or not a number
        raise ConfigError(where, f"{exc}: {redact_url(url)!r}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(where, f"expected a redis:// URL, got {redact_url(url)!r}")
    if port == 0:
        raise ConfigError(where, f"port must be from 1 to 65535: {redact_url(url)!r}")
    if cfg.tls is not None and parts.scheme != "rediss":
        raise ConfigError(where, f"with tls, use a rediss:// URL, got {redact_url(url)!r}")
    if cfg.password is not None and (parts.password or "password=" in parts.query):
        raise ConfigError(where, "the URL has a password and so has redis.password: keep one")


def _address(value: Any, path: str) -> str:
    """`host:port` of a Redis node or sentinel."""
    found = text(value, path)
    try:
        name, number = host_port(found, 0)
    except ValueError:
        name, number = "", 0
    if not is_host(name) or not 1 <= number <= 65535:
        raise ConfigError(path, f"expected host:port, got {found!r}")
    return found


def _addresses(value: Any, path: str) -> tuple[str, ...]:
    found = texts(value, path)
    if not found:
        raise ConfigError(path, "expected at least one host:port")
    return tuple(_address(v, f"{path}[{i}]") for i, v in enumerate(found))


def _sentinel(raw: Any, path: str) -> SentinelService:
    parsers = {
        "hosts": _addresses,
        "service": one_line,
        "db": whole_in(0, 65535),
        "username": one_line,
        "password": one_line,
    }
    cfg = section(raw, path, SentinelService, parsers, required=("hosts", "service"))
    if cfg.username is not None and cfg.password is None:
        raise ConfigError(join(path, "username"), "an ACL user needs its password too")
    return cfg


def _cluster(raw: Any, path: str) -> ClusterNodes:
    return section(raw, path, ClusterNodes, {"nodes": _addresses}, required=("nodes",))


def _readable(value: Any, path: str) -> str:
    """A file start-up can read (a certificate or a key)."""
    found = text(value, path)
    if not os.path.isfile(found) or not os.access(found, os.R_OK):
        raise ConfigError(path, f"no readable file at {found!r}")
    return found


def _tls(raw: Any, path: str) -> RedisTls | None:
    """`tls: true`, or the files: `{ca_file, cert_file, key_file, check_hostname}`."""
    if not isinstance(raw, dict):
        try:
            return RedisTls() if boolean(raw, path) else None
        except ConfigError:
            raise ConfigError(path, f"expected true, false or a mapping, got {raw!r}") from None
    parsers = {
        "ca_file": _readable,
        "cert_file": _readable,
        "key_file": _readable,
        "check_hostname": boolean,
    }
    cfg = section(raw, path, RedisTls, parsers)
    if (cfg.cert_file is None) != (cfg.key_file is None):
        missing = "key_file" if cfg.key_file is None else "cert_file"
        raise ConfigError(
            join(path, missing), "a client certificate needs both cert_file and key_file"
        )
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
    return fields(
        raw,
        path,
        {
            "enabled": boolean,
            "path": _mcp_path,
            "allow_remote": boolean,
            "call_timeout": duration_at_most(MAX_CALL_TIMEOUT),
        },
    )


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

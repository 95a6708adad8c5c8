"""A whole config document: its sections, custom profiles and routes parsed independently so one
ConfigErrors reports every mistake, then what they say of one another checked among the parts
that parsed (a broken part is reported once, not again by whatever names it)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from policies import faults, keypool, ratelimit, search
from policies.core.redisconfig import RedisConfig
from policies.core.route import HeaderRules, RouteConfig
from policies.core.settings import Collector, ConfigError, ConfigErrors, Parser, any_keys, join
from policies.profiles import BUILTIN_PROFILES
from policies.vendors.custom import parse_profile
from proxy.config.fetch import FetchApiConfig, fetch_api_config, parse_fetch_api
from proxy.config.loading import DuplicateKeys, interpolate_into, read_document
from proxy.config.routes import check_references, check_routes, parse_route, route_config
from proxy.config.sections import (
    Config,
    LogConfig,
    McpServerConfig,
    SearchApiConfig,
    ServerConfig,
    mcp_server_config,
    parse_clients,
    parse_log,
    parse_mcp_server,
    parse_redis,
    parse_search_api,
    parse_server,
)
from proxy.cores import AUTO

TOP_LEVEL_KEYS = (
    "server",
    "redis",
    "log",
    "routes",
    "search_api",
    "profiles",
    "clients",
    "mcp_server",
    "fetch_api",
)
_SECTION_PARSERS: dict[str, Parser] = {
    "server": parse_server,
    "redis": lambda v, p: None if v is None else parse_redis(v, p),
    "log": parse_log,
    "search_api": parse_search_api,
    "clients": parse_clients,
    "mcp_server": parse_mcp_server,
    "fetch_api": parse_fetch_api,
}


class InvalidConfig(ConfigErrors):
    """Every mistake of a config that parsed as a document. `partial` holds what parsed (the
    sections and routes without errors), for the checks made after parsing (start-up's tokens)
    to report in the same run."""

    def __init__(self, errors: list[ConfigError], partial: Config) -> None:
        super().__init__(errors)
        self.partial = partial


def load_config(
    path: str | Path, env: Mapping[str, str] | None = None, data: bytes | None = None
) -> Config:
    """Read and validate a YAML file (its bytes `data` when already read); every failure is a
    ConfigError, and every mistake of a document YAML can read (repeated keys included) is
    reported together, as InvalidConfig."""
    try:
        raw, repeated = read_document(path, data), []
    except DuplicateKeys as exc:
        raw, repeated = exc.document, list(exc.errors)
    try:
        config = parse_config(raw, env)
    except InvalidConfig as exc:
        raise InvalidConfig([*repeated, *exc.errors], exc.partial) from None
    if repeated:
        raise InvalidConfig(repeated, config)
    return config


def parse_config(raw: Any, env: Mapping[str, str] | None = None) -> Config:
    """Validate a YAML document (already loaded) into a Config."""
    env = os.environ if env is None else env
    collect = Collector()
    sources: dict[str, tuple[str, ...]] = {}
    doc = interpolate_into(raw, env, "", collect, sources)
    interpolated = len(collect.errors)
    unset = {error.path for error in collect.errors}
    data = collect.keys(doc, "", TOP_LEVEL_KEYS, required=("routes",))
    sections = collect.parse(
        {k: v for k, v in data.items() if k in _SECTION_PARSERS}, "", _SECTION_PARSERS
    )

    profiles = dict(BUILTIN_PROFILES)
    profiles_raw: dict[Any, Any] = {}
    with collect.part():
        profiles_raw = any_keys(data.get("profiles"), "profiles")
    for name, body in profiles_raw.items():
        with collect.part():
            where = join("profiles", str(name))
            if not isinstance(name, str):
                hint = f'quote it, as in "{name}":'
                raise ConfigError(where, f"a profile name must be a string: {hint}")
            profiles[name] = parse_profile(name, body, where)
    vendors = profiles.keys() | profiles_raw.keys()  # a broken profile has its own errors

    routes_raw = data.get("routes", {})
    if "routes" in data and (not isinstance(routes_raw, dict) or not routes_raw):
        collect.add("routes", "expected a mapping of at least one route")
        routes_raw = {}
    routes: dict[str, RouteConfig] = {}
    broken: dict[str, dict[str, Any]] = {}  # the parts that parsed of routes that did not
    seen: dict[str, str] = {}
    for name, body in routes_raw.items():
        before = len(collect.errors)
        parts = parse_route(name, body, f"routes.{name}", collect)
        if "headers" in parts:
            parts["headers"] = _with_variables(parts["headers"], f"routes.{name}", sources)
        if len(collect.errors) == before:
            routes[name] = route_config(name, parts)
        else:
            broken[name] = parts
        # Checked on the sections that parsed, even when the route's others did not.
        prefix, searching = parts.get("prefix"), parts.get(search.SECTION.key)
        if prefix in seen:
            collect.add(
                f"routes.{name}.prefix",
                f"{prefix!r} is already the prefix of route {seen[prefix]!r}",
            )
        elif prefix is not None:
            seen[prefix] = name
        if searching is not None and searching.vendor not in vendors:
            collect.add(
                f"routes.{name}.search.vendor",
                f"unknown vendor {searching.vendor!r} (known: {', '.join(sorted(profiles))})",
            )
    collect.errors += check_routes(routes, routes_raw)
    collect.errors += check_references(broken, routes, routes_raw)

    search_api = sections.get("search_api", SearchApiConfig())
    for i, provider in enumerate(search_api.providers):
        named = routes.get(provider)
        if provider not in routes and provider in routes_raw:
            continue  # that route's own errors are reported
        if named is None or not named.has(search.SECTION.key):
            collect.add(
                f"search_api.providers[{i}]", f"{provider!r} is not a route with a search section"
            )
    if not search_api.providers:
        ordered = tuple(r.name for r in routes.values() if r.has(search.SECTION.key))
        search_api = replace(search_api, providers=ordered)

    collect.errors += _agent_sections(routes, profiles, data.get("clients"))
    if "server" in sections and ("redis" not in data or "redis" in sections):
        collect.errors += workers_need_redis(sections["server"].workers, sections.get("redis"))

    if data.get("clients"):  # checked even when a client is broken: it has its own errors
        for name, route in routes.items():
            limit = route.get(ratelimit.SECTION)
            if limit is not None and limit.client_header is not None:
                collect.add(
                    f"routes.{name}.rate_limit.client_header",
                    "with clients configured, per-client limits key on the client's name, "
                    "never on a header the caller chooses: remove client_header",
                )

    mcp_server = McpServerConfig(enabled=False)
    if "mcp_server" not in data or "mcp_server" in sections:  # a broken section has its errors
        mcp_server, problems = mcp_server_config(
            sections.get("mcp_server", {}), routes, search_api.providers
        )
        collect.errors += problems

    fetch_api = FetchApiConfig()
    if "fetch_api" not in data or "fetch_api" in sections:  # a broken section has its errors
        written = data.get("fetch_api")
        fetch_api, problems = fetch_api_config(
            sections.get("fetch_api", fetch_api),
            written if isinstance(written, dict) else {},
            routes,
            profiles,
            broken=routes_raw.keys() - routes.keys(),
        )
        collect.errors += problems

    # A value whose variable is unset is reported once, as unset, not also as malformed.
    found = [e for i, e in enumerate(collect.errors) if i < interpolated or e.path not in unset]
    config = Config(
        routes=MappingProxyType(routes),
        server=sections.get("server", ServerConfig()),
        redis=sections.get("redis"),
        log=sections.get("log", LogConfig()),
        search_api=search_api,
        profiles=MappingProxyType(profiles),
        clients=sections.get("clients", MappingProxyType({})),
        mcp_server=mcp_server,
        fetch_api=fetch_api,
    )
    if found:
        raise InvalidConfig(found, config)
    return config


def _with_variables(
    headers: HeaderRules, route: str, sources: Mapping[str, tuple[str, ...]]
) -> HeaderRules:
    """`headers` knowing, for each value set from the environment, the variable it read."""
    read = {
        name: found[0]
        for name in headers.set
        if (found := sources.get(f"{route}.headers.set.{name}"))
    }
    return replace(headers, variables=MappingProxyType(read)) if read else headers


def workers_need_redis(workers: int | str, redis: RedisConfig | None) -> list[ConfigError]:
    """Several workers without Redis would each hold the state a limit is counted in: refused at
    `server.workers`, saying why and what to set."""
    if workers == 1 or redis is not None:
        return []
    if workers == AUTO:
        who, times = "auto starts a worker per CPU, and without redis each would", "their number"
    else:
        who, times = f"{workers} workers without redis would each", str(workers)
    return [
        ConfigError(
            "server.workers",
            f"{who} keep rate limits, breakers, the cache and client quotas to themselves, "
            f"so a route limit of N would let {times} x N through: configure redis (a server all "
            "workers share; a local redis-server will do) or set workers: 1",
        )
    ]


def _agent_sections(
    routes: Mapping[str, RouteConfig], profiles: Mapping[str, Any], clients: Any
) -> list[ConfigError]:
    """What `keys` and `fault_injection` say of the rest of the document: a pool's keys go where
    its vendor takes one (and nothing else sets that header); injection's clients exist."""
    errors = []
    known = set(clients) if isinstance(clients, dict) else set()
    for name, route in routes.items():
        keys, searching = route.get(keypool.SECTION), route.get(search.SECTION)
        if keys is not None and searching is not None and searching.vendor in profiles:
            slot = profiles[searching.vendor].key_slot
            where = f"routes.{name}.keys"
            if slot is None:
                errors.append(ConfigError(where, f"{searching.vendor} takes no API key"))
            elif any(h.lower() == slot.name.lower() for h in route.headers.set):
                errors.append(
                    ConfigError(
                        where,
                        f"headers.set also sets {slot.name}, where the keys go: set the "
                        "keys in one place",
                    )
                )
        injection = route.get(faults.SECTION)
        for i, client in enumerate(injection.clients or () if injection else ()):
            if client not in known:
                errors.append(
                    ConfigError(
                        f"routes.{name}.fault_injection.clients[{i}]",
                        f"{client!r} is not a client under clients:",
                    )
                )
    return errors

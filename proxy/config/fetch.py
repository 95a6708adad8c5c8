"""The `fetch_api:` section (POST /v1/fetch, the MCP fetch_page tool): its providers and bounds,
the page cache and the direct fetcher, parsed alone, then checked against the routes (each
provider a route whose vendor has an extract API, or `direct`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from policies.core.profile import VendorProfile
from policies.core.route import RouteConfig
from policies.core.settings import (
    ConfigError,
    any_keys,
    boolean,
    fields,
    join,
    one_line,
    parse_size,
    positive_duration,
    section,
    text,
    texts,
    whole,
    whole_in,
)
from policies.fetch import parse_networks

DIRECT = "direct"  # the proxy's own fetcher, named among the providers
MAX_URLS_LIMIT = 100
MAX_PAGE_CHARS_LIMIT = 5_000_000
MAX_CALLS_LIMIT = 10_000
PAGE_TYPES = ("text/html", "application/xhtml+xml", "text/plain", "text/markdown")


@dataclass(frozen=True)
class DirectFetchConfig:
    """`fetch_api.direct`: the proxy fetching pages itself (proxy/direct.py)."""

    enabled: bool = False
    # Loopback and private networks too (tests, on-premise pages); never link-local.
    allow_private: bool = False
    allow_networks: tuple[str, ...] = ()  # CIDR blocks allowed whatever they are
    ports: tuple[int, ...] = (80, 443)  # URL ports fetched; empty: any
    max_redirects: int = 5
    timeout: float = 10.0  # one page, redirects, DNS and body included
    max_bytes: int = 2 * 1024 * 1024  # a page's body, decompressed
    content_types: tuple[str, ...] = PAGE_TYPES
    user_agent: str = "search-proxy/0.1 (page fetch for an AI agent)"
    max_parallel: int = 8  # pages fetched at once by this process


@dataclass(frozen=True)
class PageCacheConfig:
    """`fetch_api.cache`: pages by canonical URL and format, shared by every caller."""

    enabled: bool = True
    ttl: float = 3600.0
    stale_ttl: float = 86400.0
    max_entry_bytes: int = 1024 * 1024
    max_entries: int = 5000
    max_bytes: int = 32 * 1024 * 1024  # as a route cache's


@dataclass(frozen=True)
class FetchApiConfig:
    providers: tuple[str, ...] = ()  # route names (or `direct`), in the order tried per URL
    # Routes without a search section, by the vendor whose extract API they reach.
    vendors: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    max_urls: int = 10  # URLs one request may name
    max_chars: int = 20_000  # a page's content when the request does not say
    max_page_chars: int = 100_000  # the most a request may ask for; what the cache keeps
    max_calls_per_request: int = 50  # vendor calls, retries included, and direct fetches
    max_parallel: int = 4  # calls one request makes to one provider at once
    timeout: float = 60.0  # one request, every provider it tries included
    cache: PageCacheConfig = PageCacheConfig()
    direct: DirectFetchConfig = DirectFetchConfig()


def _networks(value: Any, path: str) -> tuple[str, ...]:
    given = texts(value, path)
    for i, block in enumerate(given):
        try:
            parse_networks([block])
        except ValueError as exc:
            raise ConfigError(
                f"{path}[{i}]", f"not a CIDR block like 10.1.2.0/24 ({exc})"
            ) from None
    return tuple(str(n) for n in parse_networks(given))


def _ports(value: Any, path: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ConfigError(
            path, f"expected a list of ports like [80, 443] ([] for any), got {value!r}"
        )
    return tuple(sorted({whole(v, f"{path}[{i}]", 1, 65535) for i, v in enumerate(value)}))


def _media_types(value: Any, path: str) -> tuple[str, ...]:
    given = texts(value, path)
    for i, media in enumerate(given):
        if media.count("/") != 1 or media != media.strip().lower() or ";" in media:
            raise ConfigError(
                f"{path}[{i}]", f"expected a media type like text/html, got {media!r}"
            )
    return given


def parse_direct(raw: Any, path: str) -> DirectFetchConfig:
    return section(
        raw,
        path,
        DirectFetchConfig,
        {
            "enabled": boolean,
            "allow_private": boolean,
            "allow_networks": _networks,
            "ports": _ports,
            "max_redirects": whole_in(0, 20),
            "timeout": positive_duration,
            "max_bytes": parse_size,
            "content_types": _media_types,
            "user_agent": one_line,
            "max_parallel": whole_in(1, 1000),
        },
    )


def parse_page_cache(raw: Any, path: str) -> PageCacheConfig:
    cfg = section(
        raw,
        path,
        PageCacheConfig,
        {
            "enabled": boolean,
            "ttl": positive_duration,
            "stale_ttl": positive_duration,
            "max_entry_bytes": parse_size,
            "max_entries": whole_in(1),
            "max_bytes": parse_size,
        },
    )
    if not 1 <= cfg.max_entry_bytes <= cfg.max_bytes:
        raise ConfigError(
            join(path, "max_entry_bytes"), f"must be from 1 byte to max_bytes ({cfg.max_bytes})"
        )
    return cfg


def _vendors(value: Any, path: str) -> Mapping[str, str]:
    given = any_keys(value, path)
    return MappingProxyType({str(k): text(v, join(path, str(k))) for k, v in given.items()})


def parse_fetch_api(raw: Any, path: str) -> FetchApiConfig:
    """`fetch_api:` alone; what it says of the routes is checked by `fetch_api_config`."""
    parsed = fields(
        raw,
        path,
        {
            "providers": texts,
            "vendors": _vendors,
            "max_urls": whole_in(1, MAX_URLS_LIMIT),
            "max_chars": whole_in(1, MAX_PAGE_CHARS_LIMIT),
            "max_page_chars": whole_in(1, MAX_PAGE_CHARS_LIMIT),
            "max_calls_per_request": whole_in(1, MAX_CALLS_LIMIT),
            "max_parallel": whole_in(1, 100),
            "timeout": positive_duration,
            "cache": parse_page_cache,
            "direct": parse_direct,
        },
    )
    cfg = FetchApiConfig(**parsed)
    if cfg.max_chars > cfg.max_page_chars:
        where = "max_chars" if "max_chars" in parsed else "max_page_chars"
        raise ConfigError(
            join(path, where),
            f"max_chars ({cfg.max_chars}) must not exceed max_page_chars ({cfg.max_page_chars})",
        )
    if cfg.max_calls_per_request < cfg.max_urls:
        raise ConfigError(
            join(path, "max_calls_per_request"),
            f"must be at least max_urls ({cfg.max_urls}): every URL may need a call of its own",
        )
    return cfg


def extract_vendor(
    name: str, route: RouteConfig, cfg: FetchApiConfig, profiles: Mapping[str, VendorProfile]
) -> VendorProfile | None:
    """The vendor whose extract API route `name` reaches: named in fetch_api.vendors, else its
    search vendor; None when it has neither."""
    vendor = cfg.vendors.get(name)
    if vendor is None and route.has("search"):
        vendor = route.section("search").vendor
    return profiles.get(vendor) if vendor is not None else None


def _readers(profiles: Mapping[str, VendorProfile]) -> str:
    return ", ".join(sorted(n for n, p in profiles.items() if p.extract is not None))


def _provider_problem(
    name: str, cfg: FetchApiConfig, routes: Mapping[str, RouteConfig], profiles: Mapping[str, Any]
) -> str | None:
    """Why `name` cannot be one of fetch_api's providers (None: it can)."""
    if name == DIRECT:
        if DIRECT in routes:
            return "names both the direct fetcher and routes.direct: rename the route"
        if not cfg.direct.enabled:
            return "the direct fetcher is off: set fetch_api.direct.enabled: true to use it"
        return None
    route = routes.get(name)
    if route is None:
        return f"{name!r} is not a route (nor direct, the proxy's own fetcher)"
    profile = extract_vendor(name, route, cfg, profiles)
    if profile is None:
        return (
            f"{name!r} has no search section: name the vendor whose extract API it reaches in "
            f"fetch_api.vendors ({name}: <vendor>)"
        )
    api = profile.extract
    if api is None:
        return f"{profile.name} has no extract API (vendors that have one: {_readers(profiles)})"
    if api.origin is not None and name not in cfg.vendors:
        return (
            f"{profile.name}'s extract API is at {api.origin}, not this search route's upstream: "
            f"add a route with upstream {api.origin} and name it in fetch_api.vendors"
        )
    return None


def fetch_api_config(
    cfg: FetchApiConfig,
    given: Mapping[str, Any],
    routes: Mapping[str, RouteConfig],
    profiles: Mapping[str, VendorProfile],
    broken: Collection[str] = (),
) -> tuple[FetchApiConfig, list[ConfigError]]:
    """`cfg` with its providers resolved (unset: every route whose vendor's extract API it
    reaches, in route order, then direct when enabled; [] turns /v1/fetch off), and what is
    wrong next to the routes. `given`: the section's YAML (what was written, not defaulted);
    `broken`: routes with errors of their own, which naming here does not report again."""
    errors: list[ConfigError] = []
    for name, vendor in cfg.vendors.items():
        where = join("fetch_api.vendors", name)
        if name in broken:
            continue
        if name not in routes:
            errors.append(ConfigError(where, f"{name!r} is not a route"))
        elif vendor not in profiles or profiles[vendor].extract is None:
            known = _readers(profiles)
            errors.append(
                ConfigError(where, f"{vendor!r} is no vendor with an extract API ({known})")
            )
    if "providers" not in given:
        found = [n for n in routes if _provider_problem(n, cfg, routes, profiles) is None]
        if cfg.direct.enabled and DIRECT not in routes:
            found.append(DIRECT)
        return replace(cfg, providers=tuple(found)), errors
    for i, name in enumerate(cfg.providers):
        where = f"fetch_api.providers[{i}]"
        if name in broken:
            continue
        problem = _provider_problem(name, cfg, routes, profiles)
        if problem is not None:
            errors.append(ConfigError(where, problem))
        elif name in cfg.providers[:i]:
            errors.append(ConfigError(where, f"repeats {name!r}: name each provider once"))
    if cfg.direct.enabled and DIRECT not in cfg.providers:
        errors.append(
            ConfigError(
                "fetch_api.direct.enabled",
                "the direct fetcher is on but fetch_api.providers does not list direct: add it "
                "where it should be tried (last: after every vendor)",
            )
        )
    return cfg, errors

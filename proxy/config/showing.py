"""Showing the effective config: the document parse_config reads back into an equal Config,
with every secret redacted for printing, and the secrets themselves for the logs to hide."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

from policies import chain
from policies.core.credentials import is_credential_name
from policies.core.route import RouteConfig
from policies.core.section import plain
from policies.profiles import BUILTIN_PROFILES
from policies.vendors.custom import profile_document
from proxy.config.sections import Config
from proxy.redact import REDACTED, redact_url


def as_document(config: Config) -> dict[str, Any]:
    """The config as a YAML-shaped mapping that parse_config reads back into an equal Config.

    Durations print as seconds, sizes as bytes, rates per second; built-in profiles are left
    out (they are always there), custom ones print with the keys a profile is written with.
    """
    doc: dict[str, Any] = {"server": plain(config.server)}
    if config.redis is not None:
        doc["redis"] = plain(config.redis)
    doc["log"] = plain(config.log)
    doc["search_api"] = plain(config.search_api)
    doc["mcp_server"] = plain(config.mcp_server)
    doc["fetch_api"] = plain(config.fetch_api)
    doc["routes"] = {name: route_document(route) for name, route in config.routes.items()}
    custom = {
        name: profile_document(profile)
        for name, profile in config.profiles.items()
        if BUILTIN_PROFILES.get(name) != profile
    }
    if custom:
        doc["profiles"] = custom
    if config.clients:
        doc["clients"] = {
            name: {k: v for k, v in plain(client).items() if k != "name"}
            for name, client in config.clients.items()
        }
    return doc


def redacted(config: Config) -> dict[str, Any]:
    """`as_document(config)` with secrets replaced by "<redacted>", a placeholder to fill in:
    credential-named server settings (admin_token), the Redis URL's userinfo and credential
    parameters (`?password=`), Redis passwords, every `headers.set` value, each key of a route's
    `keys` (`<redacted>#1`, `#2` ...), and a custom profile's credential-named search headers
    and fields (the rule of policies/core/credentials.py)."""
    doc = as_document(config)
    _redact_keys(doc["server"])
    redis = doc.get("redis", {})
    if "url" in redis:
        redis["url"] = redact_url(redis["url"])
    for holder in (redis, redis.get("sentinel", {})):
        if "password" in holder:
            holder["password"] = REDACTED
    for route in doc["routes"].values():
        route["headers"]["set"] = dict.fromkeys(route["headers"]["set"], REDACTED)
        if "keys" in route:
            # Numbered, so the placeholders read back as distinct keys.
            route["keys"] = [f"{REDACTED}#{i}" for i in range(1, len(route["keys"]) + 1)]
    for client in doc.get("clients", {}).values():
        client["token"] = REDACTED
    for profile in doc.get("profiles", {}).values():
        _redact_keys(profile.get("search_headers", {}))
        _redact_keys(profile.get("search_extra", {}))
    return doc


def secret_values(config: Config) -> tuple[str, ...]:
    """The secrets a config holds, for the logs to hide wherever they turn up: every
    `headers.set` value (and the token after its scheme, `Bearer <token>`), the keys of each
    route's key pool, the admin token, Redis's passwords (URL and keys), clients' tokens, and
    profiles' credential-named values."""
    found: list[str] = []
    for route in config.routes.values():
        for value in route.headers.set.values():
            found += (value, value.partition(" ")[2].strip())
        keys = route.section("keys")
        found += keys.keys if keys is not None else ()
    if config.server.admin_token:
        found.append(config.server.admin_token)
    if config.redis is not None:
        found += config.redis.secrets
        if config.redis.url is not None:
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


def route_document(route: RouteConfig) -> dict[str, Any]:
    """A route as YAML: its own keys, then each section in the form its policy writes."""
    doc: dict[str, Any] = plain(route)
    del doc["name"], doc["sections"]  # the key of the route's mapping; written below
    del doc["headers"]["variables"]  # where values came from, not a key of the file
    sections = chain.sections()
    for key, cfg in route.sections.items():
        doc[key] = sections[key].document(cfg)
    return doc

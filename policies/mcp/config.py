"""A route's `mcp:` section: which tool calls go through the route's policies, which JSON-RPC
answers are transient, and the presets of known MCP servers."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from policies.core.profile import McpPreset, QueryLocation, VendorProfile
from policies.core.route import RouteConfig
from policies.core.section import Section
from policies.core.settings import (
    ConfigError,
    any_keys,
    boolean,
    choice,
    fields,
    join,
    positive_duration,
    text,
    texts,
    whole,
    whole_in,
)
from policies.vendors import BUILTIN

# JSON-RPC codes MCP servers use for failures that may pass: the MCP SDKs' "connection
# closed" (-32000) and "request timed out" (-32001), and JSON-RPC's internal error.
TRANSIENT_CODES = frozenset({-32000, -32001, -32603})
TRANSIENT_TOOL_ERRORS = ("temporarily unavailable", "timed out", "rate limit", "try again")

# The vendors' remote MCP servers a route's `mcp: {server: <vendor>}` starts from; each preset
# is in its vendor's record (policies/vendors/).
KNOWN_SERVERS: Mapping[str, McpPreset] = MappingProxyType(
    {name: vendor.mcp for name, vendor in BUILTIN.items() if vendor.mcp is not None}
)


@dataclass(frozen=True)
class McpConfig:
    """A route's `mcp:` section."""

    server: str | None = None  # a KNOWN_SERVERS preset the other keys default from
    idempotent_tools: frozenset[str] = frozenset()  # cached and retried per call
    search_tools: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    transient_errors: frozenset[int] = TRANSIENT_CODES
    transient_tool_errors: tuple[str, ...] = TRANSIENT_TOOL_ERRORS
    # Sessions remembered (their owner; the ones the proxy opened), and how long an unused one is.
    max_sessions: int = 10_000
    session_idle: float = 86_400.0
    # With a cache on the route: answer `initialize` itself while the server is down.
    offline_sessions: bool = True


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_./-]{1,128}$")


def _tool_name(value: Any, path: str) -> str:
    name = text(value, path)
    if not _TOOL_NAME.match(name):
        raise ConfigError(path, f"expected an MCP tool name (letters, digits, _-./), got {name!r}")
    return name


def parse(raw: Any, path: str) -> McpConfig:
    """`mcp:`; `server:` names a preset (KNOWN_SERVERS) the rest overrides."""
    given = raw if isinstance(raw, dict) else {}
    preset = McpPreset()
    if "server" in given:
        server = choice(given["server"], join(path, "server"), tuple(KNOWN_SERVERS))
        preset = KNOWN_SERVERS[server]

    def tools(v: Any, p: str) -> frozenset[str]:
        return frozenset(_tool_name(t, f"{p}[{i}]") for i, t in enumerate(texts(v, p)))

    def search_tools(v: Any, p: str) -> Mapping[str, str]:
        found = {}
        for tool, argument in any_keys(v, p).items():
            where = join(p, str(tool))
            found[_tool_name(tool, where)] = text(argument, where)
        return MappingProxyType(found)

    def codes(v: Any, p: str) -> frozenset[int]:
        if not isinstance(v, list):
            raise ConfigError(p, f"expected a list of JSON-RPC error codes like -32603, got {v!r}")
        return frozenset(whole(c, f"{p}[{i}]", -(2**31), 2**31 - 1) for i, c in enumerate(v))

    def phrases(v: Any, p: str) -> tuple[str, ...]:
        return tuple(phrase.lower() for phrase in texts(v, p))

    found = fields(
        raw,
        path,
        {
            "server": text,
            "idempotent_tools": tools,
            "search_tools": search_tools,
            "transient_errors": codes,
            "transient_tool_errors": phrases,
            "max_sessions": whole_in(1, 10_000_000),
            "session_idle": positive_duration,
            "offline_sessions": boolean,
        },
    )
    idempotent = found.get("idempotent_tools", frozenset(preset.idempotent_tools))
    # The preset's search tools that are still idempotent (a narrowed list drops the others).
    searches = {k: v for k, v in preset.search_tools.items() if k in idempotent}
    defaults = {"idempotent_tools": idempotent, "search_tools": MappingProxyType(searches)}
    cfg = McpConfig(**{**defaults, **found})
    for tool in cfg.search_tools:
        if tool not in cfg.idempotent_tools:
            raise ConfigError(
                join(path, f"search_tools.{tool}"),
                "a search tool must also be in idempotent_tools: only those calls go through "
                "the route's policies",
            )
    return cfg


def check(cfg: McpConfig, route: RouteConfig, path: str) -> list[ConfigError]:
    """An MCP route applies its policies per tool call: vendor-level sections do not apply."""
    route_path = path.rpartition(".")[0]
    return [
        ConfigError(
            join(route_path, section),
            f"not available on an MCP route: an mcp route applies its policies per "
            f"tool call (use mcp.search_tools for empty results); remove {section}",
        )
        for section in ("search", "fallback", "hedge")
        if route.has(section)
    ]


SECTION = Section("mcp", parse, check)


def search_profile(route: str, cfg: McpConfig) -> VendorProfile | None:
    """Where an MCP route's search tools keep their query: a tool argument
    (`params.arguments.<name>`) of the JSON-RPC tools/call, for search recovery; None without
    search tools. McpUpstream says when an answer is empty."""
    if not cfg.search_tools:
        return None
    arguments = dict.fromkeys(cfg.search_tools.values())
    return VendorProfile(
        name=f"{route}-mcp",
        query_locations=tuple(QueryLocation("json", f"params.arguments.{a}") for a in arguments),
        results_paths=(("result",),),  # unused: the outcome comes from McpUpstream
    )

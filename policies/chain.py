"""The route chain: every policy's place, in one ordered registry (docs/request-flow.md).

    [fault injection] -> search guard -> [failover] -> cache -> [failover] -> breaker
        -> search recovery -> retry -> [hedge] -> rate limit -> [key pool] -> [fault injection]
        -> upstream

Fault injection marks a request asking for injected faults before any policy acts on it (and
answers a fault at the agent), and replaces the vendor's answer last. The guard refuses bad
queries before anything is spent. Failover sits outside the cache with
`prefer: stale` (a stale entry of this vendor answers first) and inside it with `prefer: fresh`.
The cache sits outside the breaker and the limiter so an open circuit or a refused token can
still be answered stale. The breaker sees one outcome per request, after retries and hedges. The
hedge races each attempt of the retry loop against the hedges it sends, above the limiter: every
attempt, hedges included, and only attempts that reach the vendor, spends a token. The key pool
sits under the limiter: a call it re-sends with another key, after one key was paused, is still
the same attempt.

Adding a policy: its module (a `Section` and a `Link`, policies/core/section.py) and one line in
CHAIN. The chain builder knows names and order, nothing of a policy's settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from policies import (
    breaker,
    cache,
    failover,
    faults,
    hedge,
    keypool,
    mcp,
    ratelimit,
    retry,
    search,
)
from policies.core.flow import Classifier, Policy, status_outcome
from policies.core.profile import VendorProfile
from policies.core.route import RouteConfig
from policies.core.section import Build, Link, Section

CHAIN: tuple[Link[Any], ...] = (
    faults.AT_AGENT,
    search.GUARD,
    failover.BEFORE_CACHE,
    cache.LINK,
    failover.AFTER_CACHE,
    breaker.LINK,
    search.RECOVERY,
    retry.LINK,
    hedge.LINK,
    ratelimit.LINK,
    keypool.LINK,
    faults.AT_VENDOR,
)

# Sections with no place of their own in the chain: an MCP route's `mcp:` decides what the
# chain wraps (one tool call) and what wraps the chain (the JSON-RPC session).
OTHER_SECTIONS: tuple[Section[Any], ...] = (mcp.SECTION,)


def sections() -> Mapping[str, Section[Any]]:
    """Every section a route may configure, by YAML key, in chain order."""
    found: dict[str, Section[Any]] = {}
    for link in CHAIN:
        found.setdefault(link.section.key, link.section)
    for other in OTHER_SECTIONS:
        found.setdefault(other.key, other)
    return MappingProxyType(found)


@dataclass(frozen=True)
class Reader:
    """How a route reads its answers: the vendor profile (None: by status alone), its
    classifier, and the route as its policies see it."""

    route: RouteConfig
    profile: VendorProfile | None
    classify: Classifier


def reader(route: RouteConfig, profiles: Mapping[str, VendorProfile]) -> Reader:
    """The route's vendor and classifier: its search section's profile; on an MCP route, its
    search tools (recovered as searches: the route gains a search section of its own)."""
    mcp_cfg = route.get(mcp.SECTION)
    if mcp_cfg is not None:
        profile = mcp.search_profile(route.name, mcp_cfg)
        if profile is not None:
            sections = {**route.sections, search.SECTION.key: search.SearchConfig(profile.name)}
            route = replace(route, sections=MappingProxyType(sections))
        return Reader(route, profile, mcp.mcp_classifier)
    search_cfg = route.get(search.SECTION)
    if search_cfg is not None:
        profile = profiles[search_cfg.vendor]
        return Reader(route, profile, search.search_classifier(profile))
    return Reader(route, None, status_outcome)


def build_chain(build: Build) -> list[Policy]:
    """The route's policies, outermost first; a link whose section the route leaves out (or
    whose builder declines) adds nothing."""
    return [policy for link in CHAIN if (policy := link.policy(build)) is not None]

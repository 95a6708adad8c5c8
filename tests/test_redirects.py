"""Where an upstream's redirect points on the agent's side of the proxy, and which targets are
the route's own upstream (proxy/redirects.py): pure functions of URLs."""

from __future__ import annotations

import pytest
from yarl import URL

from proxy.redirects import RoutePath, agent_location, on_upstream

ASKED = URL("http://10.0.0.5:8000/api/mcp?x=1")


@pytest.mark.parametrize(
    ("location", "found"),
    [
        ("http://10.0.0.5:8000/api/mcp/", RoutePath("/mcp/", "")),
        ("/api/mcp/?page=2", RoutePath("/mcp/", "page=2")),
        ("mcp/", RoutePath("/mcp/", "")),  # relative to the request's path
        ("http://10.0.0.5:8000/api", RoutePath("", "")),
        ("http://10.0.0.5:8001/api/mcp/", None),  # another port
        ("https://10.0.0.5:8000/api/mcp/", None),  # another scheme
        ("http://evil.example/api/mcp/", None),
        ("//evil.example/api/mcp/", None),
        ("http://10.0.0.5:8000/apiary", None),  # outside the base path
        ("http://10.0.0.5:8000/", None),
        ("http://[::1", None),  # not a URL
    ],
)
def test_on_upstream(location: str, found: RoutePath | None) -> None:
    assert on_upstream(location, ASKED, "/api") == found


def test_on_upstream_without_a_base_path() -> None:
    asked = URL("https://mcp.example/mcp")
    assert on_upstream("https://mcp.example/mcp/", asked, "") == RoutePath("/mcp/", "")


def test_agent_location() -> None:
    target = RoutePath("/mcp/", "a=1")
    assert agent_location(target, "/tmcp", strip_prefix=True) == "/tmcp/mcp/?a=1"
    assert agent_location(RoutePath("", ""), "/tmcp", strip_prefix=True) == "/tmcp"
    # A route that keeps its prefix reaches only targets under it.
    assert agent_location(RoutePath("/v2/x", ""), "/v2", strip_prefix=False) == "/v2/x"
    assert agent_location(RoutePath("/v3/x", ""), "/v2", strip_prefix=False) is None

"""What every handler of the app shares, created at start-up and owned by the app."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from policies.core.clock import Clock
from policies.core.redislink import RedisLink
from proxy.admin import Admin
from proxy.clients import ClientGate
from proxy.config import Config
from proxy.mcp_server import McpEndpoint
from proxy.metrics import Metrics, RouteMetrics
from proxy.pipeline import Route
from proxy.routing import Router
from proxy.search_api import SearchApi


@dataclass
class ProxyState:
    """Everything the handlers share, created at start-up and owned by the app."""

    config: Config
    clock: Clock
    metrics: Metrics
    routes: dict[str, Route] = field(default_factory=dict)
    router: Router[Route] | None = None
    search_api: SearchApi | None = None
    admin: Admin | None = None
    clients: ClientGate | None = None  # None: `clients:` not configured, callers not identified
    mcp: McpEndpoint | None = None  # the MCP server at mcp_server.path (proxy/mcp_server.py)
    session: aiohttp.ClientSession | None = None
    redis: RedisLink | None = None
    log_requests: bool = True
    # The request metrics of the endpoints that are not routes (/v1/search, /mcp), by label.
    endpoint_metrics: dict[str, RouteMetrics] = field(default_factory=dict)
    # Where the listeners are bound (host:port), once they are: what a 404 on one names for the
    # other. Until then (an app served by a test client) the config's admin address stands in.
    agents_address: str | None = None
    admin_address: str | None = None

    def admin_at(self) -> str:
        """The admin listener's address, as bound or as configured."""
        server = self.config.server
        return self.admin_address or address(server.admin_host, server.admin_port)


def address(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


STATE = web.AppKey("state", ProxyState)

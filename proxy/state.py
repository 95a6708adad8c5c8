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
from proxy.direct import DirectHooks
from proxy.fetch_api import FetchApi
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
    fetch_api: FetchApi | None = None  # /v1/fetch and the MCP fetch_page tool
    openapi_json: bytes = b""  # GET /openapi.json: /v1/search's document, and /v1/fetch's
    # The direct fetcher's DNS and connect hooks (None: the system's; tests: fakes).
    direct_hooks: DirectHooks | None = None
    admin: Admin | None = None
    clients: ClientGate | None = None  # None: `clients:` not configured, callers not identified
    mcp: McpEndpoint | None = None  # the MCP server at mcp_server.path (proxy/mcp_server.py)
    session: aiohttp.ClientSession | None = None
    redis: RedisLink | None = None
    log_requests: bool = True
    # The request metrics of the endpoints that are not routes (/v1/search, /v1/fetch, /mcp).
    endpoint_metrics: dict[str, RouteMetrics] = field(default_factory=dict)


STATE = web.AppKey("state", ProxyState)

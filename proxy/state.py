"""What every handler of the app shares, created at start-up and owned by the app."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from policies.core.clock import Clock
from policies.core.memory import MemoryBudget
from policies.core.redislink import RedisLink
from proxy.admin import Admin
from proxy.clients import ClientGate
from proxy.config import Config
from proxy.direct import DirectHooks
from proxy.echo import EchoGuard
from proxy.fetch_api import FetchApi
from proxy.generation import Generation
from proxy.listeners import address
from proxy.mcp_server import McpEndpoint
from proxy.metrics import Metrics, RouteMetrics
from proxy.pipeline import Route
from proxy.routing import Router
from proxy.search_api import SearchApi
from proxy.series import Series
from proxy.status import Pulse


@dataclass
class ProxyState:
    """Everything the handlers share, created at start-up and owned by the app. The fields from
    `config` to `clients` are the serving generation's, swapped whole by a reload (`use`)."""

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
    echo: EchoGuard = field(default_factory=lambda: EchoGuard(()))  # the secrets held
    generation: Generation | None = None
    mcp: McpEndpoint | None = None  # the MCP server at mcp_server.path (proxy/mcp_server.py)
    session: aiohttp.ClientSession | None = None
    redis: RedisLink | None = None
    log_requests: bool = True
    # The request metrics of the endpoints that are not routes (/v1/search, /v1/fetch, /mcp).
    endpoint_metrics: dict[str, RouteMetrics] = field(default_factory=dict)
    # Where the listeners are bound (host:port), once they are: what a 404 on one names for the
    # other. Until then (an app served by a test client) the config's admin address stands in.
    agents_address: str | None = None
    admin_address: str | None = None
    # The config file served, and the hash of what was read from it (proxy/reload.py).
    config_path: str | None = None
    config_hash: str = ""
    series: Series | None = None
    pulse: Pulse | None = None  # recent rates, latencies and errors, for the status page
    # Bodies held at once (server.max_buffered_bytes): the agents' listener charges each
    # request's to it (proxy/budget.py); None: not counted (an app a test serves directly).
    memory: MemoryBudget | None = None

    def admin_at(self) -> str:
        """The admin listener's address, as bound or as configured."""
        server = self.config.server
        return self.admin_address or address(server.admin_host, server.admin_port)

    def use(self, generation: Generation) -> None:
        """Serve `generation` from now on: one swap, no await inside, so a request sees the old
        generation or the new one whole. Requests already running keep the route they hold."""
        self.generation = generation
        self.config = generation.config
        self.routes = generation.routes
        self.router = generation.router
        self.search_api = generation.search_api
        self.fetch_api = generation.fetch_api
        self.openapi_json = generation.openapi_json
        self.admin = generation.admin
        self.clients = generation.clients
        self.echo = generation.echo
        if self.mcp is not None:
            self.mcp.use(
                generation.search_api,
                generation.clients,
                generation.config.mcp_server,
                generation.fetch_api,  # fetch_page beside web_search
            )
        if self.series is not None:
            self.series.declare(self.routes, self.config.search_api.providers)
        if self.pulse is not None:
            self.pulse.follow(self.config, [*self.routes, *self.endpoint_metrics])


STATE = web.AppKey("state", ProxyState)

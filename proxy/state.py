"""What every handler of the app shares, created at start-up and owned by the app."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from policies.core.clock import Clock
from policies.core.memory import MemoryBudget
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
from proxy.outbound import VendorPool
from proxy.pipeline import Route
from proxy.routing import Router
from proxy.search_api import SearchApi
from proxy.series import Series
from proxy.status import Pulse

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

_NO_SECRETS = EchoGuard(())


@dataclass
class ProxyState:
    """Everything the handlers share, created at start-up and owned by the app. The serving
    generation (routes, router, the APIs, admin, clients, the secrets held) is swapped whole by
    a reload (`use`); `config` is the start-up one until the first generation serves."""

    config: Config
    clock: Clock
    metrics: Metrics
    # The direct fetcher's DNS and connect hooks (None: the system's; tests: fakes).
    direct_hooks: DirectHooks | None = None
    generation: Generation | None = None
    mcp: McpEndpoint | None = None  # the MCP server at mcp_server.path (proxy/mcp_server.py)
    vendors: VendorPool | None = None  # connections to the upstreams
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

    @property
    def routes(self) -> dict[str, Route]:
        return self.generation.routes if self.generation is not None else {}

    @property
    def router(self) -> Router[Route] | None:
        return self.generation.router if self.generation is not None else None

    @property
    def search_api(self) -> SearchApi | None:
        return self.generation.search_api if self.generation is not None else None

    @property
    def fetch_api(self) -> FetchApi | None:
        """/v1/fetch and the MCP fetch_page tool."""
        return self.generation.fetch_api if self.generation is not None else None

    @property
    def openapi_json(self) -> bytes:
        """GET /openapi.json: /v1/search's document, and /v1/fetch's."""
        return self.generation.openapi_json if self.generation is not None else b""

    @property
    def admin(self) -> Admin | None:
        return self.generation.admin if self.generation is not None else None

    @property
    def clients(self) -> ClientGate | None:
        """None: `clients:` not configured, callers not identified."""
        return self.generation.clients if self.generation is not None else None

    @property
    def echo(self) -> EchoGuard:
        """The secrets the proxy holds, kept out of what agents receive."""
        return self.generation.echo if self.generation is not None else _NO_SECRETS

    def admin_at(self) -> str:
        """The admin listener's address, as bound or as configured."""
        server = self.config.server
        return self.admin_address or address(server.admin_host, server.admin_port)

    def use(self, generation: Generation) -> None:
        """Serve `generation` from now on: one swap, no await inside, so a request sees the old
        generation or the new one whole. Requests already running keep the route they hold."""
        self.generation = generation
        self.config = generation.config
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

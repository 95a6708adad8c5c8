"""Each test module's tier, and shared fixtures: a real redis-server for the whole run, a private
one for kill tests, the fake vendor and a proxy in front of it, the process's logging set up."""

from __future__ import annotations

import io
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from aiohttp.web_runner import BaseRunner
from redis.asyncio import Redis

from policies.core.events import NullEvents
from policies.core.redislink import RedisLink
from proxy.app import build_admin_app, build_app
from proxy.config import parse_config
from proxy.guard import GuardedRunner
from proxy.logs import configure_logging, reset_logging
from proxy.state import STATE
from testkit.fakevendor import FakeVendor
from testkit.redisserver import RedisServer


class Busy(NullEvents):
    """Events that count the Redis commands told to go in-process because the link was busy."""

    def __init__(self) -> None:
        self.busy = 0

    def redis_busy(self) -> None:
        self.busy += 1


# Every test module picks a tier (`make test TIER=unit`, `pytest -m unit`), by what it runs:
# unit: pure functions and policies on a ManualClock, at most a local redis-server;
# integration: real aiohttp servers (the proxy app, the fake vendor) in the test's process;
# e2e: the proxy as a child process, or the vendors' own SDKs against it;
# deploy: the offline checks of deploy/.
# A test marked with a tier itself keeps it (one proxy-process test in an integration module).
TIERS = ("unit", "integration", "e2e", "deploy")
TIER_OF_MODULE = {
    "test_admin": "integration",
    "test_amplification": "e2e",
    "test_backoff": "unit",
    "test_bench_ablation": "unit",
    "test_bench_chain": "unit",
    "test_bench_report": "unit",
    "test_bench_upstream": "integration",
    "test_breaker": "unit",
    "test_breaker_e2e": "integration",
    "test_breaker_machine": "unit",
    "test_breaker_recovery": "unit",
    "test_chain": "integration",
    "test_clients": "e2e",
    "test_cache": "unit",
    "test_cache_e2e": "integration",
    "test_credentials": "e2e",
    "test_client_identity": "integration",
    "test_client_gate": "unit",
    "test_config": "unit",
    "test_deploy": "deploy",
    "test_docs": "e2e",
    "test_embed": "integration",
    "test_envelope": "integration",
    "test_fakemcp": "integration",
    "test_fakevendor": "integration",
    "test_fetch_api": "integration",
    "test_fetch_pages": "unit",
    "test_fleet": "unit",
    "test_direct_fetch": "integration",
    "test_mcp_fetch": "integration",
    "test_hostile_config": "e2e",
    "test_deadlines": "e2e",
    "test_bad_input": "e2e",
    "test_failover_graph": "e2e",
    "test_admin_access": "e2e",
    "test_secrets": "e2e",
    "test_memory": "e2e",
    "test_bodies": "unit",
    "test_internals": "unit",
    "test_headers": "unit",
    "test_reclaim": "unit",
    "test_upstream": "integration",
    "test_outbound": "integration",
    "test_front": "integration",
    "test_replay": "integration",
    "test_redis_recovery": "integration",
    "test_redis_commands": "integration",
    "test_redis_ha": "e2e",
    "test_redis_tls": "integration",
    "test_redis_config": "unit",
    "test_redis_line": "unit",
    "test_process": "e2e",
    "test_profiles": "unit",
    "test_prometheus": "deploy",
    "test_proxy_core": "integration",
    "test_ratelimit": "unit",
    "test_ratelimit_e2e": "integration",
    "test_reload": "integration",
    "test_reload_process": "e2e",
    "test_status": "integration",
    "test_status_page": "e2e",
    "test_readme": "e2e",
    "test_logs": "unit",
    "test_loopmetrics": "unit",
    "test_redact": "unit",
    "test_redirects": "unit",
    "test_retries": "integration",
    "test_sdks": "e2e",
    "test_sdk_errors": "e2e",
    "test_shipped_config": "e2e",
    "test_failover": "integration",
    "test_faults": "integration",
    "test_hedge": "unit",
    "test_hedge_e2e": "integration",
    "test_keypool": "integration",
    "test_wait_at_most": "integration",
    "test_workers": "e2e",
    "test_mcp_server": "integration",
    "test_mcp_calls": "integration",
    "test_search_api": "integration",
    "test_search_e2e": "integration",
    "test_streams": "integration",
    "test_search_options": "unit",
    "test_search_modes": "integration",
    "test_vendors": "unit",
    "test_added_vendor": "integration",
    "test_simplify": "unit",
    "test_mcp_policy": "unit",
    "test_mcp_route": "integration",
    "test_mcp_sessions": "integration",
    "test_mcp2_client": "e2e",
    "test_mcp_ts_client": "e2e",
    "test_plugin": "e2e",
    "test_tour": "e2e",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its module's tier; a module missing from TIER_OF_MODULE is an error."""
    missing = sorted({item.path.stem for item in items} - TIER_OF_MODULE.keys())
    if missing:
        raise pytest.UsageError(
            f"test module(s) without a tier: {', '.join(missing)}; add each to TIER_OF_MODULE "
            f"in tests/conftest.py as one of {', '.join(TIERS)}"
        )
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(TIER_OF_MODULE[item.path.stem])


@pytest.fixture(scope="session")
def redis_session() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(redis_session: RedisServer) -> RedisServer:
    """The shared redis-server, emptied before the test."""
    if redis_session.proc is None:
        redis_session.start()
    redis_session.flush()
    return redis_session


@pytest.fixture
def killable_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own, which the test may stop and start again."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def links(redis_server: RedisServer) -> AsyncIterator[tuple[RedisLink, RedisLink]]:
    """Two links to one Redis, as two replicas of the proxy would have, warmed as the proxy
    warms its link before serving: a first connect on a machine still busy starting the suite
    may take longer than the link's 0.1 s timeout, and a test would then run in-process."""
    a = RedisLink(redis_server.url, "test")
    b = RedisLink(redis_server.url, "test")
    assert await a.warm() and await b.warm()
    yield a, b
    await a.close()
    await b.close()


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A plain client, for looking at what the proxy wrote."""
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


# ---------------------------------------------------------------------------------------------
# A fake vendor and a proxy in front of it, both real servers on loopback.


@pytest.fixture
async def vendor(aiohttp_server: Any) -> FakeVendor:
    """The fake vendor, served on loopback; `vendor.url` is its origin."""
    fake = FakeVendor()
    server = await aiohttp_server(fake.make_app())
    fake.url = str(server.make_url("")).rstrip("/")  # type: ignore[attr-defined]
    return fake


def route(upstream: str, prefix: str, **policies: Any) -> dict[str, Any]:
    """A route's YAML-shaped config with short test timeouts unless given."""
    body: dict[str, Any] = {
        "prefix": prefix,
        "upstream": upstream,
        "timeouts": {"connect": "1s", "per_try": "2s", "total": "5s"},
    }
    body.update(policies)
    return body


class ListenerTestServer(TestServer):
    """pytest-aiohttp's test server on the proxy's own listener (proxy/guard.py's GuardedRunner,
    with the front of proxy/front.py), as the proxy process serves: route requests take the
    front's path, everything else aiohttp's, under the server section's limits."""

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        kwargs.pop("handler_cancellation", None)  # off, as in the proxy process
        state = self.app[STATE]
        return GuardedRunner(self.app, state.config.server, budget=state.memory, **kwargs)


@pytest.fixture
def start_proxy(aiohttp_client: Any) -> Callable[..., Awaitable[Any]]:
    """Start a proxy app on loopback from a YAML-shaped dict, served as the proxy process serves
    it (`ListenerTestServer`); returns a pytest-aiohttp client (`client.app[STATE]` reaches its
    state)."""

    async def start(raw: dict[str, Any], *, clock: Any = None, env: dict[str, str] | None = None):
        config = parse_config(raw, env or {})
        kwargs = {"clock": clock} if clock is not None else {}
        return await aiohttp_client(ListenerTestServer(build_app(config, **kwargs)))

    return start


@pytest.fixture
def tls_contexts_built(monkeypatch: pytest.MonkeyPatch) -> list[ssl.SSLContext]:
    """Every context `ssl.create_default_context` builds from now on, in order. Each build loads
    the system's CA bundle: ~50 ms of CPU on OpenSSL 3, in which the event loop serves nothing."""
    built: list[ssl.SSLContext] = []
    create = ssl.create_default_context

    def counted(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        built.append(create(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(ssl, "create_default_context", counted)
    return built


@pytest.fixture
def admin_of(aiohttp_client: Any) -> Callable[[Any], Awaitable[Any]]:
    """The admin listener of a proxy `start_proxy` started, as a client of its own (the admin
    endpoints are not on the agents' port)."""

    async def admin(proxy_client: Any) -> Any:
        return await aiohttp_client(build_admin_app(proxy_client.app))

    return admin


@pytest.fixture
def configured_log() -> Iterator[Callable[..., io.BytesIO]]:
    """configure_logging as the process runs it (a level, JSON unless told), into a buffer it
    returns; logging as it was afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    streams: list[io.TextIOWrapper] = []

    def configure(
        log_level: str, secrets: tuple[str, ...] = (), fmt: str = "json", worker: int | None = None
    ) -> io.BytesIO:
        raw = io.BytesIO()
        stream = io.TextIOWrapper(raw, write_through=True)  # kept: collecting it closes `raw`
        streams.append(stream)
        configure_logging(log_level, fmt, stream, secrets=secrets, worker=worker)
        return raw

    try:
        yield configure
    finally:
        for stream in streams:
            stream.detach()
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(False)
        reset_logging()

"""Shared fixtures: a real redis-server for the whole run, and a private one for kill tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from redis.asyncio import Redis

from policies.core.redislink import RedisLink
from proxy.app import build_app
from proxy.config import parse_config
from tests.fakevendor import FakeVendor
from tests.redisserver import RedisServer


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
    """Two links to one Redis, as two replicas of the proxy would have."""
    a = RedisLink(redis_server.url, "test")
    b = RedisLink(redis_server.url, "test")
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


@pytest.fixture
def start_proxy(aiohttp_client: Any) -> Callable[..., Awaitable[Any]]:
    """Start a proxy app on loopback from a YAML-shaped dict; returns a pytest-aiohttp client
    (`client.app[STATE]` reaches its state)."""

    async def start(raw: dict[str, Any], *, clock: Any = None, env: dict[str, str] | None = None):
        config = parse_config(raw, env or {})
        kwargs = {"clock": clock} if clock is not None else {}
        return await aiohttp_client(build_app(config, **kwargs))

    return start

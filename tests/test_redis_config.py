"""The `redis:` section: one server by URL, a Sentinel-managed master or a cluster (exactly one),
with an ACL user and TLS; every mistake named by its YAML path before anything listens; secrets
never printed; the client redis-py builds for each, with the link's tight timeouts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError

from policies.core.events import NullEvents
from policies.core.redisclient import connect, nodes_in_use
from policies.core.redisconfig import RedisConfig
from policies.core.redisline import LARGE, MAX_CARRIED, PipelinedRedis
from policies.core.redislink import UNAVAILABLE, RedisLink
from proxy import cli
from proxy.config import REDACTED, ConfigError, as_document, parse_config, redacted, secret_values
from proxy.metrics import Metrics
from testkit.certs import tls_files
from testkit.procs import free_port
from testkit.redisserver import RedisServer
from tests.conftest import Busy

ROUTES = {"routes": {"t": {"prefix": "/t", "upstream": "https://api.tavily.com"}}}


def config(redis: Any) -> RedisConfig:
    parsed = parse_config({"redis": redis, **ROUTES}, {})
    assert parsed.redis is not None
    return parsed.redis


def error_of(redis: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config({"redis": redis, **ROUTES}, {})
    return str(info.value)


def test_an_empty_section_is_the_local_default_url() -> None:
    assert config({}) == RedisConfig(url="redis://127.0.0.1:6379/0")


def test_sentinel_and_cluster_sections() -> None:
    tls = tls_files()
    found = config(
        {
            "sentinel": {"hosts": ["s1:26379", "[::1]:26380"], "service": "mymaster", "db": 2},
            "username": "proxy",
            "password": "pw-0123456789",
            "tls": {"ca_file": tls.ca, "cert_file": tls.client_cert, "key_file": tls.client_key},
        }
    )
    assert found.topology == "sentinel" and found.url is None
    assert found.sentinel is not None and found.sentinel.hosts == ("s1:26379", "[::1]:26380")
    assert found.tls is not None and found.tls.check_hostname
    found = config({"cluster": {"nodes": ["10.0.0.1:7000"]}, "tls": True})
    assert found.topology == "cluster" and found.tls is not None and found.tls.ca_file is None


@pytest.mark.parametrize(
    ("redis", "message"),
    [
        (
            {"url": "redis://h:6379", "cluster": {"nodes": ["h:7000"]}},
            "redis.cluster: give one of url, sentinel and cluster, not url and cluster",
        ),
        ({"sentinel": {"hosts": ["h:26379"]}}, "redis.sentinel.service: required key is missing"),
        ({"sentinel": {"hosts": [], "service": "m"}}, "redis.sentinel.hosts: expected at least"),
        ({"cluster": {"nodes": ["h"]}}, "redis.cluster.nodes[0]: expected host:port, got 'h'"),
        ({"cluster": {"nodes": ["h:0"]}}, "redis.cluster.nodes[0]: expected host:port"),
        ({"cluster": {"nodes": ["a b:1"]}}, "redis.cluster.nodes[0]: expected host:port"),
        ({"cluster": {"nodes": ["u:p@h:1"]}}, "redis.cluster.nodes[0]: expected host:port"),
        ({"username": "proxy"}, "redis.username: an ACL user needs its password too"),
        (
            {"sentinel": {"hosts": ["h:1"], "service": "m", "username": "s"}},
            "redis.sentinel.username: an ACL user needs its password too",
        ),
        ({"tls": True}, "redis.url: with tls, use a rediss:// URL, got 'redis://127.0.0.1"),
        ({"tls": "yes please"}, "redis.tls: expected true, false or a mapping"),
        (
            {"url": "rediss://h", "tls": {"ca_file": "/nonexistent/ca.pem"}},
            "redis.tls.ca_file: no readable file at '/nonexistent/ca.pem'",
        ),
        (
            {"url": "rediss://h", "tls": {"cert_file": __file__}},
            "redis.tls.key_file: a client certificate needs both cert_file and key_file",
        ),
        (
            {"url": "redis://:pw-in-url-0123@h", "password": "pw-key-0123"},
            "redis.url: the URL has a password and so has redis.password: keep one",
        ),
        ({"cluster": {"nodes": ["h:1"], "db": 1}}, "redis.cluster.db: unknown key"),
        ({"max_connections": 0}, "redis.max_connections: expected a whole number from 1 to"),
    ],
)
def test_mistakes_name_their_yaml_path(redis: Any, message: str) -> None:
    assert message in error_of(redis)


def test_no_error_quotes_a_password() -> None:
    assert "pw-0123" not in error_of({"password": ["pw-0123"]})
    assert "pw-0123" not in error_of({"sentinel": {"hosts": ["h:1"], "password": ["pw-0123"]}})


def test_check_config_prints_passwords_as_placeholders_and_loads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = {
        "redis": {
            "sentinel": {"hosts": ["s1:26379"], "service": "m", "password": "sentinel-pw-0123"},
            "username": "proxy",
            "password": "data-pw-0123456",
        },
        **ROUTES,
    }
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(raw))
    assert cli.check_config(str(f)) == 0
    out = capsys.readouterr().out
    assert "sentinel-pw-0123" not in out and "data-pw-0123456" not in out
    shown = yaml.safe_load(out)["redis"]
    assert shown["password"] == shown["sentinel"]["password"] == REDACTED
    parsed = parse_config(raw, {})
    assert parse_config(as_document(parsed), {}) == parsed
    assert redacted(parsed)["redis"]["username"] == "proxy"
    assert {"sentinel-pw-0123", "data-pw-0123456"} <= set(secret_values(parsed))


def test_each_form_builds_redis_pys_own_client_with_tight_timeouts() -> None:
    by_url = connect(config({"url": "redis://db:6380/1"}), 0.1)
    assert isinstance(by_url, Redis) and not isinstance(by_url, RedisCluster)
    assert by_url.connection_pool.connection_kwargs["socket_timeout"] == 0.1
    assert nodes_in_use(by_url, RedisConfig()) == (("db:6380", "standalone"),)

    sentinel = connect(config({"sentinel": {"hosts": ["s:26379"], "service": "m"}}), 0.1)
    assert isinstance(sentinel, Redis)
    pool = sentinel.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "m"
    asked = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
    assert asked["socket_timeout"] == asked["socket_connect_timeout"] == 0.1
    assert nodes_in_use(sentinel, RedisConfig()) == ()  # no master asked for yet

    cluster = connect(config({"cluster": {"nodes": ["c1:7000", "c2:7001"]}}), 0.1)
    assert isinstance(cluster, RedisCluster)
    assert [(n.host, n.port) for n in cluster.startup_nodes] == [("c1", 7000), ("c2", 7001)]
    # A timed-out command may still run: only a dropped connection is retried, never a timeout.
    assert cluster.ERRORS_ALLOW_RETRY == (cluster.ERRORS_ALLOW_RETRY[0],)
    assert RedisTimeoutError not in cluster.ERRORS_ALLOW_RETRY


async def test_a_cluster_clients_own_refusal_is_redis_unavailable_not_a_crash() -> None:
    link = RedisLink("redis://127.0.0.1:1/0", "t")

    async def cross_slot(client: Any) -> None:
        raise RedisClusterException("EVALSHA - all keys must map to the same key slot")

    try:
        assert await link.run(cross_slot) is UNAVAILABLE
        assert not link.up
    finally:
        await link.close()


# --- what the link reports ---------------------------------------------------------------------


class Recorded(NullEvents):
    def __init__(self) -> None:
        self.nodes: list[tuple[tuple[str, str], ...]] = []
        self.failovers = 0

    def redis_nodes(self, nodes: Sequence[tuple[str, str]]) -> None:
        self.nodes.append(tuple(nodes))

    def redis_failover(self) -> None:
        self.failovers += 1


async def test_the_link_reports_the_node_it_uses_once(redis_server: RedisServer) -> None:
    events = Recorded()
    link = RedisLink(redis_server.url, "t", events=events)
    try:
        for _ in range(3):
            assert await link.run(lambda r: r.ping()) is True
    finally:
        await link.close()
    assert events.nodes == [((f"127.0.0.1:{redis_server.port}", "standalone"),)]
    assert events.failovers == 0


def test_metrics_show_the_nodes_in_use_failovers_and_time_degraded() -> None:
    now = [100.0]
    metrics = Metrics()
    metrics.degraded_time.now = lambda: now[0]

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels or None)

    metrics.redis_nodes([("10.0.0.1:6379", "master")])
    metrics.redis_state(False)
    now[0] += 2.5
    assert sample("search_proxy_redis_degraded_seconds_total") == 2.5  # while it lasts
    now[0] += 1.0
    metrics.redis_state(True)
    now[0] += 60.0
    assert sample("search_proxy_redis_degraded_seconds_total") == 3.5  # not while up
    metrics.redis_failover()
    metrics.redis_nodes([("10.0.0.2:6379", "master")])
    assert sample("search_proxy_redis_failovers_total") == 1
    assert sample("search_proxy_redis_node", node="10.0.0.2:6379", role="master") == 1
    assert sample("search_proxy_redis_node", node="10.0.0.1:6379", role="master") is None


# --- connections: as many as max_connections, open before the first request ---------------------


async def clients(redis_server: RedisServer) -> int:
    """Connections redis-server has open, less the one asking."""
    probe = Redis.from_url(redis_server.url)
    try:
        info = await probe.info("clients")
        return int(info["connected_clients"]) - 1
    finally:
        await probe.aclose()


@contextlib.asynccontextmanager
async def warmed_link(
    redis_server: RedisServer, **config: Any
) -> AsyncIterator[tuple[RedisLink, Busy]]:
    """A URL link to `redis_server` (`config`: more RedisConfig keys), warmed up, and its
    events, which count the commands told to go in-process."""
    events = Busy()
    link = RedisLink(RedisConfig(url=redis_server.url, **config), "t", events=events)
    try:
        assert await link.warm() is True
        yield link, events
    finally:
        await link.close()


async def test_a_burst_shares_the_one_connection_opened_at_start(redis_server: RedisServer) -> None:
    before = await clients(redis_server)
    link = RedisLink(RedisConfig(url=redis_server.url, max_connections=3), "t")
    try:
        assert await link.warm() is True
        assert await clients(redis_server) - before == 1  # open before any request
        # 50 at once, as a burst of requests sends them: none opens a connection of its own,
        # and each is answered once.
        found = await asyncio.gather(*(link.run(lambda r: r.incr("burst")) for _ in range(50)))
        assert sorted(found) == list(range(1, 51))
        assert await clients(redis_server) - before == 1
        assert link.up
    finally:
        await link.close()


async def test_commands_on_the_pipelined_connection_need_none_of_the_max_connections(
    redis_server: RedisServer,
) -> None:
    async with warmed_link(redis_server, max_connections=1) as (link, events):
        release = asyncio.Event()

        async def hold(r: Redis) -> Any:
            await release.wait()
            return await r.incr("held")

        # More commands in flight than max_connections: none waits for another.
        held = [asyncio.ensure_future(link.run(hold)) for _ in range(3)]
        await asyncio.sleep(0)
        assert await link.run(lambda r: r.ping()) is True
        release.set()
        assert sorted(await asyncio.gather(*held)) == [1, 2, 3]
        assert events.busy == 0


async def test_with_every_pooled_connection_busy_a_large_command_goes_in_process_redis_up(
    redis_server: RedisServer,
) -> None:
    large = b"x" * LARGE
    async with warmed_link(redis_server, max_connections=1) as (link, events):
        client = link.client
        assert isinstance(client, PipelinedRedis) and client.pooled_slot is not None
        async with client.pooled_slot():  # as a large command in flight holds it
            # The next large command waits its 100 ms for the one pooled connection, then is
            # told to go in-process; small ones on the pipelined connection go on meanwhile.
            assert await link.run(lambda r: r.set("big", large)) is UNAVAILABLE
            assert events.busy == 1
            assert await link.run(lambda r: r.get("absent")) is None
            assert link.up  # busy here is not down there: nothing else degrades
        assert await link.run(lambda r: r.set("big", large)) is True
        assert await link.run(lambda r: r.strlen("big")) == LARGE
        assert events.busy == 1


async def test_a_burst_of_medium_commands_spills_onto_pooled_connections_and_redis_stays_up(
    redis_server: RedisServer,
) -> None:
    """400 commands of 60 KB at once (a burst of misses storing medium answers), each small
    enough for the pipelined connection: past MAX_CARRIED bytes on it the rest take pooled
    connections, as large ones do, rather than pile 24 MB up behind it until it fails them all
    and marks Redis down."""
    value = b"v" * 60_000
    async with warmed_link(redis_server) as (link, events):
        found = await asyncio.gather(
            *(link.run(lambda r, i=i: r.set(f"m{i}", value)) for i in range(400))
        )
        assert link.up
        # Each was stored, or waited its 100 ms for a pooled connection and went in-process.
        assert found.count(True) + found.count(UNAVAILABLE) == 400
        assert found.count(UNAVAILABLE) == events.busy
        assert found.count(True) >= MAX_CARRIED // len(value)
        stored = [i for i, ok in enumerate(found) if ok is True]
        lengths = await link.run(lambda r: asyncio.gather(*(r.strlen(f"m{i}") for i in stored)))
        assert lengths == [len(value)] * len(stored)


async def test_a_redis_with_room_for_fewer_connections_is_warmed_up_not_down(
    redis_server: RedisServer,
) -> None:
    admin = Redis.from_url(redis_server.url)
    before = await clients(redis_server)
    await admin.config_set("maxclients", before + 1 + 2)  # the admin's, then room for 2 more
    link = RedisLink(RedisConfig(url=redis_server.url, max_connections=5), "t")
    try:
        assert await link.warm() is True  # 2 of 5 connections opened: Redis answers
        assert link.up
        assert await link.run(lambda r: r.ping()) is True
    finally:
        await link.close()
        await admin.config_set("maxclients", 10000)
        await admin.aclose()


async def test_warming_a_redis_that_refuses_marks_it_down_and_start_up_goes_on() -> None:
    link = RedisLink(RedisConfig(url=f"redis://127.0.0.1:{free_port()}"), "t")
    try:
        assert await link.warm() is False
        assert not link.up
        assert await link.run(lambda r: r.ping()) is UNAVAILABLE  # in-process until the probe
    finally:
        await link.close()

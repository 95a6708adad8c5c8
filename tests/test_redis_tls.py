"""A link to Redis over TLS, against a real redis-server on loopback that asks for a client
certificate and an ACL user (`rediss://`): the link's connections, on every topology, share one
TLS context. redis-py builds a context per connection, and each build loads the system's CA
bundle (~50 ms of CPU on OpenSSL 3): before, a warm-up at the default 100 ms timeout opened a few
of its 16 connections on an idle machine and none on a loaded one, and the proxy began on
in-process state. Sentinel and cluster nodes over TLS serve in tests/test_redis_ha.py."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection, SSLConnection
from redis.asyncio.sentinel import SentinelConnectionPool

from policies.core.redisclient import connect
from policies.core.redisconfig import ClusterNodes, RedisConfig, RedisTls, SentinelService
from policies.core.redisline import LARGE
from policies.core.redislink import RedisLink
from proxy.config import parse_config
from testkit.certs import TlsFiles, tls_files
from testkit.procs import free_port
from testkit.redisha import Access, Node

PASSWORD = "a-long-acl-password"
ROUTES = {"routes": {"t": {"prefix": "/t", "upstream": "https://api.tavily.com"}}}


@pytest.fixture(scope="module")
def tls_node() -> Iterator[Node]:
    """One redis-server, TLS only, with the proxy's ACL user."""
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed: apt-get install redis-server"
    access = Access("proxy", PASSWORD, tls_files(), keys="tls-*")
    with tempfile.TemporaryDirectory(prefix="search-proxy-redis-tls-") as data:
        port = free_port()
        argv = [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", data, *access.server_args(port)]
        node = Node("redis-tls", port, argv, access)
        node.start()
        try:
            node.wait_ready()
            yield node
        finally:
            node.kill()


def proxy_clients(node: Node) -> int:
    """Connections the proxy's ACL user holds open on `node`."""
    listing = node.command("CLIENT", "LIST")
    text = listing.decode() if isinstance(listing, bytes) else str(listing)
    return sum(1 for line in text.splitlines() if " user=proxy " in f" {line} ")


async def test_a_tls_links_warm_up_opens_its_connection_with_one_context(
    tls_node: Node, tls_contexts_built: list[ssl.SSLContext]
) -> None:
    built = tls_contexts_built
    # A second to open a connection, not 100 ms: what this checks is that it opens and one
    # context serves the link, not how fast a loaded machine does TLS handshakes.
    url = f"rediss://127.0.0.1:{tls_node.port}/0"
    raw = {"url": url, "key_prefix": "tls-warm", "timeout": "1s"}
    parsed = parse_config({"redis": {**raw, **tls_node.access.config()}, **ROUTES}, {})
    config = parsed.redis
    assert config is not None and config.tls is not None and config.timeout == 1.0
    link = RedisLink(config, config.key_prefix, timeout=config.timeout)
    try:
        assert await link.warm()
        assert link.up
        # One context (none if an earlier test built the same one); commands share one
        # pipelined connection.
        assert len(built) <= 1
        assert proxy_clients(tls_node) == 1
        assert await link.ping()
        # A large command takes a pooled connection of its own, with the same context (the
        # CLIENT LIST above built one of its own).
        before = len(built)
        big = b"x" * (LARGE + 1)
        assert await link.run(lambda r: r.set("tls-warm:big", big)) is True
        assert await link.run(lambda r: r.get("tls-warm:big")) == big
        assert len(built) == before
        assert proxy_clients(tls_node) == 2
    finally:
        await link.client.aclose()


def test_connections_share_a_context_until_a_file_it_read_is_rewritten(tmp_path: Path) -> None:
    files: TlsFiles = tls_files()
    ca, cert, key = (str(tmp_path / name) for name in ("ca.crt", "client.crt", "client.key"))
    for source, copy in ((files.ca, ca), (files.client_cert, cert), (files.client_key, key)):
        shutil.copyfile(source, copy)
    # Building a TLS client is what makes its connections share contexts.
    connect(RedisConfig(url="rediss://127.0.0.1:1/0", tls=RedisTls(ca, cert, key)), 0.1)

    def context() -> ssl.SSLContext:
        connection = SSLConnection(ssl_ca_certs=ca, ssl_certfile=cert, ssl_keyfile=key)
        return connection.ssl_context.get()

    first = context()
    assert context() is first
    # A client certificate rotated in place: the next connection made reads it again.
    stat = os.stat(cert)
    os.utime(cert, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    rotated = context()
    assert rotated is not first
    assert context() is rotated
    # Other settings, another context.
    other = SSLConnection(ssl_ca_certs=ca, ssl_certfile=cert, ssl_keyfile=key, ssl_ciphers="ALL")
    assert other.ssl_context.get() is not rotated


def test_every_topologys_tls_connections_share_one_context() -> None:
    """The URL's, the Sentinel master's, the sentinels' own and the cluster nodes' connections,
    made as redis-py makes them (none connects here): one context for the same settings."""
    files = tls_files()
    tls = RedisTls(files.ca, files.client_cert, files.client_key)
    url = connect(RedisConfig(url="rediss://127.0.0.1:1/0", tls=tls), 0.1)
    sentinel = connect(RedisConfig(sentinel=SentinelService(("127.0.0.1:1",), "m"), tls=tls), 0.1)
    cluster = connect(RedisConfig(cluster=ClusterNodes(("127.0.0.1:1",)), tls=tls), 0.1)
    assert isinstance(url, Redis) and isinstance(sentinel, Redis)
    assert isinstance(cluster, RedisCluster)
    pool = sentinel.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    node = cluster.startup_nodes[0]  # the nodes it learns later are made with the same settings
    made: list[AbstractConnection] = [
        *(url.connection_pool.make_connection() for _ in range(2)),
        *(pool.make_connection() for _ in range(2)),
        *(s.connection_pool.make_connection() for s in pool.sentinel_manager.sentinels),
        *(node.connection_class(**node.connection_kwargs) for _ in range(2)),
    ]
    assert all(isinstance(c, SSLConnection) for c in made)
    contexts = {id(c.ssl_context.get()) for c in made if isinstance(c, SSLConnection)}
    assert len(contexts) == 1
    # A rediss:// URL without a tls key verifies against the system's CAs, on a context of its own
    # (other settings), shared by its connections all the same.
    bare = connect(RedisConfig(url="rediss://127.0.0.1:1/0"), 0.1)
    a, b = (bare.connection_pool.make_connection() for _ in range(2))
    assert isinstance(a, SSLConnection) and isinstance(b, SSLConnection)
    assert a.ssl_context.get() is b.ssl_context.get()
    assert id(a.ssl_context.get()) not in contexts


async def test_closing_a_link_to_a_frozen_redis_ends_without_an_error(tls_node: Node) -> None:
    """A TLS connection's close waits for the server's close_notify, which a frozen Redis
    (SIGSTOP, a partition) never sends: redis-py gives up after its timeout with an error. The
    proxy's shutdown closes its link then, and must neither fail nor wait on it for long."""
    url = f"rediss://127.0.0.1:{tls_node.port}/0"
    raw = {"url": url, "key_prefix": "tls-frozen", "timeout": "1s"}
    parsed = parse_config({"redis": {**raw, **tls_node.access.config()}, **ROUTES}, {})
    config = parsed.redis
    assert config is not None
    link = RedisLink(config, config.key_prefix, timeout=config.timeout)
    assert await link.warm()
    big = b"x" * (LARGE + 1)  # a pooled connection: closed waiting for the server's answer
    assert await link.run(lambda r: r.set("tls-frozen:big", big)) is True
    assert tls_node.child is not None
    pid = tls_node.child.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        await link.close()
        assert time.monotonic() - started < 3 * config.timeout
    finally:
        os.kill(pid, signal.SIGCONT)

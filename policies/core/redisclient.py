"""The redis-py client that reaches the Redis of the `redis:` section (policies/core/redisconfig):
tight timeouts, one retry for a connection Redis dropped, never a resend after a timeout, and
(but on a cluster) commands pipelined on one connection (`redisline`); the nodes in use, for
metrics."""

from __future__ import annotations

import os
import ssl
from typing import Any, Final

from redis.asyncio import Redis
from redis.asyncio import connection as redis_connection
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from policies.core.redisconfig import RedisConfig, RedisTls, gives_up_after, host_port
from policies.core.redisline import PipelinedRedis


class _Cluster(RedisCluster):
    """A cluster client that retries only a dropped connection: redis-py also resends after a
    timeout and waits out a CLUSTERDOWN, and a command sent twice may run twice."""

    ERRORS_ALLOW_RETRY = (RedisConnectionError,)  # type: ignore[assignment]  # a narrower tuple


def connect(config: RedisConfig, timeout: float) -> Redis | RedisCluster:
    """The client for `config`; it connects on its first command. ValueError for what the
    client refuses (a URL option it does not know)."""
    # redis-py's defaults (5 s timeouts, 10 retries) stall a request for seconds against a dead
    # server; `timeout` and one retry fail in milliseconds. The retry covers a pooled connection
    # a restarted Redis dropped; never a timeout, whose command may still run.
    common: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "health_check_interval": 0,
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    }
    if config.username is not None:
        common["username"] = config.username
    if config.password is not None:
        common["password"] = config.password
    _share_tls_contexts()  # also for a rediss:// URL without a tls key
    tls = _tls_options(config.tls)
    if config.cluster is not None:
        nodes = [ClusterNode(*host_port(n, 6379)) for n in config.cluster.nodes]
        cluster_retry = Retry(NoBackoff(), 1)
        return _Cluster(startup_nodes=nodes, **{**common, **tls, "retry": cluster_retry})
    if config.sentinel is not None:
        s = config.sentinel
        asked = {k: v for k, v in common.items() if k.startswith("socket_")}
        asked.update(tls)
        if s.username is not None:
            asked["username"] = s.username
        if s.password is not None:
            asked["password"] = s.password
        sentinels = [host_port(h, 26379) for h in s.hosts]
        manager = Sentinel(sentinels, sentinel_kwargs=asked, **common, **tls)  # type: ignore[no-untyped-call]  # redis-py: unannotated
        master = manager.master_for(s.service, db=s.db, redis_class=PipelinedRedis)
        assert isinstance(master, PipelinedRedis)
        master.stalled_after = gives_up_after(timeout)
        return master
    assert config.url is not None
    options = {**common, **{k: v for k, v in tls.items() if k != "ssl"}}
    client = PipelinedRedis.from_url(config.url, **options)
    assert isinstance(client, PipelinedRedis)
    client.stalled_after = gives_up_after(timeout)
    return client


def _tls_options(tls: RedisTls | None) -> dict[str, Any]:
    if tls is None:
        return {}
    options: dict[str, Any] = {"ssl": True, "ssl_check_hostname": tls.check_hostname}
    if tls.ca_file is not None:
        options["ssl_ca_certs"] = tls.ca_file
    if tls.cert_file is not None:
        options["ssl_certfile"] = tls.cert_file
    if tls.key_file is not None:
        options["ssl_keyfile"] = tls.key_file
    return options


# Contexts built, by the settings and files they were built from: one per link's TLS settings,
# and a few more when files are rewritten in place. Bounded all the same.
_CONTEXTS: dict[tuple[Any, ...], ssl.SSLContext] = {}
_MAX_CONTEXTS: Final = 8
# Every setting redis-py keeps for a context, read from the class: one it adds later is part of
# the key too, so connections with different settings never share a context.
_SETTINGS: Final = tuple(
    name for name in redis_connection.RedisSSLContext.__slots__ if name != "context"
)


class _SharedContext(redis_connection.RedisSSLContext):
    """redis-py's TLS settings for one connection, whose SSLContext is built once per set of
    settings, and of the files they name as they are on disk, then shared by every connection.

    redis-py 8 builds a context for each connection object it makes, and each build loads the
    system's CA bundle: ~50 ms of CPU on OpenSSL 3 (cpython#95031), in which the event loop
    serves nothing. A link makes up to `max_connections` connections to each node, and through
    Sentinel as many to a sentinel. So a TLS link's warm-up spent over a second of CPU on
    contexts, its 100 ms timeouts expired, and it began on in-process state; and a burst that
    opened connections stalled every request. redis-py has no way to pass a context in
    (redis-py#4211 would add one), so `_share_tls_contexts` puts this class where its TLS
    connections look for theirs: for the whole process, so a program embedding the proxy shares
    its own redis-py TLS contexts the same way (by identical settings only). A file rewritten
    in place is read again by the next connection object made, as it was before (redis-py's
    pools keep theirs, and their contexts)."""

    __slots__ = ()

    def get(self) -> ssl.SSLContext:
        if self.context is None:
            key = (
                *(_hashable(getattr(self, name)) for name in _SETTINGS),
                *(_on_disk(path) for path in (self.keyfile, self.certfile, self.ca_certs)),
            )
            found = _CONTEXTS.get(key)
            if found is None:
                found = super().get()  # raises, and keeps nothing, for a file it cannot load
                if len(_CONTEXTS) >= _MAX_CONTEXTS:
                    del _CONTEXTS[next(iter(_CONTEXTS))]  # the oldest
                _CONTEXTS[key] = found
            self.context = found
        return self.context


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _on_disk(path: str | None) -> tuple[int, ...] | None:
    """What tells a file's contents apart without reading them: device, inode, size, mtime."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _share_tls_contexts() -> None:
    """Make redis-py's TLS connections build their contexts as `_SharedContext` does."""
    redis_connection.RedisSSLContext = _SharedContext  # type: ignore[misc]  # no hook for it


def nodes_in_use(client: Redis | RedisCluster, config: RedisConfig) -> tuple[tuple[str, str], ...]:
    """(address, role) of each node the client sends commands to now, as far as it knows: the
    server of a URL, the master the sentinels named last, or the cluster's masters."""
    if isinstance(client, RedisCluster):
        return tuple(sorted((n.name, "master") for n in client.get_primaries()))
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        found = pool.master_address
        return () if found is None else ((f"{found[0]}:{found[1]}", "master"),)
    kwargs = pool.connection_kwargs
    where = kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    return ((str(where), "standalone"),)

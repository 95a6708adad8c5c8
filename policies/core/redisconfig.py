"""The `redis:` section as the proxy reads it: where shared state lives (one Redis by URL, the
master a Sentinel set names, or a cluster) and how to reach it. No redis-py here: a config
without Redis never loads it (policies/core/redisclient.py builds the client)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

DEFAULT_URL: Final = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True)
class RedisTls:
    """`redis.tls`: the CA that signs the servers' certificates (none: the system's), and a
    client certificate for servers that ask for one."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    check_hostname: bool = True  # off for nodes announced by an address their certificate lacks


@dataclass(frozen=True)
class SentinelService:
    """`redis.sentinel`: the sentinels to ask, the service they watch, and their own login."""

    hosts: tuple[str, ...]  # host:port
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ClusterNodes:
    """`redis.cluster`: nodes to learn the cluster's layout from (any live one will do)."""

    nodes: tuple[str, ...]  # host:port


@dataclass(frozen=True)
class RedisConfig:
    """The `redis:` section: exactly one of `url`, `sentinel` and `cluster`, with the data nodes'
    login and TLS."""

    url: str | None = None
    sentinel: SentinelService | None = None
    cluster: ClusterNodes | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: RedisTls | None = None
    key_prefix: str = "search-proxy"
    timeout: float = 0.1
    # Connections per process (to each master of a cluster) that carry one command at a time:
    # a burst of requests waits for a free one rather than opening a connection each. Commands
    # on a URL's or a Sentinel master's pipelined connection need none (policies/core/redisline).
    max_connections: int = 16

    @property
    def topology(self) -> str:
        """url, sentinel or cluster."""
        if self.sentinel is not None:
            return "sentinel"
        return "url" if self.cluster is None else "cluster"

    @property
    def secrets(self) -> tuple[str, ...]:
        """The passwords it holds (besides the URL's), for the logs to hide."""
        found = [self.password, self.sentinel.password if self.sentinel else None]
        return tuple(s for s in found if s)


def host_port(address: str, default_port: int) -> tuple[str, int]:
    """`host:port` (`[::1]:6379` for IPv6) as a pair; ValueError when it is not one."""
    parts = urlsplit(f"//{address}")
    if not parts.hostname or parts.path or parts.query or parts.username or parts.password:
        raise ValueError(f"expected host:port, got {address!r}")
    return parts.hostname, parts.port or default_port


def gives_up_after(timeout: float) -> float:
    """Seconds a caller waits on Redis before it moves on, for a link of `timeout`."""
    return 3 * timeout

"""Redis's own high-availability topologies on loopback, for tests and benchmarks: a Sentinel set
(a master, a replica, three sentinels) and a cluster (three masters, with a replica each when
asked), optionally over TLS and with an ACL user; a node can be SIGKILLed as a crash would end it.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from testkit.certs import TlsFiles
from testkit.procs import Child, StartError, free_port
from testkit.waiting import wait_until

SERVICE = "mymaster"
SENTINEL_DOWN_AFTER_MS = 1000
CLUSTER_NODE_TIMEOUT_MS = 1000
# Redis 7 waits 5 s for more replicas before a diskless full sync; ours come at once.
_SYNC_NOW = ["--repl-diskless-sync-delay", "0"]


# What the proxy's ACL user may run (deploy/README.md documents the same rule): reads, writes,
# scripts, pub/sub and connecting, Redis's clock, and the cluster's layout.
PROXY_COMMANDS = "+@read +@write +@scripting +@pubsub +@connection +time +cluster|slots"
_ADMIN = "admin"  # replication, sentinels and these helpers log in as it when users are on


@dataclass(frozen=True)
class Access:
    """How clients and nodes get in: an ACL user for the proxy, allowed PROXY_COMMANDS on keys
    and channels matching `keys` (the default user is then off, and an admin user with the same
    password does the rest), and TLS files (every port is then TLS only, and clients must show a
    certificate the CA signed)."""

    user: str | None = None
    password: str | None = None
    tls: TlsFiles | None = None
    keys: str = "*"

    def server_args(self, port: int) -> list[str]:
        """redis-server arguments: its port, TLS and users."""
        args = ["--port", str(port)]
        if self.tls is not None:
            t = self.tls
            args = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", t.cert]
            args += ["--tls-key-file", t.key, "--tls-ca-cert-file", t.ca]
            args += ["--tls-replication", "yes", "--tls-cluster", "yes"]
        if self.user is not None:
            secret = f">{self.password}"
            args += ["--user", "default", "off"]
            args += ["--user", _ADMIN, "on", secret, "~*", "&*", "+@all"]
            rule = [f"~{self.keys}", f"&{self.keys}", *PROXY_COMMANDS.split()]
            args += ["--user", self.user, "on", secret, *rule]
            args += ["--masteruser", _ADMIN, "--masterauth", str(self.password)]
        return args

    def client_kwargs(self) -> dict[str, Any]:
        """redis-py connection arguments for these helpers (the admin user, when users are on)."""
        kwargs: dict[str, Any] = {}
        if self.user is not None:
            kwargs.update(username=_ADMIN, password=self.password)
        if self.tls is not None:
            kwargs.update(ssl=True, ssl_ca_certs=self.tls.ca)
            kwargs.update(ssl_certfile=self.tls.client_cert, ssl_keyfile=self.tls.client_key)
        return kwargs

    def cli_args(self) -> list[str]:
        """redis-cli arguments for the same."""
        args: list[str] = []
        if self.tls is not None:
            t = self.tls
            args += ["--tls", "--cacert", t.ca, "--cert", t.client_cert, "--key", t.client_key]
        if self.user is not None:
            args += ["--user", _ADMIN, "--pass", str(self.password), "--no-auth-warning"]
        return args

    def config(self) -> dict[str, Any]:
        """The proxy's `redis:` keys that reach these nodes as its ACL user (besides where)."""
        found: dict[str, Any] = {}
        if self.user is not None:
            found.update(username=self.user, password=self.password)
        if self.tls is not None:
            t = self.tls
            found["tls"] = {"ca_file": t.ca, "cert_file": t.client_cert, "key_file": t.client_key}
        return found


def _binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("redis-server is not installed: apt-get install redis-server")
    return found


class Node:
    """One redis-server (a data node or a sentinel) on its own loopback port."""

    def __init__(self, name: str, port: int, argv: list[str], access: Access) -> None:
        self.name = name
        self.port = port
        self.argv = argv
        self.access = access
        self.child: Child | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.child = Child(self.name, self.argv)

    def wait_ready(self, within: float = 10.0) -> None:
        try:
            wait_until(self.answers, within, interval=0.02)
        except TimeoutError:
            tail = self.child.output_tail() if self.child is not None else ""
            self.kill()
            raise StartError(f"{self.name} did not start on {self.port}: {tail}") from None

    def client(self, timeout: float = 1.0) -> redis.Redis:
        """A synchronous client of this node (close it after use)."""
        return redis.Redis(
            "127.0.0.1", self.port, socket_timeout=timeout, **self.access.client_kwargs()
        )

    def answers(self) -> bool:
        if self.child is None or not self.child.alive():
            return False
        try:
            with self.client(0.2) as c:
                return bool(c.ping())
        except (redis.RedisError, OSError):
            return False

    def command(self, *args: Any, timeout: float = 1.0) -> Any:
        with self.client(timeout) as c:
            return c.execute_command(*args)

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    def kill(self) -> None:
        """SIGKILL, as a crash ends it."""
        if self.child is not None:
            self.child.kill()
            self.child = None


class SentinelSet:
    """A master, its replica and three sentinels watching them (quorum 2), as OPERATIONS.md
    describes: a master that stops answering for a second is replaced within a few seconds."""

    def __init__(self, access: Access | None = None) -> None:
        self.access = access or Access()
        self.dir = Path(tempfile.mkdtemp(prefix="search-proxy-sentinel-"))
        binary = _binary()
        master_port, replica_port = free_port(), free_port()
        base = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "no"]
        base += _SYNC_NOW
        self.nodes: list[Node] = []
        for name, port, extra in (
            ("redis-master", master_port, []),
            ("redis-replica", replica_port, ["--replicaof", "127.0.0.1", str(master_port)]),
        ):
            data = self.dir / name
            data.mkdir()
            argv = [binary, *base, "--dir", str(data), *self.access.server_args(port), *extra]
            self.nodes.append(Node(name, port, argv, self.access))
        self.sentinels = [self._sentinel(binary, i, master_port, free_port()) for i in range(1, 4)]

    def _sentinel(self, binary: str, i: int, master_port: int, port: int) -> Node:
        # Sentinel rewrites its config file: each gets its own, in the set's directory.
        lines = [
            "bind 127.0.0.1",
            "protected-mode no",
            f"dir {self.dir}",
            f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} 2",
            f"sentinel down-after-milliseconds {SERVICE} {SENTINEL_DOWN_AFTER_MS}",
            f"sentinel failover-timeout {SERVICE} 4000",
        ]
        access = self.access
        if access.tls is not None:
            t = access.tls
            lines += ["port 0", f"tls-port {port}", f"tls-cert-file {t.cert}"]
            lines += [f"tls-key-file {t.key}", f"tls-ca-cert-file {t.ca}", "tls-replication yes"]
        else:
            lines.append(f"port {port}")
        if access.user is not None:
            lines += [f"sentinel auth-user {SERVICE} {_ADMIN}"]
            lines += [f"sentinel auth-pass {SERVICE} {access.password}"]
        conf = self.dir / f"sentinel-{i}.conf"
        conf.write_text("\n".join(lines) + "\n")
        # Sentinels take no ACL user of ours: their clients connect without one.
        argv = [binary, str(conf), "--sentinel"]
        return Node(f"sentinel-{i}", port, argv, Access(tls=access.tls))

    @property
    def hosts(self) -> list[str]:
        return [s.address for s in self.sentinels]

    def config(self, **extra: Any) -> dict[str, Any]:
        """The proxy's `redis:` section for this set."""
        sentinel = {"hosts": self.hosts, "service": SERVICE}
        return {"sentinel": sentinel, **self.access.config(), **extra}

    def start(self) -> SentinelSet:
        for node in self.nodes:
            node.start()
        for node in self.nodes:
            node.wait_ready()
        wait_until(self._replica_in_sync, 10, interval=0.05)
        for sentinel in self.sentinels:
            sentinel.start()
        for sentinel in self.sentinels:
            sentinel.wait_ready()
        return self

    def wait_agreed(self, within: float = 20.0) -> None:
        """Until every sentinel knows the replica and the other sentinels (they announce
        themselves every 2 s), without which a failover has nobody to vote for it."""
        wait_until(self._sentinels_agree, within, interval=0.1)

    def _replica_in_sync(self) -> bool:
        with contextlib.suppress(redis.RedisError, OSError):
            info = self.nodes[1].command("INFO", "replication")
            return bool(info.get("master_link_status") == "up")
        return False

    def _sentinels_agree(self) -> bool:
        for sentinel in self.sentinels:
            try:
                state = sentinel.command("SENTINEL", "MASTER", SERVICE)
            except (redis.RedisError, OSError):
                return False
            # redis-py parses the answer into a mapping of bytes.
            replicas, others = state.get(b"num-slaves", 0), state.get(b"num-other-sentinels", 0)
            if int(replicas) < 1 or int(others) < 2:
                return False
        return True

    def master_port(self) -> int:
        """The master's port as the sentinels see it now."""
        for sentinel in self.sentinels:
            if not sentinel.alive():
                continue
            with contextlib.suppress(redis.RedisError, OSError):
                _, port = sentinel.command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                return int(port)
        raise RuntimeError("no sentinel answers")

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    @property
    def master(self) -> Node:
        return self.node(self.master_port())

    def kill_master(self) -> int:
        """SIGKILL the master once the sentinels are ready to replace it; returns its port."""
        self.wait_agreed()
        master = self.master
        master.kill()
        return master.port

    def wait_promoted(self, old_port: int, within: float = 20.0) -> Node:
        """The replica the sentinels promoted in place of `old_port`, once it serves as master."""

        def promoted() -> Node | None:
            with contextlib.suppress(RuntimeError, StopIteration):
                node = self.node(self.master_port())
                if node.port != old_port and node.alive():
                    with contextlib.suppress(redis.RedisError, OSError):
                        if node.command("ROLE")[0] == b"master":
                            return node
            return None

        return wait_until(promoted, within, interval=0.05)

    def stop(self) -> None:
        for node in (*self.sentinels, *self.nodes):
            node.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SentinelSet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ClusterSet:
    """`masters` cluster nodes owning all 16384 slots, each with `replicas` replicas; a killed
    master's replica is promoted after CLUSTER_NODE_TIMEOUT_MS and an election."""

    def __init__(self, masters: int = 3, replicas: int = 0, access: Access | None = None) -> None:
        self.access = access or Access()
        self.replicas = replicas
        self.dir = Path(tempfile.mkdtemp(prefix="search-proxy-cluster-"))
        binary = _binary()
        self.nodes: list[Node] = []
        for i in range(masters * (1 + replicas)):
            port, bus = free_port(), free_port()
            data = self.dir / f"node-{i}"
            data.mkdir()
            argv = [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            argv += ["--protected-mode", "no", "--dir", str(data), "--cluster-enabled", "yes"]
            argv += ["--cluster-config-file", "nodes.conf", "--cluster-port", str(bus)]
            argv += ["--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS), *_SYNC_NOW]
            argv += self.access.server_args(port)
            self.nodes.append(Node(f"redis-cluster-{i}", port, argv, self.access))

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    def config(self, **extra: Any) -> dict[str, Any]:
        """The proxy's `redis:` section for this cluster (every node as a start-up node)."""
        return {"cluster": {"nodes": self.addresses}, **self.access.config(), **extra}

    def start(self) -> ClusterSet:
        for node in self.nodes:
            node.start()
        for node in self.nodes:
            node.wait_ready()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed: apt-get install redis-tools")
        argv = [cli, *self.access.cli_args(), "--cluster", "create", *self.addresses]
        argv += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            self.stop()
            raise StartError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        wait_until(self._healthy, 30, interval=0.05)
        return self

    def _healthy(self) -> bool:
        """Every live node says the cluster is ok, and every replica has synced."""
        for node in self.nodes:
            if not node.alive():
                continue
            try:
                info = node.command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info:
                    return False
                replication = node.command("INFO", "replication")
            except (redis.RedisError, OSError):
                return False
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return False
        return True

    def master_of(self, key: str) -> Node:
        """The live master serving `key`'s slot now."""
        live = next(n for n in self.nodes if n.alive())
        slot = int(live.command("CLUSTER", "KEYSLOT", key))
        for start, end, master, *_ in live.command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == int(master[1]))
        raise RuntimeError(f"slot {slot} is not served")

    def kill(self, node: Node) -> None:
        node.kill()

    def wait_promoted(self, key: str, old: Node, within: float = 30.0) -> Node:
        """The master that serves `key` in place of `old`, once the cluster is ok again."""

        def promoted() -> Node | None:
            with contextlib.suppress(redis.RedisError, OSError, RuntimeError, StopIteration):
                node = self.master_of(key)
                if node is not old and node.alive() and self._healthy():
                    return node
            return None

        return wait_until(promoted, within, interval=0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ClusterSet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

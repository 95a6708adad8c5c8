"""The one Redis connection that shared state (buckets, breakers, cache) goes through, whichever
Redis it is: one server, a Sentinel-managed master (followed through failovers) or a cluster.

Redis is an optimisation, never a dependency: every call has a tight timeout, a failure marks
the link down for `retry_interval` (callers use their in-process state meanwhile), and the
first call after that probes again, so recovery needs no operator.

A command that timed out may still sit in a stalled Redis's input buffer and run when it wakes,
after its caller moved on. Scripts whose late run would do harm (taking a fetch lock, a token,
a breaker probe slot) take `not_after()` and refuse to act past it, on Redis's own clock.

One server or a Sentinel master is reached through one pipelined connection (`redisline`),
which carries every command under 64 KiB however many are in flight; a cluster through up to
`max_connections` connections to each master, one command on each at a time. Commands that need
a connection of their own (on a cluster, every one; else a large cache entry) share
`max_connections` of them per process, so a burst of requests shares connections instead of
opening one each: hundreds of connections opened at once would hold Redis's client slots, and
their set-up, late on a busy loop, would time out and mark a healthy Redis down. `warm` opens
them before the first request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, Final, TypeVar

import structlog
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterPubSub, RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from policies.core.clock import SYSTEM_CLOCK, Clock
from policies.core.events import Events, NullEvents
from policies.core.redisclient import connect, nodes_in_use
from policies.core.redisconfig import RedisConfig, gives_up_after
from policies.core.redisline import PipelinedRedis, PoolBusy
from policies.core.shared import UNAVAILABLE, Unavailable

T = TypeVar("T")
log = structlog.get_logger("search_proxy.redis")


# What "Redis could not be used" looks like: redis-py's errors, its cluster client's own (a
# slot no node serves during a failover is not a RedisError), sockets and timeouts.
REDIS_FAILURES: Final = (RedisError, RedisClusterException, OSError, TimeoutError)

# How often the offset between our clock and Redis's is measured again (clocks drift or step).
OFFSET_MAX_AGE = 60.0
# Slack on `not_after` for the offset's own error (half a round trip when it was measured).
_LATE_MARGIN = 0.05

_SCAN_PAGE = 500  # keys a SCAN page asks for: small enough to stay within the link's timeout
# How often the link looks again at which nodes it talks to (a failover moves them).
_NODES_MAX_AGE = 1.0


class RedisLink:
    """A redis.asyncio client with tight timeouts and an up/down state shared by all stores.

    `where` is a `RedisConfig` or, for a single server, its URL. On a cluster every key one
    script touches shares a {hash tag}, and breaker news goes over sharded pub/sub.
    """

    def __init__(
        self,
        where: str | RedisConfig,
        key_prefix: str = "search-proxy",
        *,
        timeout: float = 0.1,
        retry_interval: float = 1.0,
        events: Events | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.config = RedisConfig(url=where) if isinstance(where, str) else where
        self.client: Redis | RedisCluster = connect(self.config, timeout)
        self.cluster = isinstance(self.client, RedisCluster)
        self.prefix = key_prefix
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.events = events or NullEvents()
        self.clock = clock
        self._up = True
        self._next_probe = 0.0
        self._offset: float | None = None  # Redis TIME minus the real monotonic clock
        self._offset_at = 0.0
        self._nodes: tuple[tuple[str, str], ...] = ()
        self._nodes_at = -_NODES_MAX_AGE
        self._slots = asyncio.Semaphore(self.config.max_connections)
        # On the pipelined connection a command holds no connection of its own, and so no slot:
        # only its large commands, which take a pooled one, do (`_pooled_slot`).
        self._pipelined = isinstance(self.client, PipelinedRedis)
        if isinstance(self.client, PipelinedRedis):
            self.client.pooled_slot = self._pooled_slot

    @property
    def publish_command(self) -> str:
        """What a script announces breaker news with: sharded on a cluster, where a plain
        PUBLISH would travel to every node."""
        return "SPUBLISH" if self.cluster else "PUBLISH"

    def key(self, *parts: str) -> str:
        """A namespaced key: `<prefix>:<part>:<part>`."""
        return ":".join((self.prefix, *parts))

    @property
    def up(self) -> bool:
        return self._up

    @property
    def nodes(self) -> tuple[tuple[str, str], ...]:
        """(address, role) of the nodes in use when last looked at."""
        return self._nodes

    def usable(self) -> bool:
        """Whether to try Redis now: always when up, once per retry_interval when down."""
        return self._up or self.clock.now() >= self._next_probe

    @property
    def gives_up_after(self) -> float:
        """Seconds `run` waits for an answer before its caller moves on."""
        return gives_up_after(self.timeout)

    def not_after(self) -> int:
        """Redis-clock milliseconds past which a command sent now has no caller waiting for it
        (0 while the clock offset is unknown: no limit)."""
        if self._offset is None:
            return 0
        limit = SYSTEM_CLOCK.now() + self._offset + self.gives_up_after + _LATE_MARGIN
        return int(limit * 1000)

    def resync(self) -> None:
        """Measure the clock offset again before the next command (a script said LATE to a
        caller that was still waiting)."""
        self._offset = None

    async def run(self, op: Callable[[Any], Awaitable[T]]) -> T | Unavailable:
        """Run `op` against Redis, or return UNAVAILABLE at once when Redis is down, or when
        a command that needed a connection of its own found every one busy for the link's
        timeout (this process is busy: Redis is not marked down for it)."""
        if not self.usable():
            return UNAVAILABLE
        slotted = not self._pipelined
        if slotted and not await self._take_slot():
            self.events.redis_busy()
            return UNAVAILABLE
        try:
            if not self.usable():  # marked down while this one waited for its slot
                return UNAVAILABLE
            if not self._up:
                # One probe per interval, not a stampede of every waiting request.
                self._next_probe = self.clock.now() + self.retry_interval
            async with asyncio.timeout(self.gives_up_after):
                if self._offset is None or SYSTEM_CLOCK.now() - self._offset_at > OFFSET_MAX_AGE:
                    await self._measure_offset()
                value = await op(self.client)
        except PoolBusy:
            self.events.redis_busy()
            return UNAVAILABLE
        except REDIS_FAILURES as exc:
            self.mark_down(exc)
            return UNAVAILABLE
        finally:
            if slotted:
                self._slots.release()
        self.mark_up()
        return value

    @contextlib.asynccontextmanager
    async def _pooled_slot(self) -> AsyncIterator[None]:
        """A slot for a pipelined client's command on a pooled connection; PoolBusy when none
        came free within the link's timeout."""
        if not await self._take_slot():
            raise PoolBusy
        try:
            yield
        finally:
            self._slots.release()

    async def _take_slot(self) -> bool:
        """One of the `max_connections` slots, waiting up to the link's timeout while all are
        taken; False when none came free."""
        if not self._slots.locked():
            return await self._slots.acquire()  # free: taken without yielding
        try:
            async with asyncio.timeout(self.timeout):
                return await self._slots.acquire()
        except TimeoutError:
            return False

    async def warm(self, within: float = 2.0) -> bool:
        """Open the link's connections (and learn Redis's clock) before the first request, so
        a burst at start-up finds them open. Start-up waits on nobody: a connection slow to
        open is tried again until `within` seconds have passed. Whether Redis answered; when
        it never did, the link is down and shared state starts in-process."""
        deadline = SYSTEM_CLOCK.now() + within
        # A cluster's PING goes to one node unless told: each of its masters has its own pool.
        where = {"target_nodes": RedisCluster.PRIMARIES} if self.cluster else {}
        while True:
            failure: BaseException | None = None
            try:
                async with asyncio.timeout(max(0.0, deadline - SYSTEM_CLOCK.now())):
                    await self._measure_offset()
                    # As many PINGs at once as connections allowed: on a cluster each holds
                    # one open (a pipelined client sends them on its one). One refused
                    # (Redis's maxclients) leaves the others open, and Redis up.
                    answers = await asyncio.gather(
                        *(self.client.ping(**where) for _ in range(self.config.max_connections)),
                        return_exceptions=True,
                    )
                failures = [a for a in answers if isinstance(a, BaseException)]
                if len(failures) < len(answers):
                    self.mark_up()
                    return True
                failure = failures[0]
            except REDIS_FAILURES as exc:
                failure = exc
            # Slow (a timeout): try again while there is time. Refused: Redis is down.
            if not isinstance(failure, TimeoutError | RedisTimeoutError) or (
                SYSTEM_CLOCK.now() >= deadline
            ):
                self.mark_down(failure)
                return False
            await asyncio.sleep(0.05)

    async def _measure_offset(self) -> None:
        # Against the real clock, whatever clock the link was given: Redis's TIME is real time.
        sent = SYSTEM_CLOCK.now()
        seconds, micros = await self.client.time()
        received = SYSTEM_CLOCK.now()
        self._offset = seconds + micros / 1_000_000 - (sent + received) / 2
        self._offset_at = received

    def mark_down(self, exc: BaseException) -> None:
        """Record a failed call; logs and reports only the transition."""
        self._next_probe = self.clock.now() + self.retry_interval
        self._offset = None  # what answers next may be another Redis
        if self._up:
            self._up = False
            log.warning("redis_unreachable", error=type(exc).__name__, detail=str(exc)[:200])
            self.events.redis_state(False)

    def mark_up(self) -> None:
        """Record a successful call; logs and reports only the transition, and notices the
        nodes in use changing (a failover)."""
        if not self._up:
            self._up = True
            log.info("redis_recovered")
            self.events.redis_state(True)
            self._nodes_at = -_NODES_MAX_AGE
        if self.clock.now() - self._nodes_at >= _NODES_MAX_AGE:
            self._look_at_nodes()

    def _look_at_nodes(self) -> None:
        self._nodes_at = self.clock.now()
        found = nodes_in_use(self.client, self.config)
        if not found or found == self._nodes:
            return
        before = {address for address, _ in self._nodes}
        if before and before != {address for address, _ in found}:
            log.warning(
                "redis_master_changed",
                before=sorted(before),
                now=sorted(address for address, _ in found),
            )
            self.events.redis_failover()
        self._nodes = found
        self.events.redis_nodes(found)

    async def ping(self) -> bool:
        """A direct reachability check (readiness), not gated by the down interval. With every
        connection busy for the link's timeout, Redis is answering them: the state known."""
        slotted = not self._pipelined
        if slotted and not await self._take_slot():
            return self._up
        try:
            async with asyncio.timeout(self.gives_up_after):
                await self.client.ping()
        except REDIS_FAILURES as exc:
            self.mark_down(exc)
            return False
        finally:
            if slotted:
                self._slots.release()
        self.mark_up()
        return True

    def subscription(self, channel: str) -> Subscription:
        """Messages published on `channel` (sharded on a cluster)."""
        return Subscription(self, channel)

    async def unlink_matching(self, pattern: str) -> int | Unavailable:
        """Remove every key matching `pattern` (SCAN, page by page, on every master), each page
        within the link's timeout; the count removed, or UNAVAILABLE if Redis stopped answering."""
        removed = 0
        if isinstance(self.client, RedisCluster):
            targets: list[Any] = list(self.client.get_primaries())
        else:
            targets = [None]
        for node in targets:
            cursor = 0
            while True:
                found = await self.run(partial(_scan, cursor=cursor, node=node, pattern=pattern))
                if found is UNAVAILABLE:
                    return UNAVAILABLE
                cursor, names = found
                if names:
                    n = await self.run(partial(_unlink, names=names))
                    if n is UNAVAILABLE:
                        return UNAVAILABLE
                    removed += n
                if cursor == 0:
                    break
        return removed

    async def close(self) -> None:
        """Close the link's connections. A close Redis cannot complete (a TLS connection waits
        for the server's close_notify, which a frozen Redis never sends) ends at redis-py's
        timeout without an error: the process is shutting down or reloading, and nothing is
        left to fail."""
        with contextlib.suppress(*REDIS_FAILURES):
            await self.client.aclose()


async def _scan(client: Any, *, cursor: int, node: Any, pattern: str) -> tuple[int, list[bytes]]:
    """One SCAN page: of the one server, or of cluster master `node` (whose cursor redis-py
    keys by node name)."""
    if node is None:
        found, names = await client.scan(cursor, match=pattern, count=_SCAN_PAGE)
        return int(found), list(names)
    cursors, names = await client.scan(cursor, match=pattern, count=_SCAN_PAGE, target_nodes=node)
    return int(cursors[node.name]), list(names)


async def _unlink(client: Any, *, names: list[bytes]) -> int:
    # A cluster client splits the names by slot.
    return int(await client.unlink(*names))


class Subscription:
    """One channel's messages. A failed connection is dropped whole and the next `get`
    subscribes afresh, on whichever node serves the channel then (a failover moves it)."""

    def __init__(self, link: RedisLink, channel: str) -> None:
        self._link = link
        self.channel = channel
        self._pubsub: PubSub | ClusterPubSub | None = None

    @property
    def subscribed(self) -> bool:
        return self._pubsub is not None

    async def subscribe(self) -> None:
        """Subscribe now; one of REDIS_FAILURES when Redis cannot be reached."""
        if self._pubsub is not None:
            return
        client = self._link.client
        pubsub = client.pubsub()
        try:
            if isinstance(pubsub, ClusterPubSub):
                await pubsub.ssubscribe(self.channel)
            else:
                await pubsub.subscribe(self.channel)
        except BaseException:
            await _close(pubsub)
            raise
        self._pubsub = pubsub

    async def get(self, wait: float) -> bytes | None:
        """The next message's data, or None after `wait` s without one (subscribing first if
        need be); one of REDIS_FAILURES when the connection fails, which is then dropped."""
        try:
            await self.subscribe()
            pubsub = self._pubsub
            assert pubsub is not None
            if isinstance(pubsub, ClusterPubSub):
                message = await pubsub.get_sharded_message(
                    ignore_subscribe_messages=True, timeout=wait
                )
            else:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
        except REDIS_FAILURES:
            await self.close()
            raise
        if message is None or message.get("type") not in ("message", "smessage"):
            return None
        data: bytes = message["data"]
        return data

    async def close(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            await _close(pubsub)


async def _close(pubsub: PubSub | ClusterPubSub) -> None:
    with contextlib.suppress(*REDIS_FAILURES):
        await pubsub.aclose()

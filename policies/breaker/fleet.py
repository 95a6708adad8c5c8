"""Sharing a route's circuit with the other replicas through Redis: the record (a hash and a
channel), the fleet-wide half-open probe slots, and the loops that push and adopt transitions."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, NamedTuple

import structlog

from policies.breaker.config import RECORD_TTL
from policies.breaker.machine import Change, Circuit
from policies.breaker.snapshot import Snapshot, parse_snapshot, snapshot_from_hash
from policies.core.clock import Clock
from policies.core.shared import LATE, LATE_GUARD_LUA, UNAVAILABLE

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

log = structlog.get_logger("search_proxy.breaker")


class SlotGrant(NamedTuple):
    """A fleet-wide probe slot decision; `key` is None when Redis could not be asked."""

    admitted: bool
    key: str | None = None
    token: str = ""


_RECORD_TTL_MS: Final = int(RECORD_TTL * 1000)

_WRITE_LUA: Final = """
-- KEYS[1] state hash; KEYS[2..] probe slots, freed by every shared transition.
-- ARGV: state, since_us, opened_us, failures, origin, channel, message, ttl_ms, level,
-- publish command (SPUBLISH on a cluster: the channel shares the keys' hash tag).
-- Last writer wins by (since, origin), the order Snapshot.newer_than uses.
local current = redis.call('HMGET', KEYS[1], 'since', 'origin')
local since, new = tonumber(current[1] or '0'), tonumber(ARGV[2])
if since > new or (since == new and (current[2] or '') >= ARGV[5]) then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'since', ARGV[2], 'opened_at', ARGV[3],
           'failures', ARGV[4], 'origin', ARGV[5], 'level', ARGV[9])
redis.call('PEXPIRE', KEYS[1], ARGV[8])
if #KEYS > 1 then redis.call('DEL', unpack(KEYS, 2)) end
redis.call(ARGV[10], ARGV[6], ARGV[7])
return 1
"""

_ACQUIRE_LUA: Final = (
    LATE_GUARD_LUA
    + """
-- KEYS: probe slots; ARGV: token, lease_ms, not-after ms. Returns the index taken, 0 when all
-- are busy, or -1 when the caller gave up before this ran (a slot nobody would release).
if too_late(ARGV[3]) then return -1 end
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, ARGV[1], 'NX', 'PX', ARGV[2]) then return i end
end
return 0
"""
)

_RELEASE_LUA: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisBreakerState:
    """One route's breaker record in Redis: a hash, N probe-slot keys and a channel.

    Keys share the `{route}` hash tag so each script touches one cluster slot. Every call goes
    through the RedisLink, so an unreachable Redis costs milliseconds and the caller falls back.
    """

    def __init__(self, link: RedisLink, route: str, probes: int, probe_lease: float) -> None:
        self._link = link
        self._route = route
        tag = f"{{{route}}}"
        self.key = link.key("breaker", tag)
        self.slots = [link.key("breaker", tag, "probe", str(i)) for i in range(1, probes + 1)]
        self.channel = link.key("breaker", tag, "events")
        self._lease_ms = max(1, int(probe_lease * 1000))
        self._write = link.client.register_script(_WRITE_LUA)
        self._acquire = link.client.register_script(_ACQUIRE_LUA)
        self._release = link.client.register_script(_RELEASE_LUA)
        self._publish = link.publish_command
        self._tokens = itertools.count()
        self._instance = secrets.token_hex(6)
        # Python 3.11's wait_for (inside redis-py) can swallow a cancel, so the background
        # loops also stop on this flag.
        self.running = False

    async def write(self, snap: Snapshot) -> bool:
        """Store and publish `snap` unless Redis holds newer; False if Redis is unreachable."""
        fields = (snap.state, snap.since_us, snap.opened_us, snap.failures, snap.origin)
        args = (*fields, self.channel, snap.encode(), _RECORD_TTL_MS, snap.level, self._publish)
        keys = [self.key, *self.slots]
        result = await self._link.run(lambda r: self._write(keys=keys, args=args, client=r))
        return result is not UNAVAILABLE

    async def read(self) -> Snapshot | None:
        """The shared record; None when there is none or Redis is unreachable."""
        fields = await self._link.run(lambda r: r.hgetall(self.key))
        if fields is UNAVAILABLE or not fields:
            return None
        return snapshot_from_hash(fields)

    async def acquire_probe(self) -> SlotGrant:
        """Take one of the fleet's half-open probe slots (SET NX PX)."""
        token = f"{self._instance}:{next(self._tokens)}"
        index = await self._link.run(
            lambda r: self._acquire(
                keys=self.slots, args=(token, self._lease_ms, self._link.not_after()), client=r
            )
        )
        if index == LATE:
            self._link.resync()  # we were still waiting: our idea of Redis's clock is off
            index = UNAVAILABLE
        if index is UNAVAILABLE:
            return SlotGrant(True)
        if not index:
            return SlotGrant(False)
        return SlotGrant(True, self.slots[int(index) - 1], token)

    async def release_probe(self, grant: SlotGrant) -> None:
        """Free a slot we hold; if Redis is unreachable, its lease frees it instead."""
        if grant.key is None:
            return
        keys, args = [grant.key], [grant.token]
        await self._link.run(lambda r: self._release(keys=keys, args=args, client=r))

    async def listen(
        self,
        apply: Callable[[Snapshot], None],
        resync: Callable[[], None],
        retry_every: float,
        ready: asyncio.Event,
    ) -> None:
        """Apply every snapshot published on the channel until `running` is cleared.

        Sets `ready` once the first subscription attempt has ended, whether or not Redis is up.
        """
        from policies.core.redislink import REDIS_FAILURES  # a link exists: redis-py is loaded

        subscription = self._link.subscription(self.channel)
        lost = False
        try:
            while self.running:
                try:
                    if not subscription.subscribed:
                        try:
                            await subscription.subscribe()
                        finally:
                            ready.set()
                    data = await subscription.get(retry_every)
                except REDIS_FAILURES as exc:
                    if not lost:
                        lost = True
                        log.warning("breaker_subscription_lost", route=self._route, error=str(exc))
                    await asyncio.sleep(retry_every)
                    continue
                if lost:
                    lost = False
                    log.info("breaker_subscription_resumed", route=self._route)
                    # Messages published during the outage are gone: read the record now.
                    resync()
                if data is not None:
                    snap = parse_snapshot(data)
                    if snap is not None:
                        apply(snap)
        finally:
            await subscription.close()


class Fleet:
    """Keeps a circuit in step with the other replicas: pushes its local changes, adopts theirs
    from pub/sub, and every `sync_interval` reads the record to repair what pub/sub lost.

    A transition never waits on Redis: local changes are queued (`publish`, `release`) and
    written by the sync loop; while Redis is away each replica keeps its own circuit.
    """

    def __init__(
        self,
        route: str,
        shared: RedisBreakerState,
        circuit: Circuit,
        clock: Clock,
        apply: Callable[[Change], None],
        sync_interval: float,
    ) -> None:
        self._route = route
        self._shared = shared
        self._circuit = circuit
        self._clock = clock
        self._apply = apply  # the side effects of a change the fleet brought
        self._interval = sync_interval
        self._dirty = False  # the circuit's snapshot has not reached Redis yet
        self._wake = asyncio.Event()
        self._releases: list[SlotGrant] = []

    def publish(self) -> None:
        """Queue the circuit's snapshot, a local change, for Redis."""
        self._dirty = True
        self._wake.set()

    async def acquire_probe(self) -> SlotGrant:
        """Take one of the fleet's half-open probe slots; admitted without a key when Redis
        cannot be asked (the local gate decides alone)."""
        return await self._shared.acquire_probe()

    def release(self, grant: SlotGrant) -> None:
        """Queue a probe slot we hold for release."""
        self._releases.append(grant)
        self._wake.set()

    async def start(self) -> list[asyncio.Task[None]]:
        """Start the sync and listen loops; returns once subscribed (or Redis found down)."""
        self._shared.running = True
        subscribed = asyncio.Event()
        listen = self._shared.listen(self._adopt, self._wake.set, self._interval, subscribed)
        tasks = [
            asyncio.create_task(self._sync(), name=f"breaker-sync-{self._route}"),
            asyncio.create_task(listen, name=f"breaker-listen-{self._route}"),
        ]
        # A trip published before we subscribe would wait for the periodic read.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await subscribed.wait()
        return tasks

    def stop(self) -> None:
        """Let the loops end (their tasks are cancelled by the owner)."""
        self._shared.running = False
        self._wake.set()

    async def flush(self) -> None:
        """Free queued probe slots and write the snapshot if it has not reached Redis."""
        while self._releases:
            await self._shared.release_probe(self._releases.pop())
        if self._dirty:
            self._dirty = False
            if not await self._shared.write(self._circuit.snapshot):
                self._dirty = True  # Redis is down: the next tick tries again

    def _adopt(self, snap: Snapshot) -> None:
        change = self._circuit.adopt(snap, self._clock.now(), self._clock.wall())
        if change is not None:
            self._dirty = False  # whatever we had not pushed is superseded
            self._apply(change)

    async def _sync(self) -> None:
        """Push local changes, and every `sync_interval` read what pub/sub may have lost."""
        while self._shared.running:
            await self.flush()
            snap = await self._shared.read()
            if snap is not None:
                self._adopt(snap)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval):
                    await self._wake.wait()
            self._wake.clear()

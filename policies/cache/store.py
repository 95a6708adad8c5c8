"""Where cache entries live: an in-process LRU, Redis shared by the replicas, or both as two
tiers, chosen once by `build_store`. Stores only move bytes; the policy decides."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

import structlog

from policies.cache.config import CacheConfig
from policies.cache.entry import Entry
from policies.cache.lock import NO_LEASE, Found, LockAsk, LockState, LockStore, Poll
from policies.core.clock import SYSTEM_CLOCK, Clock
from policies.core.shared import LATE, LATE_GUARD_LUA, UNAVAILABLE

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

log = structlog.get_logger("search_proxy.cache")


class Cleared(NamedTuple):
    """Entries removed by `clear`: in this process, and in Redis (None: not reachable)."""

    local: int
    shared: int | None


class CacheStore(LockStore, Protocol):
    """Where entries live, and the fetch locks (`LockStore`); stores only move bytes, the policy
    decides."""

    @property
    def local(self) -> MemoryStore | None:
        """The in-process tier, if the store has one."""
        ...

    async def lookup(self, key: str, fresh_after: float, ask: LockAsk | None = None) -> Found:
        """The newest entry for `key` and, when it was not stored after `fresh_after` (wall
        seconds: not fresh) and `ask` is given, the fetch lock, in one round trip; a later
        tier is asked only when the first tier's entry is not fresh."""
        ...

    async def put(self, key: str, entry: Entry, *, unlock: str | None = None) -> None:
        """Keep `entry` until stored_at + ttl + stale_ttl; `unlock` (an owner token) also
        releases the fetch lock it holds."""
        ...

    async def clear(self, route: str) -> Cleared:
        """Remove every entry of `route`."""
        ...


class MemoryStore:
    """The in-process tier: an LRU bounded by entry count and by bytes."""

    keeps_locks = False

    def __init__(self, retain: float, max_entries: int, max_bytes: int, clock: Clock) -> None:
        self.retain = retain
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.clock = clock
        # Entries alone: a size is read again on removal (`Entry.size` is a few additions), so a
        # slot does not hold a tuple and an int besides (88 of an entry's ~1,950 bytes).
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def local(self) -> MemoryStore:
        return self

    @property
    def nbytes(self) -> int:
        """Bytes held, as counted against `max_bytes`."""
        return self._bytes

    def peek(self, key: str) -> Entry | None:
        """The entry for `key` unless past retention; marks it recently used."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.stored_at + self.retain <= self.clock.wall():
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return entry

    def keep(self, key: str, entry: Entry) -> None:
        """Store `entry`, evicting the least recently used until both bounds hold."""
        size = entry.size
        if key in self._entries:
            self._remove(key)
        if size > self.max_bytes or entry.stored_at + self.retain <= self.clock.wall():
            return
        self._entries[key] = entry
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size

    def _remove(self, key: str) -> None:
        self._bytes -= self._entries.pop(key).size

    async def lookup(self, key: str, fresh_after: float, ask: LockAsk | None = None) -> Found:
        # One process: the policy's in-flight map already makes one fetch per key.
        return Found(self.peek(key))

    async def put(self, key: str, entry: Entry, *, unlock: str | None = None) -> None:
        self.keep(key, entry)

    async def poll(self, key: str) -> Poll:
        return Poll(self.peek(key), held=False)

    async def unlock(self, key: str, token: str) -> None:
        pass

    async def clear(self, route: str) -> Cleared:
        prefix = route + ":"
        doomed = [k for k in self._entries if k.startswith(prefix)]
        for key in doomed:
            self._remove(key)
        return Cleared(local=len(doomed), shared=None)


# An entry's bytes start with its version (1) and stored_at, a big-endian double (entry.py).
_FRESH_LUA: Final = """
local function fresh(entry, after)
  if not entry or string.byte(entry, 1) ~= 1 then return false end
  return struct.unpack('>d', entry, 2) > tonumber(after)
end
"""

_LOOKUP_LUA: Final = (
    LATE_GUARD_LUA
    + _FRESH_LUA
    + """
-- KEYS[1] the entry, KEYS[2] its fetch lock (one hash tag: one cluster slot).
-- ARGV: fresh after (wall s), owner token ('': no lock asked), ttl ms, not-after ms.
-- {entry or nil, 1: lock taken | 0: another owner holds it | -1: LATE | 2: none asked or needed}
local entry = redis.call('GET', KEYS[1])
if ARGV[2] == '' or fresh(entry, ARGV[1]) then return {entry, 2} end
if too_late(ARGV[4]) then return {entry, -1} end
if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', ARGV[3]) then return {entry, 1} end
return {entry, 0}
"""
)

_UNLOCK_LUA: Final = """
-- KEYS[1] the lock; ARGV[1] the owner token: only the owner deletes it.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# The entry is written before the lock goes, so a waiting replica that sees the lock gone
# also sees the entry.
_STORE_LUA: Final = """
-- KEYS[1] the entry, KEYS[2] its fetch lock; ARGV: entry bytes, px, owner token.
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1
"""

_POLL_LUA: Final = """
-- KEYS[1] the entry, KEYS[2] its fetch lock: {entry or nil, whether the lock is held}.
return {redis.call('GET', KEYS[1]), redis.call('EXISTS', KEYS[2])}
"""

_LOCK_STATES: Final = {1: LockState.ACQUIRED, 0: LockState.HELD}


class RedisStore:
    """The shared tier. Entries at `<prefix>:cache:{<route>:<sha256>}` (SET PX ttl+stale_ttl),
    fetch locks at `<prefix>:cache-lock:{<route>:<sha256>}` (an owner token, SET NX PX, from a
    script that takes nothing after its caller gave up): one hash tag, so one script reads the
    entry and takes the lock, and one stores it and frees the lock, on a cluster too. Redis
    down = a miss."""

    keeps_locks = True
    local = None  # Redis alone: no in-process tier

    def __init__(self, link: RedisLink, retain: float, clock: Clock) -> None:
        self.link = link
        self.retain = retain
        self.clock = clock
        client = link.client
        self._lookup = client.register_script(_LOOKUP_LUA)
        self._unlock = client.register_script(_UNLOCK_LUA)
        self._store = client.register_script(_STORE_LUA)
        self._poll = client.register_script(_POLL_LUA)

    def entry_key(self, key: str) -> str:
        """The Redis key holding the entry for cache key `key`."""
        return self.link.key("cache", f"{{{key}}}")

    def lock_key(self, key: str) -> str:
        """The Redis key of the fetch lock for cache key `key`."""
        return self.link.key("cache-lock", f"{{{key}}}")

    def _decode(self, raw: Any) -> Entry | None:
        if raw is None or raw is UNAVAILABLE:
            return None
        try:
            return Entry.from_bytes(raw)
        except ValueError as exc:
            log.warning("cache_entry_unreadable", detail=str(exc)[:200])
            return None

    async def lookup(self, key: str, fresh_after: float, ask: LockAsk | None = None) -> Found:
        keys = [self.entry_key(key), self.lock_key(key)]
        token, ttl_ms = ("", 0) if ask is None else (ask.token, max(1, math.ceil(ask.ttl * 1000)))
        after = repr(fresh_after) if math.isfinite(fresh_after) else "1e308"
        found = await self.link.run(
            lambda r: self._lookup(
                keys=keys, args=[after, token, ttl_ms, self.link.not_after()], client=r
            )
        )
        if found is UNAVAILABLE:
            return Found(None)
        raw, state = found
        if state == LATE:
            # We were still waiting, so our idea of Redis's clock is off: measure it again.
            self.link.resync()
        lock = _LOCK_STATES.get(int(state), LockState.ABSENT)
        return Found(self._decode(raw), NO_LEASE if ask is None else ask.lease(lock))

    async def put(self, key: str, entry: Entry, *, unlock: str | None = None) -> None:
        px = math.ceil((entry.stored_at + self.retain - self.clock.wall()) * 1000)
        if px <= 0:
            if unlock is not None:
                await self.unlock(key, unlock)
            return
        name, data = self.entry_key(key), entry.to_bytes()
        if unlock is None:
            await self.link.run(lambda r: r.set(name, data, px=px))
            return
        keys, args = [name, self.lock_key(key)], (data, px, unlock)
        await self.link.run(lambda r: self._store(keys=keys, args=args, client=r))

    async def poll(self, key: str) -> Poll:
        keys = [self.entry_key(key), self.lock_key(key)]
        found = await self.link.run(lambda r: self._poll(keys=keys, args=[], client=r))
        if found is UNAVAILABLE:
            return Poll(None, held=False)
        return Poll(self._decode(found[0]), held=bool(found[1]))

    async def unlock(self, key: str, token: str) -> None:
        name = self.lock_key(key)
        await self.link.run(lambda r: self._unlock(keys=[name], args=[token], client=r))

    async def clear(self, route: str) -> Cleared:
        # Route names are [a-z0-9_-], so the pattern has no glob characters but the last.
        removed = await self.link.unlink_matching(self.link.key("cache", f"{{{route}:*"))
        return Cleared(local=0, shared=None if removed is UNAVAILABLE else removed)


class TieredStore:
    """The in-process LRU in front of Redis: always read and written; Redis when it answers."""

    keeps_locks = True

    def __init__(self, local: MemoryStore, shared: RedisStore) -> None:
        self.local = local
        self.shared = shared

    async def lookup(self, key: str, fresh_after: float, ask: LockAsk | None = None) -> Found:
        entry = self.local.peek(key)
        if entry is not None and entry.stored_at > fresh_after:
            return Found(entry)
        found = await self.shared.lookup(key, fresh_after, ask)
        remote = found.entry
        if remote is not None and (entry is None or remote.stored_at > entry.stored_at):
            self.local.keep(key, remote)
            return found
        return Found(entry, found.lease)

    async def put(self, key: str, entry: Entry, *, unlock: str | None = None) -> None:
        self.local.keep(key, entry)
        await self.shared.put(key, entry, unlock=unlock)

    async def poll(self, key: str) -> Poll:
        found = await self.shared.poll(key)
        if found.entry is not None:
            self.local.keep(key, found.entry)
        return found

    async def unlock(self, key: str, token: str) -> None:
        await self.shared.unlock(key, token)

    async def clear(self, route: str) -> Cleared:
        local = await self.local.clear(route)
        shared = await self.shared.clear(route)
        return Cleared(local=local.local, shared=shared.shared)


def build_store(
    cfg: CacheConfig, link: RedisLink | None, clock: Clock = SYSTEM_CLOCK
) -> CacheStore:
    """One route's store: the in-process LRU, in front of Redis when a link is configured."""
    retain = cfg.ttl + cfg.stale_ttl
    local = MemoryStore(retain, cfg.max_entries, cfg.max_bytes, clock)
    return local if link is None else TieredStore(local, RedisStore(link, retain, clock))

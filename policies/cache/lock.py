"""The cross-replica fetch lock: one replica calls the vendor for a key while the others poll the
shared tier for its entry, for at most `lock_wait`, before they call the vendor themselves."""

from __future__ import annotations

import enum
import math
from typing import NamedTuple, Protocol

from policies.cache.config import CacheConfig
from policies.cache.entry import Entry, Freshness, freshness
from policies.core.clock import Clock

# A crashed leader's lock blocks other replicas' followers no longer than their lock_wait, and
# expires after this at the latest.
_MAX_LOCK_TTL = 120.0


class LockState(enum.Enum):
    """The outcome of asking for the cross-replica fetch lock."""

    ACQUIRED = "acquired"  # we fetch; other replicas wait for our entry
    HELD = "held"  # another replica is fetching this key
    ABSENT = "absent"  # no shared lock (no Redis, or it is down): fetch without one


class Poll(NamedTuple):
    """The shared tier's entry for a key, and whether a replica still holds its fetch lock."""

    entry: Entry | None
    held: bool


class LockStore(Protocol):
    """The part of a cache store that keeps the fetch locks."""

    async def lock(self, key: str, ttl: float) -> LockState:
        """Take the cross-replica fetch lock for `key` for at most `ttl` seconds."""
        ...

    async def poll(self, key: str) -> Poll:
        """One look at the shared tier while another replica fetches `key`."""
        ...

    async def unlock(self, key: str) -> None:
        """Release the fetch lock without storing."""
        ...


class FetchLock:
    """One route's fetch lock across replicas, kept in its store (SET NX PX in Redis).

    `acquire` takes it until the caller's deadline; its owner releases it by storing the entry
    (`put(..., unlock=True)`) or with `release`. A request that finds it held `wait`s for the
    owner's entry, then fetches itself when none came.
    """

    def __init__(
        self, store: LockStore, cfg: CacheConfig, clock: Clock, poll_interval: float
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.clock = clock
        self.poll_interval = poll_interval

    async def acquire(self, key: str, deadline: float) -> LockState:
        """Take the lock for `key`; ABSENT when `lock_wait` is 0 or there is no shared tier."""
        if self.cfg.lock_wait > 0:
            remaining = deadline - self.clock.now()
            # The lock outlives the leader's call (bounded by its deadline), so only its owner
            # ever deletes it; a crashed leader's lock still expires.
            ttl = min(max(remaining, self.cfg.lock_wait), _MAX_LOCK_TTL)
            return await self.store.lock(key, ttl)
        return LockState.ABSENT

    async def wait(
        self, key: str, deadline: float, seen: Entry | None
    ) -> tuple[Entry, float] | None:
        """Wait for another replica's leader to store `key`: a fresh entry newer than `seen` and
        its age, or None, meaning "fetch it yourself".

        Polls every `poll_interval` for at most min(lock_wait, time left before `deadline`), and
        stops early when the lock is released without a new fresh entry.
        """
        now = self.clock.now()
        until = now + min(self.cfg.lock_wait, deadline - now)
        seen_at = seen.stored_at if seen is not None else -math.inf
        while True:
            entry, held = await self.store.poll(key)
            if entry is not None and entry.stored_at > seen_at:
                state, age = freshness(
                    entry.stored_at, self.clock.wall(), self.cfg.ttl, self.cfg.stale_ttl
                )
                if state is Freshness.FRESH:
                    return entry, age
            left = until - self.clock.now()
            if not held or left <= 0:
                return None
            await self.clock.sleep(min(self.poll_interval, left))

    async def release(self, key: str) -> None:
        """Release a lock taken by `acquire` when no entry was stored."""
        await self.store.unlock(key)

"""The cross-replica fetch lock: one replica calls the vendor for a key while the others poll the
shared tier for its entry, for at most `lock_wait`, before they call the vendor themselves."""

from __future__ import annotations

import enum
import itertools
import math
import secrets
from typing import NamedTuple, Protocol

from policies.cache.config import CacheConfig
from policies.cache.entry import Entry, Freshness, freshness
from policies.core.clock import Clock


class LockState(enum.Enum):
    """The outcome of asking for the cross-replica fetch lock."""

    ACQUIRED = "acquired"  # we fetch; other replicas wait for our entry
    HELD = "held"  # another replica is fetching this key
    ABSENT = "absent"  # no shared lock (no Redis, or it is down): fetch without one


class Lease(NamedTuple):
    """What a lookup's lock ask got: the state, and the owner token when ACQUIRED."""

    state: LockState
    token: str = ""


NO_LEASE = Lease(LockState.ABSENT)


class LockAsk(NamedTuple):
    """A request for the fetch lock, sent along with the lookup: the owner token to take it
    under, for at most `ttl` seconds."""

    token: str
    ttl: float

    def lease(self, state: LockState) -> Lease:
        """The lease this ask got when the store answered `state`."""
        return Lease(state, self.token) if state is LockState.ACQUIRED else Lease(state)


class Found(NamedTuple):
    """What a lookup found: the newest entry (None: none), and the fetch lock it took for an
    entry that was missing or not fresh (NO_LEASE when none was asked for or needed)."""

    entry: Entry | None
    lease: Lease = NO_LEASE


class Poll(NamedTuple):
    """The shared tier's entry for a key, and whether a replica still holds its fetch lock."""

    entry: Entry | None
    held: bool


class LockStore(Protocol):
    """The part of a cache store that keeps the fetch locks."""

    # Whether it keeps them at all: only a store shared by replicas does (in one process the
    # policy's in-flight map already makes one fetch per key).
    keeps_locks: bool

    async def poll(self, key: str) -> Poll:
        """One look at the shared tier while another replica fetches `key`."""
        ...

    async def unlock(self, key: str, token: str) -> None:
        """Release the fetch lock without storing, if `token` still holds it."""
        ...


class FetchLock:
    """One route's fetch lock across replicas, kept in its store (SET NX PX in Redis).

    A lookup takes it (`ask`) for `lock_wait` under a fresh owner token; its owner releases it by
    storing the entry (`put(..., unlock=token)`) or with `release`, and only the owner can. A
    request that finds it held `wait`s for the owner's entry, then fetches itself when none came.

    Why `lock_wait` and not the leader's whole call: a follower waits at most `lock_wait` anyway,
    so a longer lock would only hold back requests arriving later, and a lock whose leader is
    gone (crashed, or its SET reached a stalled Redis after it had moved on) lapses within
    `lock_wait`. A leader slower than that may see another replica lead the next call.
    """

    def __init__(
        self, store: LockStore, cfg: CacheConfig, clock: Clock, poll_interval: float
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.clock = clock
        self.poll_interval = poll_interval
        # Owner tokens: unique per process and request, cheaper than random bytes per lookup.
        self._instance = secrets.token_hex(6)
        self._tokens = itertools.count()

    def ask(self, deadline: float) -> LockAsk | None:
        """A request for the lock, to send with a lookup; None when the store keeps no locks,
        `lock_wait` is 0 or the caller has no time left to use it."""
        if not self.store.keeps_locks or self.cfg.lock_wait <= 0 or deadline <= self.clock.now():
            return None
        return LockAsk(f"{self._instance}:{next(self._tokens)}", self.cfg.lock_wait)

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

    async def release(self, key: str, lease: Lease) -> None:
        """Release a lock a lookup took (its lease) when no entry was stored."""
        if lease.state is LockState.ACQUIRED:
            await self.store.unlock(key, lease.token)

"""The stale-while-error cache: fresh entries answer, stale ones stand in when the vendor fails.

Pure decisions in `key` and `entry`, byte stores in `store`, the cross-replica fetch lock in
`lock`, and `StaleCache`, the policy, in `policy`."""

from policies.cache.config import CacheConfig
from policies.cache.entry import Entry, Freshness, default_storable, entry_from_reply, freshness
from policies.cache.key import (
    NO_KNOWN_CREDENTIALS,
    Directives,
    KnownCredentials,
    cache_key,
    request_directives,
)
from policies.cache.lock import FetchLock, Lease, LockState, LockStore, Poll
from policies.cache.policy import StaleCache
from policies.cache.store import (
    CacheStore,
    Cleared,
    MemoryStore,
    RedisStore,
    TieredStore,
    build_store,
)

__all__ = [
    "NO_KNOWN_CREDENTIALS",
    "CacheConfig",
    "CacheStore",
    "Cleared",
    "Directives",
    "Entry",
    "FetchLock",
    "Freshness",
    "KnownCredentials",
    "Lease",
    "LockState",
    "LockStore",
    "MemoryStore",
    "Poll",
    "RedisStore",
    "StaleCache",
    "TieredStore",
    "build_store",
    "cache_key",
    "default_storable",
    "entry_from_reply",
    "freshness",
    "request_directives",
]

"""The stale-while-error cache: fresh entries answer, stale ones stand in when the vendor fails.

Pure decisions in `key` and `entry`, byte stores in `store`, the cross-replica fetch lock in
`lock`, and `StaleCache`, the policy, in `policy`."""

from collections.abc import Callable

from policies.cache.config import SECTION, CacheConfig
from policies.cache.entry import (
    SESSION_HEADERS,
    Entry,
    Freshness,
    default_storable,
    entry_from_reply,
    freshness,
    opens_session,
)
from policies.cache.key import (
    NO_KNOWN_CREDENTIALS,
    Directives,
    KnownCredentials,
    cache_key,
    request_directives,
    session_traffic,
)
from policies.cache.lock import FetchLock, Found, Lease, LockAsk, LockState, LockStore, Poll
from policies.cache.policy import StaleCache
from policies.cache.store import (
    CacheStore,
    Cleared,
    MemoryStore,
    RedisStore,
    TieredStore,
    build_store,
)
from policies.core.flow import Classifier, Reply
from policies.core.outcome import Outcome
from policies.core.profile import VendorProfile
from policies.core.route import RouteConfig
from policies.core.section import Build, Link

__all__ = [
    "LINK",
    "NO_KNOWN_CREDENTIALS",
    "SECTION",
    "SESSION_HEADERS",
    "CacheConfig",
    "CacheStore",
    "Cleared",
    "Directives",
    "Entry",
    "FetchLock",
    "Found",
    "Freshness",
    "KnownCredentials",
    "Lease",
    "LockAsk",
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
    "known_credentials",
    "opens_session",
    "request_directives",
    "session_traffic",
]


def known_credentials(route: RouteConfig, profile: VendorProfile | None) -> KnownCredentials:
    """Where this route's requests carry credentials, for its cache key: every header it sets,
    the profile's own search headers, and where its vendor reads the key."""
    headers = {name.lower() for name in route.headers.set}
    params: set[str] = set()
    if profile is not None:
        headers.update(name.lower() for name in profile.search_headers)
        slot = profile.key_slot
        if slot is not None:
            (headers if slot.kind == "header" else params).add(slot.name.lower())
    return KnownCredentials(frozenset(headers), frozenset(params))


def _storable(classify: Classifier) -> Callable[[Reply], bool]:
    """A search answer is cached when it is a 2xx the profile reads as results or as empty."""

    def storable(reply: Reply) -> bool:
        return 200 <= reply.status < 300 and classify(reply) in (Outcome.OK, Outcome.EMPTY)

    return storable


def build(cfg: CacheConfig, route: Build) -> StaleCache:
    reads_answers = route.profile is not None or route.route.has("mcp")
    # A reload keeps the entries while the section and what the answers come from are unchanged.
    store = route.keep(
        "cache store",
        (cfg, route.route.upstream, route.profile),
        lambda: build_store(cfg, route.redis, route.clock),
    )
    return StaleCache(
        route.route.name,
        cfg,
        store,
        route.clock,
        route.events,
        storable=_storable(route.classify) if reads_answers else default_storable,
        known=known_credentials(route.route, route.profile),
    )


LINK = Link("cache", SECTION, build)

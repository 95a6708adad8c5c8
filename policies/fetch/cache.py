"""The page cache: one entry per canonical URL and format, shared by every caller, fresh for its
ttl, then stale for stale_ttl (served only when every provider fails); built from the route
cache's parts (its entry, freshness rule and stores: in-process, Redis, both)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from policies.cache import CacheConfig, CacheStore, Entry, Freshness, build_store, freshness
from policies.core.clock import Clock
from policies.core.events import Events
from policies.fetch.pages import PAGE_FORMATS, Page, PageFormat, canonical_url

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

# The cache's route label and key prefix: no route can be named so (names start [a-z0-9]), so
# neither a route's entries nor its `DELETE /admin/cache/<route>` can meet the pages'.
LABEL = "/v1/fetch"
KEY_PREFIX = "@fetch"


@dataclass(frozen=True, slots=True)
class Cached:
    """What the cache has for one URL: a page to answer with now, or one to stand in if every
    provider fails (each None when it has none)."""

    fresh: Page | None = None
    stale: Page | None = None


def page_key(url: str, fmt: PageFormat) -> str:
    """The entry's key: the canonical URL and the format, hashed."""
    digest = hashlib.sha256(f"{canonical_url(url)}\n{fmt}".encode()).hexdigest()
    return f"{KEY_PREFIX}:{digest}"


class PageCache:
    """Pages by URL and format over a route cache's store; `config` bounds it as a route's
    `cache:` does (ttl, stale_ttl, max_entry_bytes, max_entries, max_bytes)."""

    def __init__(
        self, config: CacheConfig, store: CacheStore, clock: Clock, events: Events
    ) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.events = events

    @classmethod
    def build(
        cls, config: CacheConfig, redis: RedisLink | None, clock: Clock, events: Events
    ) -> PageCache:
        """In-process, in front of Redis when one is configured (as a route's cache)."""
        return cls(config, build_store(config, redis, clock), clock, events)

    async def get(self, url: str, fmt: PageFormat, *, fresh_ok: bool = True) -> Cached:
        """The page cached for `url`; with `fresh_ok` False (the agent's Cache-Control:
        no-cache) even a fresh one only stands in for a failure."""
        key, fresh_after = page_key(url, fmt), self.clock.wall() - self.config.ttl
        entry = (await self.store.lookup(key, fresh_after)).entry
        page = _page(entry, url) if entry is not None else None
        if entry is None or page is None:
            self.events.cache(LABEL, "miss")
            return Cached()
        state, _ = freshness(
            entry.stored_at, self.clock.wall(), self.config.ttl, self.config.stale_ttl
        )
        if state is Freshness.FRESH and fresh_ok:
            self.events.cache(LABEL, "hit")
            return Cached(fresh=page)
        self.events.cache(LABEL, "miss")
        return Cached(stale=page) if state is not Freshness.EXPIRED else Cached()

    def stood_in(self) -> None:
        """A stale page answered for a URL every provider failed on."""
        self.events.cache(LABEL, "stale")

    async def put(self, page: Page, fmt: PageFormat) -> None:
        """Keep `page`, fetched for format `fmt`, unless it is over max_entry_bytes."""
        body = orjson.dumps(
            {
                "title": page.title,
                "content": page.content,
                "format": page.format,
                "provider": page.provider,
                "cut": page.cut,
            }
        )
        if len(body) > self.config.max_entry_bytes:
            return
        entry = Entry(200, (), body, page.fetched_at)
        await self.store.put(page_key(page.url, fmt), entry)
        self.events.cache(LABEL, "store")


def _page(entry: Entry, url: str) -> Page | None:
    """The page an entry holds, answered for `url`; None for an entry not of ours."""
    try:
        data = orjson.loads(entry.body)
        fmt = data["format"]
        if fmt not in PAGE_FORMATS:
            return None
        return Page(
            url,
            str(data["title"]),
            str(data["content"]),
            fmt,
            str(data["provider"]),
            entry.stored_at,
            cut=bool(data["cut"]),
            from_cache=True,
        )
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None

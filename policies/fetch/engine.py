"""The fetch engine: the pages of some URLs from the page cache, else from providers in order,
each URL a provider fails on (alone, or with the rest of its batch) going on to the next one,
and a stale page standing in for a URL every provider failed on."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from policies.core.clock import Clock
from policies.core.extract import PageFormat, PageRead
from policies.fetch.cache import PageCache
from policies.fetch.pages import Miss, Page
from policies.fetch.readers import Asking, Read, Reader


@dataclass(frozen=True, slots=True)
class FetchCall:
    """A validated request: the URLs (distinct pages), the format, the providers in order."""

    urls: tuple[str, ...]
    format: PageFormat
    providers: tuple[str, ...]


@dataclass(slots=True)
class Fetched:
    """What a call found: a page for some URLs, and for every URL each provider's miss."""

    pages: dict[str, Page] = field(default_factory=dict)
    misses: dict[str, list[Miss]] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)  # providers asked (not skipped), in order


class FetchEngine:
    """Reads pages through `readers` (by name), keeping what it read in `cache` (None: no page
    cache). `max_parallel` bounds the calls one request makes at once to one provider, and
    `max_page_chars` the content kept of a page."""

    def __init__(
        self,
        readers: Mapping[str, Reader],
        cache: PageCache | None,
        clock: Clock,
        *,
        max_parallel: int = 4,
        max_page_chars: int = 100_000,
    ) -> None:
        self.readers = readers
        self.cache = cache
        self.clock = clock
        self.max_parallel = max_parallel
        self.max_page_chars = max_page_chars

    async def fetch(
        self, call: FetchCall, asking: Asking, *, fresh_ok: bool = True, store: bool = True
    ) -> Fetched:
        """Every URL of `call`: from the cache while fresh (unless not `fresh_ok`), else from
        the first provider that reads it (kept in the cache if `store`), else stale from the
        cache, else its misses."""
        out = Fetched(misses={url: [] for url in call.urls})
        stale: dict[str, Page] = {}
        if self.cache is not None:
            for url in call.urls:
                cached = await self.cache.get(url, call.format, fresh_ok=fresh_ok)
                if cached.fresh is not None:
                    out.pages[url] = cached.fresh
                elif cached.stale is not None:
                    stale[url] = cached.stale
        pending = [url for url in call.urls if url not in out.pages]
        for name in call.providers:
            if not pending:
                break
            reader = self.readers[name]
            skip = reader.unavailable()
            if skip is not None:
                for url in pending:
                    out.misses[url].append(skip)
                continue
            out.asked.append(name)
            for url, read in (await self._read(reader, pending, call.format, asking)).items():
                if isinstance(read, Miss):
                    out.misses[url].append(read)
                    continue
                page = self._page(read, name)
                out.pages[url] = page
                if self.cache is not None and store:
                    await self.cache.put(page, call.format)
            pending = [url for url in pending if url not in out.pages]
        for url in pending:
            if url in stale and self.cache is not None:
                out.pages[url] = replace(stale[url], stale=True)
                self.cache.stood_in()
        return out

    async def _read(
        self, reader: Reader, urls: Sequence[str], fmt: PageFormat, asking: Asking
    ) -> dict[str, Read]:
        """`urls` in batches of the reader's size, at most `max_parallel` calls at once."""
        size = reader.batch
        batches = [tuple(urls[i : i + size]) for i in range(0, len(urls), size)]
        gate = asyncio.Semaphore(self.max_parallel)

        async def one(batch: tuple[str, ...]) -> dict[str, Read]:
            async with gate:
                return await reader.read(batch, fmt, asking)

        found: dict[str, Read] = {}
        for part in await asyncio.gather(*(one(b) for b in batches)):
            found.update(part)
        return found

    def _page(self, read: PageRead, provider: str) -> Page:
        """A page as read, its content kept to max_page_chars."""
        content = read.content
        cut = len(content) > self.max_page_chars
        return Page(
            read.url,
            " ".join(read.title.split()),
            content[: self.max_page_chars] if cut else content,
            read.format,
            provider,
            self.clock.wall(),
            cut=cut,
        )

"""Who reads pages for /v1/fetch: a `Reader` takes some URLs and says, for each, the page or why
not. `RouteReader` asks a vendor's extract API through that vendor's route (its breaker,
limiter, retries, hedging and key), in the request shape its record builds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from policies.core.errors import ProxyError
from policies.core.extract import ExtractAnswer, ExtractApi, PageFormat, PageRead
from policies.core.flow import CallBudget, Flow
from policies.core.outcome import TERMINAL_STATUSES
from policies.core.section import Provider
from policies.fetch.pages import Miss, canonical_url
from policies.profiles import error_message
from policies.providers import (
    answer_json,
    call_flow,
    missing_key,
    open_for,
    open_reason,
    reason_of,
)

# Statuses that say the provider (its key, its plan) refused, not the page: 400, 422 and the
# like are the page's (an address the vendor cannot read).
_REFUSED = frozenset(TERMINAL_STATUSES - {400, 422})

Read = PageRead | Miss


@dataclass(frozen=True, slots=True)
class Asking:
    """What every provider call of one /v1/fetch request carries."""

    request_id: str
    deadline: float  # clock.now() value no call may outlive
    calls: CallBudget  # the request's vendor calls, retries included
    client: str = ""  # the known client (clients:), for the route's cache and limiter
    max_chars: int = 100_000  # the longest content wanted of a page


class Reader(Protocol):
    """A provider of pages: a vendor's route, or the proxy's own direct fetcher."""

    @property
    def name(self) -> str: ...

    @property
    def batch(self) -> int:
        """URLs one `read` takes."""
        ...

    def unavailable(self) -> Miss | None:
        """Why it is not asked now (no key, its circuit open); None: it may be."""
        ...

    async def read(self, urls: tuple[str, ...], fmt: PageFormat, asking: Asking) -> dict[str, Read]:
        """Each URL of `urls` (at most `batch`): its page, or why not. Never raises a
        ProxyError: a failure of the whole call is a Miss for every URL."""
        ...


def missed_all(urls: tuple[str, ...], miss: Miss) -> dict[str, Read]:
    return dict.fromkeys(urls, miss)


class RouteReader:
    """A vendor's extract API through its route."""

    def __init__(self, provider: Provider, api: ExtractApi) -> None:
        self.provider = provider
        self.api = api

    @property
    def name(self) -> str:
        return self.provider.name

    @property
    def batch(self) -> int:
        return self.api.batch

    def unavailable(self) -> Miss | None:
        p = self.provider
        if p.missing_key is not None:
            return Miss(p.name, "unavailable", missing_key(p), terminal=True)
        wait = open_for(p)
        if wait is not None:
            return Miss(p.name, "unavailable", open_reason(wait), retry_after_s=wait)
        return None

    async def read(self, urls: tuple[str, ...], fmt: PageFormat, asking: Asking) -> dict[str, Read]:
        p = self.provider
        try:
            reply = await p.handler(self._flow(urls, fmt, asking))
        except ProxyError as err:
            # Failed inside the proxy or on the way (timeout, circuit, limiter, spent budget):
            # the provider is unavailable, the pages unknown.
            why = reason_of(err)
            return missed_all(
                urls, Miss(p.name, "unavailable", why, retry_after_s=err.retry_after_s)
            )
        try:
            status = reply.status
            if 200 <= status < 300:
                data = answer_json(reply.body)
                if data is None:
                    why = f"{status} with a body that is not JSON"
                    return missed_all(urls, Miss(p.name, "unavailable", why))
                return _matched(p.name, urls, self.api.read(data, urls, fmt))
            said = error_message(reply.body)
            why = f"{status}" + (f" ({said})" if said else "")
            if status in _REFUSED or status in p.profile.terminal_statuses:
                return missed_all(urls, Miss(p.name, "unavailable", why, terminal=True))
            if status == 429 or status >= 500:
                return missed_all(urls, Miss(p.name, "unavailable", why))
            return missed_all(urls, Miss(p.name, "failed", why))
        finally:
            reply.discard()

    def _flow(self, urls: tuple[str, ...], fmt: PageFormat, asking: Asking) -> Flow:
        """The extract call down the route, with the route's own headers (its key)."""
        p = self.provider
        call = self.api.build(urls, fmt, asking.max_chars)
        return call_flow(
            p,
            call,
            p.headers,
            asking.request_id,
            asking.client,
            p.clock.now(),
            asking.deadline,
            asking.calls,
        )


def _matched(provider: str, urls: tuple[str, ...], answer: ExtractAnswer) -> dict[str, Read]:
    """The answer by the URLs asked: a vendor may spell a URL its own way (a trailing slash, a
    lower-case host), so one not asked as such is matched by its canonical form."""
    by_form: Mapping[str, str] = {canonical_url(u): u for u in urls}

    def asked(url: str) -> str | None:
        if url in by_form.values():
            return url
        try:
            return by_form.get(canonical_url(url))
        except ValueError:
            return None

    found: dict[str, Read] = {}
    for page in answer.pages:
        url = asked(page.url)
        if url is not None and url not in found:
            found[url] = PageRead(url, page.title, page.content, page.format)
    for miss in answer.misses:
        url = asked(miss.url)
        if url is not None and url not in found:
            why = miss.reason + (f" (the page answered {miss.status})" if miss.status else "")
            found[url] = Miss(provider, "failed", why)
    for url in urls:
        found.setdefault(url, Miss(provider, "failed", "left it out of its answer"))
    return found

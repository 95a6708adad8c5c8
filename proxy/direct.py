"""The direct fetcher: the proxy reading a page itself without becoming a way into the network
it runs in (server-side request forgery); the rules are DirectReader's."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohappyeyeballs import AddrInfoType
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from policies.core.clock import Clock
from policies.core.errors import seconds_text
from policies.core.extract import PageFormat, PageRead
from policies.core.memory import holding
from policies.fetch import AddressRules, Asking, Miss, MissKind, Read, parse_networks
from proxy.config.fetch import DIRECT, DirectFetchConfig

REDIRECTS = frozenset({301, 302, 303, 307, 308})
# HTML to text is CPU work off the event loop: at most this many pages at once, so a burst of
# large pages cannot take every core from the requests in flight.
CONVERSIONS = 2


class AddressRefused(OSError):
    """A name resolved to an address the rules refuse (raised inside aiohttp's connect)."""


class _Failed(Exception):
    """One page's failure, as its Miss will say it."""

    def __init__(self, kind: MissKind, reason: str) -> None:
        super().__init__(reason)
        self.kind: MissKind = kind
        self.reason = reason


class CheckedResolver(AbstractResolver):
    """Resolves through `inner` and refuses the name when any address it got is refused, so
    the address aiohttp connects to is one that was checked."""

    def __init__(self, rules: AddressRules, inner: AbstractResolver | None = None) -> None:
        self.rules = rules
        self.inner = inner or aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self.inner.resolve(host, port, family)
        for result in found:
            why = self.rules.refusal(result["host"])
            if why is not None:
                raise AddressRefused(f"{host} resolves to {why}")
        return found

    async def close(self) -> None:
        await self.inner.close()


@dataclass(frozen=True)
class DirectHooks:
    """What tests replace so nothing leaves the machine: DNS (`resolver`), and a look at every
    socket address before it is connected (`on_connect`, which may raise OSError to stop it)."""

    resolver: AbstractResolver | None = None
    on_connect: Callable[[tuple[Any, ...]], None] | None = None


def address_rules(config: DirectFetchConfig) -> AddressRules:
    return AddressRules(
        allow_private=config.allow_private,
        allow_networks=parse_networks(config.allow_networks),
        ports=frozenset(config.ports),
    )


class DirectReader:
    """The `direct` provider: one page a call, fetched and turned into text here. `start()`
    opens its session (in the app's lifecycle), `close()` ends it.

    - Every address is checked where it is connected to: a resolver of our own refuses a name
      any of whose addresses is not public (`AddressRules`), so a name that answers a public
      address to one lookup and a private one to the next (DNS rebinding) is refused at the
      lookup that counts; and the socket of each connection is made only after its address
      passes the same rules (literal IPs never reach a resolver). No DNS cache, no kept-alive
      connections.
    - Literal IP hosts are checked before anything is sent, and legacy spellings
      (`0x7f000001`, `2130706433`, `0177.0.0.1`) are refused outright; only http(s) on `ports`.
    - Redirects are followed by hand, at most `max_redirects`, each hop checked as the first.
    - No credentials: a session of its own (no cookie jar, no proxy or .netrc from the
      environment), only our own headers, and URLs with user:password@ are refused.
    - Bounded: `timeout` for a page (DNS, redirects and body), `max_bytes` of body after
      decompression, `max_parallel` pages at once, text/html, text/plain and the like only.
    """

    name = DIRECT
    batch = 1

    def __init__(
        self, config: DirectFetchConfig, clock: Clock, hooks: DirectHooks | None = None
    ) -> None:
        # Imported here: trafilatura and lxml cost ~16 MiB, paid only with the fetcher on.
        from proxy.pagetext import conversion_cost, page_text

        self.config = config
        self.conversion_cost = conversion_cost
        self.clock = clock
        self.rules = address_rules(config)
        self.page_text = page_text
        self.hooks = hooks or DirectHooks()
        self.session: aiohttp.ClientSession | None = None
        self._fetching = asyncio.Semaphore(config.max_parallel)
        self._converting = asyncio.Semaphore(CONVERSIONS)
        self._headers = {
            "User-Agent": config.user_agent,
            "Accept": ", ".join(config.content_types) + ";q=0.9, */*;q=0.1",
            "Accept-Encoding": "gzip, deflate",
        }

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            resolver=CheckedResolver(self.rules, self.hooks.resolver),
            socket_factory=self._socket,
            use_dns_cache=False,
            force_close=True,
            limit=self.config.max_parallel,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            auto_decompress=True,
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def _socket(self, addr_info: AddrInfoType) -> socket.socket:
        """The socket of one connection, made only once its address passes the rules."""
        family, kind, proto, _, address = addr_info
        if self.hooks.on_connect is not None:
            self.hooks.on_connect(address)
        why = self.rules.refusal(str(address[0]))
        if why is not None:
            raise AddressRefused(f"refused to connect: {why}")
        return socket.socket(family=family, type=kind, proto=proto)

    def unavailable(self) -> Miss | None:
        return None

    async def read(self, urls: tuple[str, ...], fmt: PageFormat, asking: Asking) -> dict[str, Read]:
        return {url: await self._one(url, fmt, asking) for url in urls}

    async def _one(self, url: str, fmt: PageFormat, asking: Asking) -> Read:
        budget = min(self.config.timeout, asking.deadline - self.clock.now())
        if budget <= 0:
            return Miss(DIRECT, "unavailable", "the request ran out of time")
        if not asking.calls.spend():
            why = "the request's calls are spent (fetch_api.max_calls_per_request)"
            return Miss(DIRECT, "unavailable", why)
        try:
            async with self._fetching, asyncio.timeout(budget):
                body, media, charset, final = await self._get(URL(url))
        except _Failed as failed:
            return Miss(DIRECT, failed.kind, failed.reason)
        except TimeoutError:
            return Miss(DIRECT, "failed", f"timed out after {seconds_text(budget)}")
        # The page and its conversion count against the memory budget while they wait for a
        # slot and convert, as the request's other bodies do.
        cost = self.conversion_cost(body, media)
        hold = holding()
        if hold is not None and not hold.take(cost):
            return _no_room(cost, hold.budget.limit)
        try:
            await self._converting.acquire()
        except BaseException:
            if hold is not None:
                hold.give(cost)
            raise
        # A thread cannot be stopped: if the request is cancelled, the conversion still holds
        # its slot and its memory until it ends.
        converting = asyncio.ensure_future(
            asyncio.to_thread(self.page_text, body, media, charset, fmt, str(final))
        )

        def converted(_: object) -> None:
            self._converting.release()
            if hold is not None:
                hold.give(cost)

        converting.add_done_callback(converted)
        title, content, got = await asyncio.shield(converting)
        if not content:
            return Miss(DIRECT, "failed", "no readable text on the page")
        return PageRead(url, title, content, got)

    async def _get(self, url: URL) -> tuple[bytes, str, str | None, URL]:
        """The body of the page at `url` after its redirects: (body, media type, charset,
        final URL). Raises _Failed saying why not."""
        assert self.session is not None, "DirectReader.start() first"
        for _ in range(self.config.max_redirects + 1):
            refused = self.rules.url_refusal(url)
            if refused is not None:
                raise _Failed("refused", f"refused: {refused}")
            try:
                async with self.session.get(
                    url, headers=self._headers, allow_redirects=False
                ) as resp:
                    if resp.status in REDIRECTS:
                        url = _next_hop(url, resp.headers.get("Location"), resp.status)
                        continue
                    return await self._body(resp), resp.content_type, resp.charset, url
            except aiohttp.ClientConnectorDNSError as exc:
                if isinstance(exc.os_error, AddressRefused):
                    raise _Failed("refused", f"refused: {exc.os_error}") from None
                raise _Failed("failed", f"{url.host} does not resolve") from None
            except aiohttp.ClientConnectorError as exc:
                if isinstance(exc.os_error, AddressRefused):
                    raise _Failed("refused", f"refused: {exc.os_error}") from None
                why = exc.os_error.strerror or type(exc.os_error).__name__
                raise _Failed("failed", f"cannot connect to {url.host} ({why})") from None
            except aiohttp.ClientError as exc:
                raise _Failed(
                    "failed", f"the page's answer broke off ({type(exc).__name__})"
                ) from None
        raise _Failed("failed", f"more than {self.config.max_redirects} redirects")

    async def _body(self, resp: aiohttp.ClientResponse) -> bytes:
        """A page's body, refused unless a 2xx of a type read, and never past max_bytes of it
        decompressed (aiohttp inflates only as fast as we read)."""
        if not 200 <= resp.status < 300:
            raise _Failed("failed", f"the page answered {resp.status}")
        media = resp.content_type
        if media not in self.config.content_types:
            read = ", ".join(self.config.content_types)
            raise _Failed("failed", f"{media} is not a page type fetched ({read})")
        limit = self.config.max_bytes
        too_large = _Failed(
            "failed", f"the page is over fetch_api.direct.max_bytes ({limit} bytes)"
        )
        if resp.content_length is not None and resp.content_length > limit:
            raise too_large
        body = bytearray()
        async for chunk in resp.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise too_large
        return bytes(body)


def _no_room(cost: int, limit: int) -> Miss:
    """The miss of a page whose conversion does not fit the memory budget: never, or now."""
    what = f"converting the page would take some {cost} bytes of memory"
    if cost > limit:
        why = f"{what}, more than server.max_buffered_bytes ({limit}); raise it to read such pages"
        return Miss(DIRECT, "failed", why)
    return Miss(DIRECT, "unavailable", f"{what}, more than is free now; retry shortly", 1.0)


def _next_hop(url: URL, location: str | None, status: int) -> URL:
    """Where a redirect points, relative to `url`."""
    if not location:
        raise _Failed("failed", f"the page answered {status} without a Location")
    try:
        return url.join(URL(location))
    except ValueError:
        raise _Failed(
            "failed", f"the page redirected to an unusable URL ({location[:100]!r})"
        ) from None

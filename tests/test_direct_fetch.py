"""The direct fetcher through /v1/fetch, against real sockets on loopback only: a fake DNS
answers every name, a watch on every connect stops anything but loopback (so nothing leaves
the machine even if a rule broke), a "public" site on 127.0.0.2 (allowed as
`allow_networks: [127.0.0.2/32]`, standing in for the internet) and private listeners on
127.0.0.1 and ::1 that must see zero connections for every refused case."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import ipaddress
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

from policies.core.flow import CallBudget
from policies.core.memory import HOLD, Hold, MemoryBudget
from policies.fetch.readers import Asking
from proxy.app import STATE, build_app
from proxy.config import parse_config
from proxy.direct import CONVERSIONS, DirectHooks
from testkit.fakevendor import FakeVendor
from testkit.waiting import eventually
from tests.conftest import ListenerTestServer, route

PUBLIC = "127.0.0.2"  # the "internet": allowed by allow_networks, like a public address
ARTICLE = (
    "<html><head><title>Token buckets | Example</title></head><body>"
    "<nav><a href='/'>Home</a> <a href='/blog'>Blog</a></nav><main><article>"
    "<h1>Token buckets</h1><p>A token bucket holds up to burst tokens and refills at a steady "
    "rate; a request that finds it empty waits or is refused. This paragraph is long enough to "
    "read as the article's text rather than as navigation.</p>"
    "<p>Vendors document their limits as a rate and a burst, which is why a bucket fits.</p>"
    "</article></main><footer>Cookies? Accept all</footer></body></html>"
)


class FakeDNS(AbstractResolver):
    """Names to addresses, each lookup taking the next answer (the last one repeats)."""

    def __init__(self, answers: dict[str, list[list[str]]]) -> None:
        self.answers = answers
        self.lookups: list[str] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.lookups.append(host)
        sequence = self.answers.get(host.rstrip(".").lower())
        if sequence is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        found = sequence.pop(0) if len(sequence) > 1 else sequence[0]
        return [
            {
                "hostname": host,
                "host": address,
                "port": port,
                "family": socket.AF_INET6 if ":" in address else socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
            for address in found
        ]

    async def close(self) -> None:
        pass


@dataclass
class Listener:
    """A TCP listener that only counts the connections it accepts."""

    host: str
    port: int = 0
    connections: int = 0
    server: asyncio.Server | None = None

    async def start(self) -> Listener:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writer.close()

        self.server = await asyncio.start_server(accept, self.host, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self


@dataclass
class Site:
    """The "public" site's pages, and the requests it received."""

    private_port: int
    received: list[dict[str, str]] = field(default_factory=list)

    def app(self) -> web.Application:
        async def handle(request: web.Request) -> web.StreamResponse:
            self.received.append(dict(request.headers))
            name = request.match_info["name"]
            if name == "article":
                return web.Response(text=ARTICLE, content_type="text/html")
            if name == "notes.txt":
                return web.Response(text="plain notes\nline two", content_type="text/plain")
            if name == "logo.png":
                return web.Response(body=b"\x89PNG....", content_type="image/png")
            if name == "bomb":  # 40 KiB of gzip that inflates to 4 MiB
                body = gzip.compress(b"<p>" + b"a" * (4 * 1024 * 1024) + b"</p>")
                headers = {"Content-Encoding": "gzip", "Content-Type": "text/html"}
                return web.Response(body=body, headers=headers)
            if name == "tags":  # 60 KB of tiny elements: some 12 MB to convert
                return web.Response(text="<p>a b</p>" * 6000, content_type="text/html")
            if name == "loop":
                raise web.HTTPFound("/loop")
            if name == "cookie":  # sets a cookie, then sends the fetcher back to itself
                response = web.HTTPFound("/article")
                response.set_cookie("session", "s3cret")
                raise response
            if name == "to-private":
                raise web.HTTPFound(f"http://private.test:{self.private_port}/admin")
            if name == "to-literal":
                raise web.HTTPFound(f"http://127.0.0.1:{self.private_port}/admin")
            raise web.HTTPNotFound()

        app = web.Application()
        app.router.add_get("/{name}", handle)
        return app


@dataclass
class World:
    """Everything one test fetches against."""

    client: Any
    site: Site
    public: str  # the site's origin, by name
    private: Listener
    private6: Listener
    dns: FakeDNS
    connects: list[str]  # every address the fetcher made a socket for


async def start_world(
    aiohttp_client: Any,
    vendor: FakeVendor | None = None,
    server: dict[str, Any] | None = None,
    **direct: Any,
) -> AsyncIterator[World]:
    private = await Listener("127.0.0.1").start()
    private6 = await Listener("::1").start()
    site = Site(private.port)
    runner = web.AppRunner(site.app())
    await runner.setup()
    tcp = web.TCPSite(runner, PUBLIC, 0)
    await tcp.start()
    site_port = tcp._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    dns = FakeDNS(
        {
            "public.test": [[PUBLIC]],
            "private.test": [["127.0.0.1"]],
            "rebind.test": [[PUBLIC], ["127.0.0.1"]],
            "ten.test": [["10.1.2.3"]],
            "sixteen.test": [["172.16.5.4"]],
            "home.test": [["192.168.1.1"]],
            "metadata.test": [["169.254.169.254"]],
            "cgnat.test": [["100.64.0.7"]],
            "mixed.test": [[PUBLIC, "10.1.2.3"]],
        }
    )
    connects: list[str] = []

    def on_connect(address: tuple[Any, ...]) -> None:
        connects.append(str(address[0]))
        if not ipaddress.ip_address(address[0]).is_loopback:  # the tripwire, not the rule
            raise OSError(f"test tripwire: a connect to {address[0]} would leave the machine")

    routes = {"plain": route("http://127.0.0.1:9", "/plain")}
    if vendor is not None:
        routes = {"tavily": route(f"{vendor.url}/tavily", "/tavily", search={"vendor": "tavily"})}
    settings = {
        "enabled": True,
        "allow_networks": [f"{PUBLIC}/32"],
        "ports": [80, site_port, private.port, private6.port],
        "max_bytes": "64KiB",
        "max_redirects": 3,
        "timeout": "5s",
        **direct,
    }
    raw = {
        "server": server or {},
        "routes": routes,
        "fetch_api": {
            "providers": (["tavily"] if vendor is not None else []) + ["direct"],
            "direct": settings,
        },
    }
    app = build_app(parse_config(raw, {}), direct_hooks=DirectHooks(dns, on_connect))
    client = await aiohttp_client(ListenerTestServer(app))
    try:
        yield World(
            client, site, f"http://public.test:{site_port}", private, private6, dns, connects
        )
    finally:
        await runner.cleanup()
        for listener in (private, private6):
            assert listener.server is not None
            listener.server.close()


@pytest.fixture
async def world(aiohttp_client: Any) -> AsyncIterator[World]:
    async for w in start_world(aiohttp_client):
        yield w


async def fetch(world: World, *urls: str, **body: Any) -> dict[str, Any]:
    r = await world.client.post("/v1/fetch", json={"urls": list(urls), **body})
    answer = await r.json()
    assert r.status == 200, answer
    return answer


def refused(answer: dict[str, Any]) -> str:
    """The one failed URL's direct-fetcher reason, asserting it was a refusal."""
    [failed] = answer["failed"]
    assert failed["error"]["type"] == "page_refused", failed
    [attempt] = failed["attempts"]
    assert attempt["provider"] == "direct" and attempt["outcome"] == "refused"
    return str(attempt["reason"])


async def test_a_public_page_is_read_as_its_main_text(world: World) -> None:
    answer = await fetch(world, f"{world.public}/article")
    [page] = answer["results"]
    assert page["provider"] == "direct" and page["title"] == "Token buckets | Example"
    assert "A token bucket holds up to burst tokens" in page["content"]
    assert "Home" not in page["content"] and "Accept all" not in page["content"]
    text = await fetch(world, f"{world.public}/notes.txt", format="text")
    assert text["results"][0]["content"] == "plain notes\nline two"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1:{port}/", "127.0.0.1 is a loopback address"),
        ("http://private.test:{port}/", "private.test resolves to 127.0.0.1 is a loopback"),
        ("http://10.1.2.3:{port}/", "10.1.2.3 is a private address"),
        ("http://ten.test:{port}/", "ten.test resolves to 10.1.2.3 is a private address"),
        ("http://172.16.5.4:{port}/", "172.16.5.4 is a private address"),
        ("http://sixteen.test:{port}/", "resolves to 172.16.5.4 is a private address"),
        ("http://192.168.1.1:{port}/", "192.168.1.1 is a private address"),
        ("http://home.test:{port}/", "resolves to 192.168.1.1 is a private address"),
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a link-local address"),
        ("http://metadata.test/latest/meta-data/", "resolves to 169.254.169.254 is a link-local"),
        ("http://100.64.0.7:{port}/", "100.64.0.7 is a shared address"),
        ("http://cgnat.test:{port}/", "resolves to 100.64.0.7 is a shared address"),
        ("http://[::1]:{port6}/", "::1 is a loopback address"),
        ("http://[::ffff:127.0.0.1]:{port}/", "::ffff:7f00:1 is a loopback address"),
        ("http://0x7f000001:{port}/", "'0x7f000001' spells the IP address 127.0.0.1"),
        ("http://2130706433:{port}/", "'2130706433' spells the IP address 127.0.0.1"),
        ("http://0177.0.0.1:{port}/", "'0177.0.0.1' spells the IP address 127.0.0.1"),
        ("http://mixed.test:{port}/", "mixed.test resolves to 10.1.2.3 is a private address"),
    ],
)
async def test_a_non_public_address_is_refused_before_any_connection(
    world: World, url: str, why: str
) -> None:
    target = url.format(port=world.private.port, port6=world.private6.port)
    assert why in refused(await fetch(world, target))
    assert world.private.connections == 0 and world.private6.connections == 0
    assert world.connects == []  # not a socket was made


async def test_a_name_that_rebinds_to_a_private_address_is_refused_at_that_lookup(
    world: World,
) -> None:
    port = world.site.private_port  # the private listener's port: reachable if checked wrong
    site_port = world.public.rsplit(":", 1)[1]
    first = await fetch(world, f"http://rebind.test:{site_port}/article")
    assert first["results"][0]["provider"] == "direct"
    second = await fetch(world, f"http://rebind.test:{port}/article", providers=["direct"])
    assert "rebind.test resolves to 127.0.0.1 is a loopback address" in refused(second)
    assert world.private.connections == 0
    assert world.connects == [PUBLIC]  # one lookup per connection, each one checked
    assert world.dns.lookups == ["rebind.test", "rebind.test"]


@pytest.mark.parametrize("page", ["to-private", "to-literal"])
async def test_a_public_page_redirecting_to_a_private_one_is_refused_at_that_hop(
    world: World, page: str
) -> None:
    reason = refused(await fetch(world, f"{world.public}/{page}"))
    assert "127.0.0.1 is a loopback address" in reason
    assert world.private.connections == 0
    assert world.connects == [PUBLIC] and len(world.site.received) == 1


async def test_no_cookie_and_no_credentials_reach_a_page(world: World) -> None:
    answer = await fetch(world, f"{world.public}/cookie")
    assert answer["results"][0]["title"] == "Token buckets | Example"
    await world.client.post(
        "/v1/fetch",
        json={"urls": [f"{world.public}/article"]},
        headers={
            "Authorization": "Bearer agent-key",
            "Cookie": "agent=1",
            "Cache-Control": "no-cache",
        },
    )
    assert len(world.site.received) == 3
    for headers in world.site.received:
        assert not {"Cookie", "Authorization", "Proxy-Authorization"} & set(headers), headers
        assert headers["User-Agent"].startswith("search-proxy")


@pytest.mark.parametrize(
    ("page", "reason"),
    [
        ("logo.png", "image/png is not a page type fetched"),
        ("bomb", "over fetch_api.direct.max_bytes (65536 bytes)"),
        ("loop", "more than 3 redirects"),
        ("missing", "the page answered 404"),
    ],
)
async def test_what_is_not_a_page_or_too_much_is_failed_and_said(
    world: World, page: str, reason: str
) -> None:
    [failed] = (await fetch(world, f"{world.public}/{page}"))["failed"]
    assert failed["error"]["type"] == "page_failed"
    assert reason in failed["attempts"][0]["reason"]


async def test_a_page_is_converted_only_when_its_conversion_fits_the_memory_budget(
    aiohttp_client: Any,
) -> None:
    server = {"max_buffered_bytes": "8MiB", "max_body_bytes": "64KiB"}
    async for world in start_world(aiohttp_client, server=server):
        [failed] = (await fetch(world, f"{world.public}/tags"))["failed"]
        reason = failed["attempts"][0]["reason"]
        assert "more than server.max_buffered_bytes (8388608); raise it" in reason
        assert (await fetch(world, f"{world.public}/article"))["results"]  # a usual page
        assert world.client.app[STATE].memory.used == 0
    async for world in start_world(aiohttp_client):  # the default 32 MiB: it fits
        [page] = (await fetch(world, f"{world.public}/tags", format="text"))["results"]
        assert page["content"].startswith("a b")


async def test_a_cancelled_fetch_holds_its_conversion_slot_and_memory_until_the_thread_ends(
    world: World,
) -> None:
    # A thread cannot be stopped: a request cancelled while its page converts must leave that
    # conversion's slot and memory taken until the conversion is done, or cancelled requests
    # would start conversions past the limit and outside the budget.
    generation = world.client.app[STATE].generation
    assert generation is not None and generation.direct is not None
    reader = generation.direct
    convert, gate = reader.page_text, threading.Event()

    def gated(*args: Any) -> Any:
        gate.wait(10)
        return convert(*args)

    reader.page_text = gated
    hold = Hold(MemoryBudget(64 * 1024 * 1024))
    asking = Asking("r1", reader.clock.now() + 30, CallBudget(5))
    HOLD.set(hold)
    reading = asyncio.ensure_future(reader._one(f"{world.public}/article", "markdown", asking))
    await eventually(lambda: hold.held > 0 and reader._converting._value == CONVERSIONS - 1)
    reading.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reading
    assert hold.held > 0 and reader._converting._value == CONVERSIONS - 1  # still converting
    gate.set()
    await eventually(lambda: hold.held == 0 and reader._converting._value == CONVERSIONS)


async def test_another_port_scheme_or_unknown_name_is_not_fetched(world: World) -> None:
    six = refused(await fetch(world, "http://public.test:6379/"))
    assert "port 6379 is not fetched" in six
    [failed] = (await fetch(world, "http://nowhere.test/"))["failed"]
    assert "nowhere.test does not resolve" in failed["attempts"][0]["reason"]
    assert world.connects == []


async def test_allow_private_opens_loopback_but_never_link_local(aiohttp_client: Any) -> None:
    async for world in start_world(aiohttp_client, allow_private=True, allow_networks=[]):
        answer = await fetch(world, f"http://127.0.0.1:{world.private.port}/")
        # Connected (the listener hangs up at once: the page fails, but is not refused; aiohttp
        # tries a GET a second time on a hang-up), every connection after its own check.
        assert answer["failed"][0]["error"]["type"] == "page_failed"
        assert world.private.connections == len(world.connects) >= 1
        assert set(world.connects) == {"127.0.0.1"}
        assert "link-local" in refused(await fetch(world, "http://metadata.test/latest/"))
        assert set(world.connects) == {"127.0.0.1"}


async def test_direct_reads_what_the_vendor_could_not(
    aiohttp_client: Any, vendor: FakeVendor
) -> None:
    async for world in start_world(aiohttp_client, vendor):
        vendor.fail_page(f"{world.public}/article")
        answer = await fetch(world, f"{world.public}/article")
        [page] = answer["results"]
        assert page["provider"] == "direct" and "token bucket" in page["content"]
        assert [r.path for r in vendor.requests] == ["/tavily/extract"]

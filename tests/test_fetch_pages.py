"""The pure parts of /v1/fetch: where the direct fetcher may connect, the URLs accepted and their
canonical form, each vendor's extract request and answer, the page cache on a ManualClock, and
the engine's batching and failover over readers of the test's own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from yarl import URL

from policies.cache import CacheConfig, MemoryStore
from policies.core.clock import ManualClock
from policies.core.events import NullEvents
from policies.core.extract import PageFormat, PageRead
from policies.core.flow import CallBudget
from policies.fetch import (
    AddressRules,
    Asking,
    FetchCall,
    FetchEngine,
    Miss,
    Page,
    PageCache,
    Read,
    canonical_url,
    check_url,
    parse_networks,
)
from policies.fetch.readers import _matched
from policies.vendors import BUILTIN

PUBLIC = AddressRules()
PRIVATE_OK = AddressRules(allow_private=True)


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("8.8.8.8", None),
        ("2606:4700::1111", None),
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("10.0.0.1", "private"),
        ("172.31.255.255", "private"),
        ("192.168.0.1", "private"),
        ("169.254.169.254", "link-local"),
        ("100.64.0.1", "shared"),
        ("100.127.255.254", "shared"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.251", "multicast"),
        ("255.255.255.255", "reserved"),
        ("240.0.0.1", "reserved"),
        ("::1", "loopback"),
        ("::", "unspecified"),
        ("fe80::1", "link-local"),
        ("fe80::1%eth0", "link-local"),
        ("fc00::1", "private"),
        ("ff02::1", "multicast"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("::ffff:10.1.1.1", "private"),
        ("64:ff9b::a00:1", "private"),  # NAT64 of 10.0.0.1
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 of 169.254.169.254
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("::7f00:1", "reserved"),  # IPv4-compatible, deprecated
        ("2001:db8::1", "private"),  # documentation
    ],
)
def test_every_non_public_address_is_refused_and_says_what_it_is(
    address: str, kind: str | None
) -> None:
    why = PUBLIC.refusal(address)
    if kind is None:
        assert why is None
    else:
        assert why is not None and f" {kind} address" in why


def test_allow_private_opens_private_and_loopback_never_link_local_or_multicast() -> None:
    for address in ("127.0.0.1", "10.0.0.1", "100.64.0.1", "fc00::1", "::ffff:192.168.1.1"):
        assert PRIVATE_OK.refusal(address) is None
    for address in ("169.254.169.254", "fe80::1", "224.0.0.1", "0.0.0.0", "::ffff:169.254.1.1"):
        assert PRIVATE_OK.refusal(address) is not None
    # An allowed network is allowed whatever it is; the rest stays refused.
    rules = AddressRules(allow_networks=parse_networks(["10.1.2.0/24", "169.254.0.5"]))
    assert rules.refusal("10.1.2.9") is None and rules.refusal("169.254.0.5") is None
    assert rules.refusal("10.1.3.9") is not None
    assert rules.refusal("not-an-address") == "'not-an-address' is not an IP address"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://0x7f000001/", "'0x7f000001' spells the IP address 127.0.0.1"),
        ("http://2130706433/", "'2130706433' spells the IP address 127.0.0.1"),
        ("http://0177.0.0.1/", "'0177.0.0.1' spells the IP address 127.0.0.1"),
        ("http://127.1/", "'127.1' spells the IP address 127.0.0.1"),
        ("http://0x0a.0x00.0x00.0x01/", "spells the IP address 10.0.0.1"),
        ("http://[::ffff:127.0.0.1]/", "::ffff:7f00:1 is a loopback address"),
        ("http://127.0.0.1./", "127.0.0.1 is a loopback address"),
        ("http://[fe80::1%25eth0]/", "is a link-local address"),
        ("http://example.com:6379/", "port 6379 is not fetched (fetch_api.direct.ports: 80, 443)"),
        ("ftp://example.com/", "only http and https are fetched"),
        ("http://u:p@example.com/", "the URL carries credentials"),
    ],
)
def test_a_url_is_refused_before_anything_is_resolved(url: str, why: str) -> None:
    refusal = PUBLIC.url_refusal(URL(url))
    assert refusal is not None and why in refusal


@pytest.mark.parametrize("host", ["example.com", "deadbeef.com", "1e100.net", "abc.def", "x1.io"])
def test_names_that_look_numeric_are_names(host: str) -> None:
    assert PUBLIC.url_refusal(URL(f"https://{host}/")) is None


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("HTTP://Example.COM:80/a?b=1#frag", "http://example.com/a?b=1"),
        ("https://example.com", "https://example.com/"),
        ("https://EXAMPLE.com:8443/Path?Q=A", "https://example.com:8443/Path?Q=A"),
        ("http://[::1]:8080/x", "http://[::1]:8080/x"),
        ("http://bücher.example/p", "http://xn--bcher-kva.example/p"),
    ],
)
def test_canonical_urls(url: str, canonical: str) -> None:
    assert check_url(url) is None and canonical_url(url) == canonical


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (42, "must be a URL, as text"),
        ("", "must be a URL of 1 to 2048 characters"),
        ("https://example.com/" + "a" * 2048, "must be a URL of 1 to 2048 characters"),
        ("https://example.com/a b", "must not contain spaces or control characters"),
        ("/relative/path", "must be an absolute http or https URL"),
        ("javascript:alert(1)", "must be an absolute http or https URL"),
        ("https://user:pw@example.com/", "must not carry credentials"),
        ("https://example.com:70000/", "is not a usable URL"),
    ],
)
def test_urls_that_are_refused_say_why(value: Any, why: str) -> None:
    problem = check_url(value)
    assert problem is not None and why in problem


# --------------------------------------------------------------------------- vendor records


def test_tavily_asks_a_batch_and_reads_results_and_failed_results() -> None:
    api = BUILTIN["tavily"].extract
    assert api is not None and api.batch == 20
    request = api.build(("https://a.example/", "https://b.example/"), "text", 5000)
    assert (request.method, request.path) == ("POST", "/extract")
    assert request.json_body == {
        "urls": ["https://a.example/", "https://b.example/"],
        "format": "text",
        "extract_depth": "basic",
    }
    answer = api.read(
        {
            "results": [
                {"url": "https://a.example/", "raw_content": "A text"},
                {"url": "https://c.example/", "raw_content": ""},  # empty: no page
            ],
            "failed_results": [{"url": "https://b.example/", "error": "Failed to fetch url"}],
        },
        ("https://a.example/", "https://b.example/"),
        "text",
    )
    assert [(p.url, p.content, p.format) for p in answer.pages] == [
        ("https://a.example/", "A text", "text")
    ]
    assert [(m.url, m.reason) for m in answer.misses] == [
        ("https://b.example/", "Failed to fetch url")
    ]


def test_exa_reads_its_statuses_and_asks_for_the_length_kept() -> None:
    api = BUILTIN["exa"].extract
    assert api is not None and api.batch == 10
    request = api.build(("https://a.example/",), "markdown", 1234)
    assert request.path == "/contents"
    assert request.json_body == {"urls": ["https://a.example/"], "text": {"maxCharacters": 1234}}
    answer = api.read(
        {
            "results": [{"id": "https://a.example/", "title": "A", "text": "# A"}],
            "statuses": [
                {"id": "https://a.example/", "status": "success"},
                {
                    "id": "https://b.example/",
                    "status": "error",
                    "error": {"tag": "CRAWL_NOT_FOUND", "httpStatusCode": 404},
                },
            ],
        },
        ("https://a.example/", "https://b.example/"),
        "text",
    )
    assert [(p.title, p.format) for p in answer.pages] == [("A", "markdown")]
    assert [(m.url, m.reason, m.status) for m in answer.misses] == [
        ("https://b.example/", "CRAWL_NOT_FOUND", 404)
    ]


@pytest.mark.parametrize(
    ("data", "page", "miss"),
    [
        (
            {
                "success": True,
                "data": {"markdown": "# Hi", "metadata": {"title": "Hi", "statusCode": 200}},
            },
            ("Hi", "# Hi"),
            None,
        ),
        (
            {"success": True, "data": {"markdown": "# 404", "metadata": {"statusCode": 404}}},
            None,
            ("the page answered 404", 404),
        ),
        ({"success": False, "error": "Request timed out"}, None, ("Request timed out", None)),
        ({"success": True, "data": {"markdown": ""}}, None, ("no content", None)),
    ],
)
def test_firecrawl_scrape_reads_one_page_and_a_page_that_failed(
    data: Any, page: Any, miss: Any
) -> None:
    api = BUILTIN["firecrawl"].extract
    assert api is not None and api.batch == 1
    request = api.build(("https://a.example/",), "text", 10)
    assert request.path == "/v2/scrape" and request.json_body is not None
    assert request.json_body["url"] == "https://a.example/"
    assert request.json_body["formats"] == ["markdown"]  # it has no text format
    answer = api.read(data, ("https://a.example/",), "text")
    if page is not None:
        assert [(p.title, p.content, p.format) for p in answer.pages] == [(*page, "markdown")]
    else:
        assert [(m.reason, m.status) for m in answer.misses] == [miss]


def test_jinas_reader_is_on_its_own_origin_and_takes_the_format_as_a_header() -> None:
    api = BUILTIN["jina"].extract
    assert api is not None and api.origin == "https://r.jina.ai" and api.batch == 1
    request = api.build(("https://a.example/",), "text", 10)
    assert (request.path, request.json_body) == ("/", {"url": "https://a.example/"})
    assert request.headers["X-Return-Format"] == "text"
    assert request.headers["Accept"] == "application/json"
    ok = api.read(
        {"code": 200, "data": {"title": "T", "content": "body"}}, ("https://a.example/",), "text"
    )
    assert [(p.url, p.title, p.content) for p in ok.pages] == [("https://a.example/", "T", "body")]
    bad = api.read({"data": None, "readableMessage": "blocked"}, ("https://a.example/",), "text")
    assert [m.reason for m in bad.misses] == ["blocked"]


def test_a_vendors_own_spelling_of_a_url_is_matched_back_and_a_left_out_one_missed() -> None:
    from policies.core.extract import ExtractAnswer, PageMiss

    asked = ("https://Example.com/a", "https://example.com/b?x=1", "https://example.com/c")
    found = _matched(
        "v",
        asked,
        ExtractAnswer(
            (PageRead("https://example.com/a", "", "A", "text"),),
            (PageMiss("https://EXAMPLE.com:443/b?x=1", "gone", 410),),
        ),
    )
    a, b, c = (found[u] for u in asked)
    assert isinstance(a, PageRead) and a.url == asked[0]
    assert isinstance(b, Miss) and b.reason == "gone (the page answered 410)"
    assert isinstance(c, Miss) and c.reason == "left it out of its answer"


# --------------------------------------------------------------------------- the page cache


def page(url: str, provider: str = "tavily", content: str = "body", at: float = 0.0) -> Page:
    return Page(url, "T", content, "markdown", provider, at)


async def test_the_page_cache_is_fresh_then_stale_then_gone_and_keys_the_format() -> None:
    clock = ManualClock()
    config = CacheConfig(ttl=60, stale_ttl=600)
    cache = PageCache(config, MemoryStore(660, 100, 1 << 20, clock), clock, NullEvents())
    url = "https://example.com/a"
    await cache.put(page(url, at=clock.wall()), "markdown")
    hit = await cache.get("HTTPS://EXAMPLE.COM/a#x", "markdown")
    assert (
        hit.fresh is not None
        and hit.fresh.from_cache
        and hit.fresh.url == "HTTPS://EXAMPLE.COM/a#x"
    )
    assert (await cache.get(url, "text")).fresh is None  # another format, another entry
    assert (await cache.get(url, "markdown", fresh_ok=False)).stale is not None
    clock.advance(61)
    later = await cache.get(url, "markdown")
    assert later.fresh is None and later.stale is not None and later.stale.content == "body"
    clock.advance(600)
    assert await cache.get(url, "markdown") == type(later)()


async def test_a_page_over_max_entry_bytes_is_not_kept() -> None:
    clock = ManualClock()
    config = CacheConfig(ttl=60, stale_ttl=0, max_entry_bytes=200)
    cache = PageCache(config, MemoryStore(60, 100, 1 << 20, clock), clock, NullEvents())
    await cache.put(page("https://example.com/big", content="x" * 500, at=clock.wall()), "text")
    assert (await cache.get("https://example.com/big", "text")).fresh is None


# --------------------------------------------------------------------------- the engine


class Reader:
    """A reader of the test's own: pages for URLs it knows, misses for the rest."""

    def __init__(self, name: str, batch: int, pages: set[str], skip: Miss | None = None) -> None:
        self.name = name
        self.batch = batch
        self.pages = pages
        self.skip = skip
        self.calls: list[tuple[str, ...]] = []
        self.running = self.peak = 0

    def unavailable(self) -> Miss | None:
        return self.skip

    async def read(self, urls: tuple[str, ...], fmt: PageFormat, asking: Asking) -> dict[str, Read]:
        self.calls.append(urls)
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(0)
        self.running -= 1
        return {
            u: PageRead(u, f"  {u}\n title ", "x" * 50, fmt)
            if u in self.pages
            else Miss(self.name, "failed", "not found")
            for u in urls
        }


ASKING = Asking("rid", deadline=1e9, calls=CallBudget(100))
URLS = tuple(f"https://example.com/{i}" for i in range(7))


async def test_each_provider_gets_its_batches_and_only_what_the_last_could_not_read() -> None:
    first = Reader("first", 3, set(URLS[:5]))
    second = Reader("second", 1, set(URLS))
    engine = FetchEngine({"first": first, "second": second}, None, ManualClock(), max_parallel=2)
    done = await engine.fetch(FetchCall(URLS, "text", ("first", "second")), ASKING)
    assert first.calls == [URLS[0:3], URLS[3:6], URLS[6:7]] and first.peak == 2
    assert second.calls == [(URLS[5],), (URLS[6],)]
    assert {u: p.provider for u, p in done.pages.items()} == {
        **dict.fromkeys(URLS[:5], "first"),
        **dict.fromkeys(URLS[5:], "second"),
    }
    assert done.pages[URLS[0]].title == f"{URLS[0]} title"  # whitespace collapsed
    assert done.asked == ["first", "second"] and done.misses[URLS[6]][0].provider == "first"


async def test_a_skipped_provider_is_not_asked_and_content_is_kept_to_max_page_chars() -> None:
    down = Miss("down", "unavailable", "circuit open (retry in 5s)", retry_after_s=5.0)
    skipped = Reader("down", 5, set(URLS), skip=down)
    working = Reader("up", 5, set(URLS))
    engine = FetchEngine({"down": skipped, "up": working}, None, ManualClock(), max_page_chars=20)
    done = await engine.fetch(FetchCall(URLS[:2], "text", ("down", "up")), ASKING)
    assert skipped.calls == [] and done.asked == ["up"]
    assert done.misses[URLS[0]] == [down]
    first = done.pages[URLS[0]]
    assert len(first.content) == 20 and first.cut is True

"""POST /v1/fetch through the proxy app on loopback, with the fake vendor speaking Tavily extract,
Exa contents, Firecrawl scrape and Jina reader: batches, failover per URL and per provider, the
page cache shared by callers and standing in stale, the answer's shape and its limits."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from openapi_spec_validator import validate as validate_spec

from policies.core.clock import ManualClock
from proxy.config import ConfigErrors, as_document, parse_config
from proxy.config.fetch import DirectFetchConfig, FetchApiConfig, PageCacheConfig
from proxy.fetch_api import parse_request
from testkit.fakevendor import FakeVendor, make_page
from tests.conftest import route
from tests.test_search_api import _validator

A = "https://example.com/articles/token-buckets"
B = "https://docs.example.org/guide?section=limits"
C = "https://blog.example.net/2025/03/breakers"
NO_RETRY = {"attempts": 1}
DOCS = Path(__file__).resolve().parent.parent / "docs"
CONFIGURATION, ENDPOINTS = DOCS / "configuration.md", DOCS / "endpoints.md"


def routes(url: str) -> dict[str, Any]:
    """The four extract vendors as routes: three search routes, and Jina's reader on its own."""
    return {
        "tavily": route(f"{url}/tavily", "/tavily", search={"vendor": "tavily"}, retry=NO_RETRY),
        "exa": route(f"{url}/exa", "/exa", search={"vendor": "exa"}, retry=NO_RETRY),
        "firecrawl": route(
            f"{url}/firecrawl", "/firecrawl", search={"vendor": "firecrawl"}, retry=NO_RETRY
        ),
        "jina-reader": route(f"{url}/jina-reader", "/jina-reader", retry=NO_RETRY),
    }


def fetching(url: str, *providers: str, **extra: Any) -> dict[str, Any]:
    return {
        "routes": routes(url),
        "fetch_api": {
            "providers": list(providers),
            "vendors": {"jina-reader": "jina"},
            **extra,
        },
    }


async def fetch(client: Any, status: int = 200, headers: Any = None, **body: Any) -> Any:
    r = await client.post("/v1/fetch", json=body, headers=headers)
    answer = await r.json()
    assert r.status == status, answer
    return answer


def extracts(vendor: FakeVendor, path: str) -> list[Any]:
    """The bodies of the extract calls the fake received at `path`."""
    return [r.json() for r in vendor.requests if r.path == path]


def page_of(answer: dict[str, Any], url: str) -> dict[str, Any]:
    return next(r for r in answer["results"] if r["url"] == url)


async def test_two_urls_come_from_the_first_provider_in_one_batch(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(fetching(vendor.url, "tavily", "exa"))
    answer = await fetch(client, urls=[A, B])
    assert [r["url"] for r in answer["results"]] == [A, B] and answer["failed"] == []
    for result in answer["results"]:
        page = make_page(result["url"])
        assert (result["title"], result["content"]) == (page.title, page.content)
        assert result["provider"] == "tavily" and result["format"] == "markdown"
        assert result["from_cache"] is False and result["truncated"] is False
    assert extracts(vendor, "/tavily/extract") == [
        {"urls": [A, B], "format": "markdown", "extract_depth": "basic"}
    ]
    assert extracts(vendor, "/exa/contents") == []


async def test_the_first_provider_down_the_same_pages_come_from_the_next(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    vendor.down(503, path_prefix="/tavily")
    client = await start_proxy(fetching(vendor.url, "tavily", "exa"))
    answer = await fetch(client, urls=[A, B])
    assert [(r["url"], r["provider"]) for r in answer["results"]] == [(A, "exa"), (B, "exa")]
    assert page_of(answer, A)["content"] == make_page(A).content
    assert [b["urls"] for b in extracts(vendor, "/exa/contents")] == [[A, B]]


async def test_a_url_the_first_provider_fails_on_alone_goes_to_the_next(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    vendor.fail_page(B, "tavily")
    client = await start_proxy(fetching(vendor.url, "tavily", "exa"))
    answer = await fetch(client, urls=[A, B, C])
    providers = [(r["url"], r["provider"]) for r in answer["results"]]
    assert providers == [(A, "tavily"), (B, "exa"), (C, "tavily")]
    assert answer["failed"] == []
    # Exa was asked for the one page Tavily could not read, and nothing else.
    assert [b["urls"] for b in extracts(vendor, "/exa/contents")] == [[B]]


async def test_firecrawl_and_jinas_reader_one_url_a_call_with_failover(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    vendor.fail_page(A, "firecrawl")
    client = await start_proxy(fetching(vendor.url, "firecrawl", "jina-reader"))
    answer = await fetch(client, urls=[A, B], format="text")
    assert [(r["url"], r["provider"]) for r in answer["results"]] == [
        (A, "jina-reader"),
        (B, "firecrawl"),
    ]
    # Firecrawl gives markdown only, and says so; the reader gives the format asked.
    assert page_of(answer, B)["format"] == "markdown"
    assert page_of(answer, A)["format"] == "text"
    assert sorted(b["url"] for b in extracts(vendor, "/firecrawl/v2/scrape")) == sorted([A, B])
    reader = [r for r in vendor.requests if r.path == "/jina-reader/"]
    assert [r.json() for r in reader] == [{"url": A}]
    assert reader[0].headers["X-Return-Format"] == "text"
    assert reader[0].headers["Accept"] == "application/json"


async def test_a_page_no_provider_reads_is_failed_with_what_each_said(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    vendor.fail_page(B)
    client = await start_proxy(fetching(vendor.url, "tavily", "exa", "jina-reader"))
    answer = await fetch(client, urls=[A, B])
    assert [r["url"] for r in answer["results"]] == [A]
    [failed] = answer["failed"]
    assert failed["url"] == B and failed["error"]["type"] == "page_failed"
    message = failed["error"]["message"]
    for said in ("tavily: Failed to fetch url", "exa: CRAWL_NOT_FOUND", "jina-reader: 422"):
        assert said in message
    assert [a["provider"] for a in failed["attempts"]] == ["tavily", "exa", "jina-reader"]


async def test_every_provider_down_is_unavailable_with_when_to_retry(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    vendor.down(503)
    client = await start_proxy(fetching(vendor.url, "tavily", "exa"))
    answer = await fetch(client, urls=[A])
    [failed] = answer["failed"]
    assert failed["error"]["type"] == "providers_unavailable"
    assert "tavily: 503" in failed["error"]["message"]
    assert "retry shortly" in failed["error"]["message"]


async def test_a_provider_without_its_key_is_skipped_and_says_how_to_set_it(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    raw = fetching(vendor.url, "tavily", "exa")
    raw["routes"]["tavily"]["headers"] = {"set": {"Authorization": "Bearer ${TAVILY_KEY:-}"}}
    client = await start_proxy(raw)
    answer = await fetch(client, urls=[A])
    assert page_of(answer, A)["provider"] == "exa"
    alone = await fetch(client, urls=["https://example.com/unread"], providers=["tavily"])
    [failed] = alone["failed"]
    assert failed["attempts"][0]["reason"].startswith("has no API key: TAVILY_KEY is not set")
    assert extracts(vendor, "/tavily/extract") == []


async def test_the_page_cache_answers_every_caller_and_no_cache_reads_anew(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(fetching(vendor.url, "tavily"))
    await fetch(client, urls=[A], headers={"Authorization": "Bearer caller-one"})
    # Another caller, another spelling of the same page, a shorter max_chars: one cache entry.
    again = await fetch(
        client,
        urls=["HTTPS://Example.com:443/articles/token-buckets#intro"],
        max_chars=10,
        headers={"Authorization": "Bearer caller-two"},
    )
    [page] = again["results"]
    assert page["from_cache"] is True and page["provider"] == "tavily"
    assert page["content"] == make_page(A).content[:10] and page["truncated"] is True
    assert len(extracts(vendor, "/tavily/extract")) == 1
    # The format is part of the key; Cache-Control: no-cache reads the page again.
    await fetch(client, urls=[A], format="text")
    anew = await fetch(client, urls=[A], headers={"Cache-Control": "no-cache"})
    assert anew["results"][0]["from_cache"] is False
    assert len(extracts(vendor, "/tavily/extract")) == 3
    metrics = await (await client.get("/metrics")).text()
    assert 'search_proxy_cache_total{result="hit",route="/v1/fetch"} 1.0' in metrics
    assert 'search_proxy_fetch_pages_total{outcome="cached",provider="tavily"} 1.0' in metrics


async def test_a_stale_page_stands_in_when_every_provider_fails(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    clock = ManualClock()
    raw = fetching(vendor.url, "tavily", cache={"ttl": "1m", "stale_ttl": "1h"})
    client = await start_proxy(raw, clock=clock)
    first = await fetch(client, urls=[A])
    clock.advance(120)  # past the ttl: the cache no longer answers while tavily does
    await fetch(client, urls=[A])
    assert len(extracts(vendor, "/tavily/extract")) == 2
    vendor.down(503)
    clock.advance(120)
    stale = await fetch(client, urls=[A])
    [page] = stale["results"]
    assert page["from_cache"] is True and page["content"] == first["results"][0]["content"]
    assert stale["failed"] == []
    metrics = await (await client.get("/metrics")).text()
    assert 'search_proxy_cache_total{result="stale",route="/v1/fetch"} 1.0' in metrics
    assert 'search_proxy_fetch_pages_total{outcome="stale",provider="tavily"} 1.0' in metrics
    clock.advance(3600)  # past stale_ttl too: nothing stands in
    gone = await fetch(client, urls=[A])
    assert gone["results"] == [] and gone["failed"][0]["error"]["type"] == "providers_unavailable"


async def test_content_is_cut_to_max_chars_and_the_providers_asked_can_be_named(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(fetching(vendor.url, "tavily", "exa"))
    answer = await fetch(client, urls=[A], max_chars=12, providers=["exa"])
    [page] = answer["results"]
    assert page["provider"] == "exa" and page["content"] == make_page(A).content[:12]
    assert page["truncated"] is True
    assert extracts(vendor, "/tavily/extract") == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "body must be a JSON object"),
        (
            {"url": A},
            "url is not a known field (known: urls, format, max_chars, providers); did "
            'you mean "urls"?',
        ),
        ({"urls": []}, "urls must be a list of 1 to 3 URLs (fetch_api.max_urls)"),
        ({"urls": [A, B, C, A]}, "urls must be a list of 1 to 3 URLs"),
        ({"urls": ["ftp://example.com/x"]}, "urls[0] must be an absolute http or https URL"),
        ({"urls": ["https://u:p@example.com/"]}, "urls[0] must not carry credentials"),
        ({"urls": [A, A + "#top"]}, "urls[1] is the page of urls[0] again"),
        ({"urls": [A], "format": "html"}, "format must be one of markdown, text"),
        ({"urls": [A], "max_chars": 0}, "max_chars must be a whole number from 1 to"),
        (
            {"urls": [A], "providers": ["brave"]},
            "providers[0] is not a fetch provider (known: tavily, exa)",
        ),
    ],
)
async def test_a_bad_body_is_a_400_naming_the_field(
    vendor: FakeVendor, start_proxy: Any, body: Any, message: str
) -> None:
    client = await start_proxy(fetching(vendor.url, "tavily", "exa", max_urls=3))
    r = await client.post("/v1/fetch", json=body)
    error = (await r.json())["error"]
    assert r.status == 400 and error["type"] == "bad_request"
    assert error["message"].startswith("/v1/fetch: ") and message in error["message"]
    assert vendor.requests == []


async def test_get_is_405_and_no_provider_is_404_saying_what_to_configure(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(fetching(vendor.url, "tavily"))
    r = await client.get("/v1/fetch")
    assert r.status == 405 and r.headers["Allow"] == "POST"
    off = await start_proxy(
        {"routes": {"brave": route(vendor.url, "/brave", search={"vendor": "brave"})}}
    )
    r = await off.post("/v1/fetch", json={"urls": [A]})
    assert r.status == 404 and "extract API" in (await r.json())["error"]["message"]


async def test_openapi_describes_v1_fetch_and_real_answers_match_it(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    vendor.fail_page(B)
    client = await start_proxy(fetching(vendor.url, "tavily", "exa", max_urls=4))
    document = await (await client.get("/openapi.json")).json()
    validate_spec(document)
    assert "/v1/search" in document["paths"] and "/v1/fetch" in document["paths"]
    request = document["components"]["schemas"]["FetchRequest"]
    assert request["properties"]["urls"]["maxItems"] == 4
    assert request["properties"]["providers"]["items"]["enum"] == ["tavily", "exa"]
    _validator(document, "FetchRequest").validate({"urls": [A], "format": "text"})
    _validator(document, "FetchAnswer").validate(await fetch(client, urls=[A, B]))


def test_fetch_api_config_round_trips_and_resolves_its_providers() -> None:
    raw = {
        "routes": routes("http://127.0.0.1:9"),
        "fetch_api": {"vendors": {"jina-reader": "jina"}},
    }
    config = parse_config(raw, {})
    # Unset: every route whose vendor's extract API it reaches, in route order.
    assert config.fetch_api.providers == ("tavily", "exa", "firecrawl", "jina-reader")
    assert parse_config(as_document(config), {}) == config


@pytest.mark.parametrize(
    ("fetch_api", "path", "reason"),
    [
        ({"providers": ["brave"]}, "fetch_api.providers[0]", "brave has no extract API"),
        ({"providers": ["nope"]}, "fetch_api.providers[0]", "'nope' is not a route"),
        (
            {"providers": ["jina"]},
            "fetch_api.providers[0]",
            "jina's extract API is at https://r.jina.ai, not this search route's upstream",
        ),
        ({"providers": ["plain"]}, "fetch_api.providers[0]", "name the vendor whose extract API"),
        ({"providers": ["direct"]}, "fetch_api.providers[0]", "the direct fetcher is off"),
        ({"providers": ["tavily", "tavily"]}, "fetch_api.providers[1]", "repeats 'tavily'"),
        ({"vendors": {"plain": "brave"}}, "fetch_api.vendors.plain", "no vendor with an extract"),
        (
            {"providers": ["tavily"], "direct": {"enabled": True}},
            "fetch_api.direct.enabled",
            "does not list direct",
        ),
        ({"max_chars": 10, "max_page_chars": 5}, "fetch_api.max_chars", "must not exceed"),
        (
            {"direct": {"allow_networks": ["10.0.0.0/33"]}},
            "fetch_api.direct.allow_networks[0]",
            "not a CIDR block",
        ),
        ({"direct": {"ports": [0]}}, "fetch_api.direct.ports[0]", "from 1 to 65535"),
    ],
)
def test_bad_fetch_api_config_names_the_yaml_path(
    fetch_api: dict[str, Any], path: str, reason: str
) -> None:
    url = "http://127.0.0.1:9"
    raw = {
        "routes": {
            "tavily": route(url, "/tavily", search={"vendor": "tavily"}),
            "brave": route(url, "/brave", search={"vendor": "brave"}),
            "jina": route(url, "/jina", search={"vendor": "jina"}),
            "plain": route(url, "/plain"),
        },
        "fetch_api": fetch_api,
    }
    with pytest.raises(ConfigErrors) as caught:
        parse_config(raw, {})
    found = [(e.path, e.reason) for e in caught.value.errors]
    assert any(p == path and reason in r for p, r in found), found


def test_a_broken_route_fetch_api_names_is_reported_once_by_its_own_errors() -> None:
    """check-config's rule: every mistake in one run, a broken part reported once, not again
    by what names it."""
    raw = fetching("http://127.0.0.1:9", "tavily", "jina-reader")
    raw["routes"]["tavily"]["timeouts"]["per_try"] = "ten"
    raw["routes"]["jina-reader"]["retry"] = {"attempts": 99}
    with pytest.raises(ConfigErrors) as caught:
        parse_config(raw, {})
    assert sorted(e.path for e in caught.value.errors) == [
        "routes.jina-reader.retry.attempts",
        "routes.tavily.timeouts.per_try",
    ]


def test_the_docs_document_every_fetch_api_key_and_the_example_is_valid() -> None:
    text = CONFIGURATION.read_text(encoding="utf-8")
    start = text.index("## `fetch_api` (`POST /v1/fetch`)")
    section = text[start : text.index("\n## ", start)]
    first_cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    documented = {name for cell in first_cells for name in re.findall(r"`([^`]+)`", cell)}
    keys = {f.name for f in fields(FetchApiConfig)} - {"cache", "direct"}
    keys |= {f"cache.{f.name}" for f in fields(PageCacheConfig)}
    keys |= {f"direct.{f.name}" for f in fields(DirectFetchConfig)}
    missing = keys - documented
    assert not missing, f"docs/configuration.md's fetch_api section leaves out: {sorted(missing)}"
    endpoint = ENDPOINTS.read_text(encoding="utf-8")
    example = re.search(r"curl -s localhost:8080/v1/fetch -d '(.*?)'", endpoint, re.DOTALL)
    assert example is not None
    call = parse_request(json.loads(example.group(1)), FetchApiConfig(providers=("tavily",)))
    assert call.call.format == "markdown" and call.max_chars == 8000


async def test_two_replicas_share_the_page_cache_through_redis(
    vendor: FakeVendor, start_proxy: Any, redis_server: Any
) -> None:
    raw = fetching(vendor.url, "tavily")
    raw["redis"] = {"url": redis_server.url, "key_prefix": "fetch-test"}
    one, two = await start_proxy(raw), await start_proxy(raw)
    await fetch(one, urls=[A])
    again = await fetch(two, urls=[A])
    assert again["results"][0]["from_cache"] is True
    assert len(extracts(vendor, "/tavily/extract")) == 1

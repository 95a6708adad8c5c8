"""The vendors' real SDKs pointed at the proxy through their documented base-URL overrides:
they parse the proxied fake-vendor answers unchanged while retry, cache, search recovery,
query validation and the loop guard act on the route.

Sync clients run in a thread (``asyncio.to_thread``) so the proxy and the fake vendor, served
from the test's event loop, keep answering; async clients are awaited directly.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import scavio
import tavily
from exa_py import AsyncExa, Exa
from linkup import LinkupAuthenticationError, LinkupClient, LinkupInvalidRequestError

from testkit.fakevendor import Fault, Received, expected_urls, make_results
from tests.conftest import route

with warnings.catch_warnings():  # "langchain-community is being sunset": still where it lives
    warnings.simplefilter("ignore", DeprecationWarning)
    from langchain_community.utilities.brave_search import BraveSearchWrapper

KEY = "sdk-test-key"
RETRY = {"attempts": 3, "backoff": {"initial": "10ms", "max": "20ms"}}
CACHE = {"ttl": "10m", "stale_ttl": "1h"}

Hit = tuple[str, str, str]  # url, title, snippet as the SDK parsed them


# --------------------------------------------------------------------------- SDK adapters
# Each takes the proxy's URL for the route (http://127.0.0.1:PORT/<vendor>), a query and a
# result count, calls the SDK the way its docs show, and returns what the SDK parsed.


def tavily_sync(base: str, query: str, n: int) -> list[Hit]:
    with tavily.TavilyClient(api_key=KEY, api_base_url=base) as client:
        answer = client.search(query, max_results=n)
    return [(r["url"], r["title"], r["content"]) for r in answer["results"]]


async def tavily_async(base: str, query: str, n: int) -> list[Hit]:
    async with tavily.AsyncTavilyClient(api_key=KEY, api_base_url=base) as client:
        answer = await client.search(query, max_results=n)
    return [(r["url"], r["title"], r["content"]) for r in answer["results"]]


def exa_sync(base: str, query: str, n: int) -> list[Hit]:
    answer = Exa(api_key=KEY, base_url=base).search(query, num_results=n)
    return [(r.url, r.title, r.text) for r in answer.results]


async def exa_async(base: str, query: str, n: int) -> list[Hit]:
    async with AsyncExa(api_key=KEY, api_base=base) as client:  # AsyncExa: `api_base`
        answer = await client.search(query, num_results=n)
    return [(r.url, r.title, r.text) for r in answer.results]


def brave_sync(base: str, query: str, n: int) -> list[Hit]:
    wrapper = BraveSearchWrapper(
        api_key=KEY, base_url=f"{base}/res/v1/web/search", search_kwargs={"count": n}
    )
    return [(r["link"], r["title"], r["snippet"]) for r in json.loads(wrapper.run(query))]


def _scavio_hits(answer: dict[str, Any]) -> list[Hit]:
    return [(r["link"], r["title"], r["snippet"]) for r in answer["organic_results"]]


# scavio retries 429/5xx itself and rate-limits to 1 request/s by default: both off, so the
# proxy's retry is the one tested and a second call is not held back a second.
SCAVIO_OPTIONS: dict[str, Any] = {"max_retries": 0, "max_requests_per_second": 50}


def scavio_sync(base: str, query: str, n: int) -> list[Hit]:
    with scavio.ScavioClient(api_key=KEY, base_url=base, **SCAVIO_OPTIONS) as client:
        return _scavio_hits(client.search(query))


async def scavio_async(base: str, query: str, n: int) -> list[Hit]:
    async with scavio.AsyncScavioClient(api_key=KEY, base_url=base, **SCAVIO_OPTIONS) as client:
        return _scavio_hits(await client.search(query))


LINKUP_SEARCH: dict[str, Any] = {"depth": "standard", "output_type": "searchResults"}


def linkup_sync(base: str, query: str, n: int) -> list[Hit]:
    answer = LinkupClient(api_key=KEY, base_url=f"{base}/v1").search(
        query, max_results=n, **LINKUP_SEARCH
    )
    return [(r.url, r.name, r.content) for r in answer.results]


async def linkup_async(base: str, query: str, n: int) -> list[Hit]:
    answer = await LinkupClient(api_key=KEY, base_url=f"{base}/v1").async_search(
        query, max_results=n, **LINKUP_SEARCH
    )
    return [(r.url, r.name, r.content) for r in answer.results]


@dataclass(frozen=True)
class Sdk:
    name: str  # route prefix, fake-vendor prefix and search profile
    path: str  # the path the fake vendor receives
    method: str
    auth: tuple[str, str]  # the SDK's credential header as it must reach the vendor
    query_of: Callable[[Received], str]  # the query text of a recorded vendor request
    n: int  # results asked for (scavio's search has no count parameter: the fake's 3)
    calls: dict[str, Callable[..., Any]]  # "sync" / "async"
    bad_request: tuple[type[Exception], str | None]  # the SDK's error for the proxy's own 400
    bad_key: tuple[int, type[Exception], str]  # the vendor's bad-key status, the SDK's error


def _json_field(name: str) -> Callable[[Received], str]:
    return lambda rec: rec.json()[name]


SDKS = [
    Sdk(
        "tavily",
        "/tavily/search",
        "POST",
        ("Authorization", f"Bearer {KEY}"),
        _json_field("query"),
        2,
        {"sync": tavily_sync, "async": tavily_async},
        # Tavily reads `detail.error`; the proxy's own error body has `error.message`, so the
        # message is empty (the type is right).
        (tavily.BadRequestError, None),
        (401, tavily.InvalidAPIKeyError, "^Unauthorized$"),  # the vendor's detail.error
    ),
    Sdk(
        "exa",
        "/exa/search",
        "POST",
        ("x-api-key", KEY),
        _json_field("query"),
        2,
        {"sync": exa_sync, "async": exa_async},
        (ValueError, "(?s)status code 400.*over the limit of 50"),
        (401, ValueError, "(?s)status code 401.*Unauthorized"),
    ),
    Sdk(
        "brave",
        "/brave/res/v1/web/search",
        "GET",
        ("X-Subscription-Token", KEY),
        lambda rec: rec.query["q"],
        2,
        {"sync": brave_sync},
        (Exception, "HTTP error 400"),
        (422, Exception, "HTTP error 422"),  # Brave's bad key is 422
    ),
    Sdk(
        "scavio",
        "/scavio/api/v2/google",
        "POST",
        ("Authorization", f"Bearer {KEY}"),
        _json_field("query"),
        3,
        {"sync": scavio_sync, "async": scavio_async},
        (scavio.BadRequestError, "over the limit of 50"),
        (401, scavio.InvalidAPIKeyError, "Unauthorized"),
    ),
    Sdk(
        "linkup",
        "/linkup/v1/search",
        "POST",
        ("Authorization", f"Bearer {KEY}"),
        _json_field("q"),
        2,
        {"sync": linkup_sync, "async": linkup_async},
        (LinkupInvalidRequestError, "(?s)invalid request.*over the limit of 50"),
        (401, LinkupAuthenticationError, "(?s)authentication error.*Unauthorized"),
    ),
]

ALL_CALLS = [pytest.param(sdk, mode, id=f"{sdk.name}-{mode}") for sdk in SDKS for mode in sdk.calls]
SYNC_CALLS = [pytest.param(sdk, "sync", id=sdk.name) for sdk in SDKS]


async def call(sdk: Sdk, mode: str, client: Any, query: str) -> list[Hit]:
    """Run the SDK against the proxy's route for its vendor."""
    base = str(client.make_url(f"/{sdk.name}"))
    fn = sdk.calls[mode]
    if mode == "async":
        return await fn(base, query, sdk.n)
    return await asyncio.to_thread(fn, base, query, sdk.n)


def expected(query: str, n: int) -> list[Hit]:
    """The fake vendor's results, as every SDK must hand them back."""
    return [(r.url, r.title, r.snippet) for r in make_results(query, n)]


async def proxy_for(
    start_proxy: Callable[..., Awaitable[Any]], vendor: Any, sdk: Sdk, **search: Any
) -> Any:
    """The proxy with one route for the SDK's vendor: retry, cache and search recovery on."""
    body = route(
        f"{vendor.url}/{sdk.name}",
        f"/{sdk.name}",
        retry=RETRY,
        cache=CACHE,
        search={"vendor": sdk.name, **search},
    )
    return await start_proxy({"routes": {sdk.name: body}})


def assert_forwarded(sdk: Sdk, rec: Received) -> None:
    """The SDK's request reached the vendor's path with its credential unchanged."""
    assert (rec.method, rec.path) == (sdk.method, sdk.path)
    name, value = sdk.auth
    assert rec.headers.getall(name) == [value]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("sdk", "mode"), ALL_CALLS)
async def test_sdk_call_survives_a_503_then_hits_the_cache(vendor, start_proxy, sdk, mode):
    client = await proxy_for(start_proxy, vendor, sdk)
    vendor.script(Fault.status(503))
    query = "circuit breaker pattern"

    got = await call(sdk, mode, client, query)  # the SDK makes one call; the proxy retries
    assert got == expected(query, sdk.n)
    assert [url for url, _, _ in got] == expected_urls(query, sdk.n)
    assert vendor.count() == 2
    first, second = vendor.requests
    assert_forwarded(sdk, first)
    assert_forwarded(sdk, second)
    assert (second.query_string, second.body) == (first.query_string, first.body)  # replayed
    assert sdk.query_of(first) == query

    again = await call(sdk, mode, client, query)  # identical call: a fresh cache hit
    assert again == got
    assert vendor.count() == 2


@pytest.mark.parametrize(("sdk", "mode"), ALL_CALLS)
async def test_sdk_gets_results_of_a_simplified_query(vendor, start_proxy, sdk, mode):
    client = await proxy_for(start_proxy, vendor, sdk)
    vendor.empty_when_words_over(3)  # the vendor's own empty answer (Linkup: 400 NO_RESULT)
    query = "how do python asyncio event loops really work"

    got = await call(sdk, mode, client, query)
    sent = [sdk.query_of(rec) for rec in vendor.requests]
    assert sent[0] == query and len(sent) >= 2
    used = sent[-1]
    assert len(used.split()) <= 3
    assert got == expected(used, sdk.n)
    for rec in vendor.requests:
        assert_forwarded(sdk, rec)


@pytest.mark.parametrize(("sdk", "mode"), SYNC_CALLS)
async def test_sdk_raises_its_own_error_for_a_refused_query(vendor, start_proxy, sdk, mode):
    client = await proxy_for(start_proxy, vendor, sdk, max_query_chars=50)
    error, match = sdk.bad_request
    with pytest.raises(error, match=match):
        await call(sdk, mode, client, "x" * 51)
    assert vendor.count() == 0


@pytest.mark.parametrize(("sdk", "mode"), SYNC_CALLS)
async def test_vendor_bad_key_reaches_the_sdk_once(vendor, start_proxy, sdk, mode):
    client = await proxy_for(start_proxy, vendor, sdk)
    status, error, match = sdk.bad_key
    vendor.set_default(Fault.status(status))  # the vendor's own error body
    for _ in range(2):  # the second identical call is replayed by the loop guard
        with pytest.raises(error, match=match):
            await call(sdk, mode, client, "bad key")
    assert vendor.count() == 1
    assert_forwarded(sdk, vendor.last)

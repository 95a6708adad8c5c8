"""/v1/search as a complete search API, through the proxy app and the fake vendors: every option
reaches each vendor's request in the right field (or is listed as dropped), LiteLLM's aliases,
result details, the agent's own keys, and the OpenAPI document checked against real answers."""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate as validate_spec
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from policies.core.clock import ManualClock
from proxy.openapi import option_support
from proxy.search_api import FIELDS
from proxy.testing.fakevendor.vendors import params_of
from testkit.fakevendor import VENDORS, FakeVendor, expected_urls
from tests.conftest import route

RETRY = {"attempts": 1}
# ManualClock's wall clock: 2023-11-14T22:13:20Z; a week earlier is the 7th.
WEEK_AGO = "2023-11-07T22:13:20.000Z"

# One value per documented option.
OPTIONS: dict[str, Any] = {
    "max_results": 2,
    "time_range": "week",
    "include_domains": ["docs.example"],
    "exclude_domains": ["spam.example"],
    "topic": "news",
    "country": "DE",
    "language": "de",
    "safe_search": True,
}

# Where each vendor must receive each option, with the value, written out by hand from the
# vendors' documentation and SDKs. An option missing for a vendor must come back in
# dropped_options, with nothing added to the vendor's request.
EXPECTED: dict[str, dict[str, tuple[str, Any]]] = {
    "tavily": {
        "max_results": ("max_results", 2),
        "time_range": ("time_range", "week"),
        "include_domains": ("include_domains", ["docs.example"]),
        "exclude_domains": ("exclude_domains", ["spam.example"]),
        "topic": ("topic", "news"),
        "country": ("country", "germany"),
    },
    "exa": {
        "max_results": ("numResults", 2),
        "time_range": ("startPublishedDate", WEEK_AGO),
        "include_domains": ("includeDomains", ["docs.example"]),
        "exclude_domains": ("excludeDomains", ["spam.example"]),
        "topic": ("category", "news"),
        "country": ("userLocation", "DE"),
        "safe_search": ("moderation", True),
    },
    "brave": {
        "max_results": ("count", "2"),
        "time_range": ("freshness", "pw"),
        "country": ("country", "DE"),
        "language": ("search_lang", "de"),
        "safe_search": ("safesearch", "strict"),
    },
    "serper": {
        "max_results": ("num", 2),
        "time_range": ("tbs", "qdr:w"),
        "country": ("gl", "de"),
        "language": ("hl", "de"),
    },
    "serpapi": {
        "max_results": ("num", "2"),
        "time_range": ("tbs", "qdr:w"),
        "topic": ("tbm", "nws"),
        "country": ("gl", "de"),
        "language": ("hl", "de"),
        "safe_search": ("safe", "active"),
    },
    "scavio": {  # no result count: the proxy cuts the list
        "time_range": ("time_period", "last_week"),
        "country": ("gl", "de"),
        "language": ("hl", "de"),
        "safe_search": ("safe", "active"),
    },
    "searxng": {  # no result count either
        "time_range": ("time_range", "week"),
        "topic": ("categories", "news"),
        "language": ("language", "de"),
        "safe_search": ("safesearch", "2"),
    },
    "linkup": {
        "max_results": ("maxResults", 2),
        "time_range": ("fromDate", "2023-11-07"),
        "include_domains": ("includeDomains", ["docs.example"]),
        "exclude_domains": ("excludeDomains", ["spam.example"]),
    },
    "jina": {
        "max_results": ("num", 2),
        "include_domains": ("site", ["docs.example"]),
        "topic": ("type", "news"),
        "country": ("gl", "de"),
        "language": ("hl", "de"),
    },
    "firecrawl": {
        "max_results": ("limit", 2),
        "time_range": ("tbs", "qdr:w"),
        "topic": ("sources", ["news"]),
        "country": ("country", "DE"),
    },
}
COUNTLESS = {"scavio", "searxng"}  # max_results is honoured by cutting, not by a field


def provider(vendor_url: str, name: str, **extra: Any) -> dict[str, Any]:
    extra.setdefault("search", {"vendor": name, "on_empty": "pass"})
    extra.setdefault("retry", RETRY)
    return route(f"{vendor_url}/{name}", f"/{name}", **extra)


@pytest.fixture
async def every_vendor(vendor, start_proxy):
    """A proxy with one route per vendor, all on the fake vendor, on a ManualClock."""
    routes = {name: provider(vendor.url, name) for name in VENDORS}
    client = await start_proxy({"routes": routes}, clock=ManualClock())
    return client, vendor


async def search(client: Any, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/search", json=body)
    assert r.status == 200, await r.text()
    return await r.json()


@pytest.mark.parametrize("name", VENDORS)
async def test_every_option_reaches_the_vendor_field_or_is_listed_as_dropped(every_vendor, name):
    client, vendor = every_vendor
    await search(client, query="baseline", providers=[name], max_results=5)
    baseline = params_of(vendor.last)
    for option, value in OPTIONS.items():
        answer = await search(client, query=f"{name} {option}", providers=[name], **{option: value})
        sent = params_of(vendor.last)
        assert sent.get(_query_field(name)) == f"{name} {option}"
        added = set(sent) - set(baseline)
        if option in EXPECTED[name]:
            field, wire = EXPECTED[name][option]
            assert sent[field] == wire, (name, option)
            # The count field is in the baseline too, with another value.
            assert added == (set() if option == "max_results" else {field}), (name, option)
            assert answer["dropped_options"] == [], (name, option)
        else:
            assert added == set(), (name, option, added)
            expected = [] if option == "max_results" and name in COUNTLESS else [option]
            assert answer["dropped_options"] == expected, (name, option)
        assert answer["provider"] == name and answer["results"], (name, option)
        assert answer["attempts"][0]["dropped_options"] == answer["dropped_options"]


def _query_field(vendor: str) -> str:
    return "query" if vendor in ("tavily", "exa", "scavio", "firecrawl") else "q"


def test_the_table_above_is_the_one_the_openapi_document_publishes():
    published = option_support()
    assert set(published) == set(EXPECTED)
    for name, honoured in EXPECTED.items():
        shown = {o.removesuffix(" (general only)") for o in published[name]}
        assert shown - {"topic"} == set(honoured) - {"max_results", "topic"}, name
        assert ("topic" in published[name]) == ("topic" in honoured), name


async def test_all_options_together_and_the_rules_between_them(every_vendor):
    client, vendor = every_vendor
    options = {k: v for k, v in OPTIONS.items() if k != "max_results"}
    tavily = await search(client, query="all of them", providers=["tavily"], **options)
    # Tavily's country applies to general searches only.
    assert tavily["dropped_options"] == ["country", "language", "safe_search"]
    assert "country" not in params_of(vendor.last)
    exa = await search(client, query="all of them", providers=["exa"], **options)
    # Exa takes include or exclude domains, not both.
    assert exa["dropped_options"] == ["exclude_domains", "language"]


async def test_litellm_and_perplexity_names_are_accepted(every_vendor):
    client, vendor = every_vendor
    answer = await search(
        client,
        query="aliases",
        providers=["tavily"],
        search_domain_filter=["docs.example", "-spam.example"],
        search_recency_filter="month",
        country="us",
        max_tokens_per_page=512,
    )
    sent = params_of(vendor.last)
    assert sent["include_domains"] == ["docs.example"]
    assert sent["exclude_domains"] == ["spam.example"]
    assert sent["time_range"] == "month" and sent["country"] == "united states"
    assert answer["dropped_options"] == ["max_tokens_per_page"]  # no vendor honours it
    serper = await search(
        client, query="aliases", providers=["serper"], search_domain_filter=["docs.example"]
    )
    assert serper["dropped_options"] == ["search_domain_filter"]  # named as the agent sent it


async def test_results_carry_litellm_fields_and_ours(every_vendor):
    client, _ = every_vendor
    tavily = await search(client, query="details", providers=["tavily"], max_results=2)
    assert tavily["object"] == "search"
    first = tavily["results"][0]
    assert first == {
        "title": "Result 1 for details",
        "url": expected_urls("details", 1)[0],
        "snippet": "Snippet 1 about details.",
        "date": None,
        "last_updated": None,
        "score": 0.9,
        "published_date": None,
        "position": 1,
        "provider": "tavily",
    }
    serpapi = await search(client, query="details", providers=["serpapi"], max_results=3)
    assert [r["position"] for r in serpapi["results"]] == [1, 2, 3]
    assert all(r["score"] is None for r in serpapi["results"])


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"time_range": "hour"}, "/v1/search: time_range must be one of day, week, month, year"),
        ({"country": "UK"}, "/v1/search: country must be an ISO 3166-1 alpha-2 code"),
        ({"language": "english"}, "/v1/search: language must be an ISO 639-1 code"),
        ({"topic": "sports"}, "/v1/search: topic must be one of general, news"),
        ({"safe_search": "on"}, "/v1/search: safe_search must be true or false"),
        ({"include_domains": "a.com"}, "/v1/search: include_domains must be a list"),
        ({"search_domain_filter": [1]}, "/v1/search: search_domain_filter must be a list"),
        (
            {"search_domain_filter": ["a.com"], "exclude_domains": ["b.com"]},
            'search_domain_filter and "exclude_domains" say the same thing',
        ),
        (
            {"search_recency_filter": "day", "time_range": "day"},
            'search_recency_filter and "time_range" say the same thing',
        ),
        ({"max_tokens_per_page": 0}, "/v1/search: max_tokens_per_page must be a whole number"),
        ({"q": "x"}, 'q is not a known field (see GET /openapi.json); did you mean "query"?'),
        ({"credentials": ["k"]}, "/v1/search: credentials must be an object"),
        ({"credentials": {"nope": "k"}}, "/v1/search: credentials.nope is not a search provider"),
        ({"credentials": {"searxng": "k"}}, "searxng takes no API key"),
        ({"credentials": {"tavily": ""}}, "credentials.tavily must be the API key"),
    ],
)
async def test_bad_options_are_refused_naming_the_field(every_vendor, body, needle):
    client, vendor = every_vendor
    r = await client.post("/v1/search", json={"query": "x", **body})
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["type"] == "bad_request" and needle in err["message"], err["message"]
    assert vendor.count() == 0


async def test_an_answer_from_a_routes_own_failover_names_the_fallback(aiohttp_server, start_proxy):
    """A provider route with `fallback:` may answer through another vendor: the answer says
    which, and lists every option as dropped unless the failover says which it applied."""
    first, second, (u1, u2) = await two_vendors(aiohttp_server)
    tavily = provider(u1, "tavily", fallback={"providers": ["brave"]})
    client = await start_proxy({"routes": {"tavily": tavily, "brave": provider(u2, "brave")}})
    first.down()
    answer = await search(client, query="failover", providers=["tavily"], time_range="week")
    assert answer["provider"] == "brave" and second.count() == 1
    assert {r["provider"] for r in answer["results"]} == {"brave"}
    assert answer["dropped_options"] == ["time_range"]


# --- The agent's own keys ---------------------------------------------------------------------


async def two_vendors(aiohttp_server: Any) -> tuple[FakeVendor, FakeVendor, list[str]]:
    first, second = FakeVendor(), FakeVendor()
    urls = []
    for fake in (first, second):
        server = await aiohttp_server(fake.make_app())
        urls.append(str(server.make_url("")).rstrip("/"))
    return first, second, urls


async def test_the_agents_key_goes_to_its_provider_only(aiohttp_server, start_proxy):
    first, second, (u1, u2) = await two_vendors(aiohttp_server)
    keyed = {"set": {"Authorization": "Bearer ${TAVILY_API_KEY}"}}
    brave_key = {"set": {"X-Subscription-Token": "${BRAVE_API_KEY}"}}
    raw = {
        "routes": {
            "tavily": provider(u1, "tavily", headers=keyed),
            "brave": provider(u2, "brave", headers=brave_key),
        }
    }
    env = {"TAVILY_API_KEY": "proxy-tavily", "BRAVE_API_KEY": "proxy-brave"}
    client = await start_proxy(raw, env=env)
    body = {"query": "own key", "credentials": {"tavily": "agent-tavily"}}
    await search(client, **body)
    assert first.last.headers["Authorization"] == "Bearer agent-tavily"
    first.down()  # tavily fails: brave answers with the configured key, never the agent's
    answer = await search(client, **body)
    assert answer["provider"] == "brave"
    seen = second.last
    assert seen.headers["X-Subscription-Token"] == "proxy-brave"
    assert "agent-tavily" not in str(dict(seen.headers)) + seen.query_string + seen.text
    first.up()
    await search(client, query="configured key")
    assert first.last.headers["Authorization"] == "Bearer proxy-tavily"


async def test_an_agents_key_stands_in_for_a_key_not_configured(aiohttp_server, start_proxy):
    first, _second, (u1, _u2) = await two_vendors(aiohttp_server)
    keyed = {"set": {"Authorization": "Bearer ${TAVILY_API_KEY:-}"}}
    client = await start_proxy({"routes": {"tavily": provider(u1, "tavily", headers=keyed)}})
    r = await client.post("/v1/search", json={"query": "no key"})
    err = (await r.json())["error"]
    assert r.status == 502 and "send credentials.tavily)" in err["message"]
    answer = await search(client, query="my key", credentials={"tavily": "mine"})
    assert answer["provider"] == "tavily"
    assert first.last.headers["Authorization"] == "Bearer mine"


async def test_serpapi_takes_the_agents_key_as_its_query_parameter(every_vendor):
    client, vendor = every_vendor
    await search(client, query="serp", providers=["serpapi"], credentials={"serpapi": "sk-1"})
    assert vendor.last.query["api_key"] == "sk-1"


async def test_a_bad_agent_key_is_never_echoed(every_vendor):
    client, _ = every_vendor
    r = await client.post(
        "/v1/search", json={"query": "x", "credentials": {"tavily": "secret\nX-Evil: 1"}}
    )
    assert r.status == 400 and "secret" not in await r.text()


# --- OpenAPI ----------------------------------------------------------------------------------


def _validator(document: dict[str, Any], schema: str) -> Draft202012Validator:
    resource = Resource.from_contents(document, default_specification=DRAFT202012)
    registry = Registry().with_resource("urn:search-proxy", resource)
    ref = {"$ref": f"urn:search-proxy#/components/schemas/{schema}"}
    return Draft202012Validator(ref, registry=registry)


async def test_openapi_document_is_valid_and_matches_real_answers(
    every_vendor, aiohttp_server, start_proxy
):
    client, vendor = every_vendor
    r = await client.get("/openapi.json")
    assert r.status == 200 and r.content_type == "application/json"
    document = await r.json()
    validate_spec(document)  # OpenAPI 3.1, with JSON Schema 2020-12 inside
    assert document["openapi"].startswith("3.1")
    request = document["components"]["schemas"]["SearchRequest"]
    assert set(request["properties"]) == set(FIELDS)  # every accepted field is documented
    check_request = _validator(document, "SearchRequest")
    check_request.validate({"query": "q", **OPTIONS, "credentials": {"tavily": "k"}})
    assert not check_request.is_valid({"query": "q", "q": "x"})  # unknown fields are refused
    assert not check_request.is_valid({"query": "q", "queries": ["q"]})

    answers = _validator(document, "SearchAnswer")
    answers.validate(await search(client, query="schema", providers=["tavily"], **OPTIONS))
    for name in VENDORS:
        answers.validate(await search(client, query=f"schema {name}", providers=[name]))
    batch = await search(client, queries=["one", "two"], providers=["brave"])
    _validator(document, "BatchAnswer").validate(batch)

    errors = _validator(document, "Error")
    bad = await client.post("/v1/search", json={"query": ""})
    assert bad.status == 400
    errors.validate(await bad.json())
    vendor.down()
    down = await client.post("/v1/search", json={"query": "down", "providers": ["tavily"]})
    assert down.status == 503
    errors.validate(await down.json())
    batch = await search(client, queries=["a", "b"], providers=["tavily"])
    _validator(document, "BatchAnswer").validate(batch)
    assert batch["responses"][0]["error"]["type"] == "all_providers_failed"


# --- bounds: what one request may cost ----------------------------------------------------------


async def three_providers(start_proxy: Any, vendor: FakeVendor, **search_api: Any) -> Any:
    """A proxy with tavily, brave and exa as providers (3 attempts each, simplification on) and
    a route without a search section."""
    routes = {
        name: provider(
            vendor.url,
            name,
            search={"vendor": name},
            retry={"attempts": 3, "backoff": {"initial": "1ms", "max": "1ms", "jitter": "none"}},
        )
        for name in ("tavily", "brave", "exa")
    }
    routes["plain"] = route(f"{vendor.url}/echo", "/plain")
    api = {"providers": ["tavily", "brave", "exa"], **search_api}
    return await start_proxy({"routes": routes, "search_api": api}, clock=ManualClock())


@pytest.mark.parametrize(
    ("providers", "field", "says"),
    [
        (["tavily", "brave", "tavily"], "providers[2]", "repeats 'tavily'"),
        (["tavily", "brave", "exa", "brave"], "providers", "names 4 providers; at most 3"),
        (["tavily"] * 1000, "providers", "names 1000 providers; at most 3"),
        (["plain"], "providers[0]", "is not a search provider (known: tavily, brave, exa)"),
    ],
)
async def test_providers_are_search_routes_each_named_at_most_once(
    vendor, start_proxy, providers, field, says
):
    client = await three_providers(start_proxy, vendor)
    r = await client.post("/v1/search", json={"queries": ["a"] * 20, "providers": providers})
    assert r.status == 400
    message = (await r.json())["error"]["message"]
    assert message.startswith(f"/v1/search: {field} ") and says in message
    assert vendor.count() == 0


async def test_batches_are_capped_by_search_api_max_batch(vendor, start_proxy):
    client = await three_providers(start_proxy, vendor, max_batch=2, max_providers=2)
    r = await client.post("/v1/search", json={"queries": ["a", "b", "c"]})
    assert r.status == 400
    assert "1 to 2 queries (search_api.max_batch)" in (await r.json())["error"]["message"]
    document = await (await client.get("/openapi.json")).json()
    request = document["components"]["schemas"]["SearchRequest"]["properties"]
    assert request["queries"]["maxItems"] == 2
    assert request["providers"]["maxItems"] == 2 and request["providers"]["uniqueItems"]
    answer = await search(client, query="default providers")  # the first max_providers
    assert [a["provider"] for a in answer["attempts"]] == ["tavily"]
    assert vendor.count() == 1


async def test_vendor_calls_of_one_request_stop_at_max_calls_per_request(vendor, start_proxy):
    client = await three_providers(start_proxy, vendor, max_batch=5, max_calls_per_request=10)
    vendor.down()  # every call fails: each provider would retry, every query try all three
    r = await client.post("/v1/search", json={"queries": ["a", "b", "c", "d", "e"]})
    assert r.status == 200
    assert vendor.count() == 10  # without the bound: 5 queries x 3 providers x 3 attempts
    responses = (await r.json())["responses"]
    assert all(a["error"]["type"] == "all_providers_failed" for a in responses)
    assert any("call budget spent" in a["error"]["message"] for a in responses)
    vendor.up()
    again = await search(client, query="the next request has its own budget")
    assert again["provider"] == "tavily"

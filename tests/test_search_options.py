"""Unified search options: validation, each vendor's table both ways (build, then read back),
what is dropped and why, the agent's own key, and result details (score, dates, position)."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from policies.core.options import range_since
from policies.profiles import (
    BUILTIN_PROFILES,
    OPTION_NAMES,
    OptionError,
    SearchOptions,
    VendorProfile,
    build_search,
    build_search_request,
    extract_details,
    read_options,
    with_credential,
)
from policies.profiles.details import parse_date
from policies.profiles.reading import MAX_ITEMS_READ
from policies.vendors.tavily import TAVILY_COUNTRIES
from proxy.config import ConfigError, parse_config

P = BUILTIN_PROFILES
NOW = datetime(2024, 5, 10, 15, 0, tzinfo=UTC)

# One value per option, and the alternatives worth a round trip.
VALUES: dict[str, list[Any]] = {
    "time_range": ["day", "week", "month", "year"],
    "include_domains": [("docs.python.org", "example.com")],
    "exclude_domains": [("pinterest.com",)],
    "topic": ["general", "news"],
    "country": ["US", "DE", "JP"],
    "language": ["en", "de", "ja"],
    "safe_search": [True, False],
}


def build(vendor: str | VendorProfile, **options: Any) -> tuple[Any, tuple[str, ...]]:
    profile = P[vendor] if isinstance(vendor, str) else vendor
    return build_search(profile, "q", SearchOptions(**options), now=NOW)


def fields(request: Any) -> dict[str, Any]:
    return {**request.query_params, **(request.json_body or {})}


def read_back(vendor: str, request: Any, now: datetime = NOW) -> SearchOptions:
    body = json.dumps(request.json_body).encode() if request.json_body is not None else b""
    profile = P[vendor]
    return read_options(profile, request.method, request.path, request.query_params, body, now=now)


# --- SearchOptions ---------------------------------------------------------------------------


def test_options_are_normalised():
    o = SearchOptions(
        country="de", language="EN", include_domains=["Example.COM ", "example.com", "*.a.org"]
    )
    assert o.country == "DE" and o.language == "en"
    assert o.include_domains == ("example.com", "*.a.org")  # a tuple, deduplicated
    assert o.requested() == ("include_domains", "country", "language")
    assert SearchOptions(max_results=3).requested() == ()


@pytest.mark.parametrize(
    ("options", "option", "needle"),
    [
        ({"country": "UK"}, "country", "use GB"),
        ({"country": "XX"}, "country", "ISO 3166-1 alpha-2"),
        ({"language": "eng"}, "language", "ISO 639-1"),
        ({"time_range": "hour"}, "time_range", "day, week, month, year"),
        ({"topic": "finance"}, "topic", "general, news"),
        ({"include_domains": "example.com"}, "include_domains", "a list of domain names"),
        ({"exclude_domains": ["https://x.com/a"]}, "exclude_domains", "not a domain name"),
        ({"include_domains": ["a.com"] * 301}, "include_domains", "over the limit of 300"),
        ({"safe_search": "yes"}, "safe_search", "true or false"),
        ({"max_results": 0}, "max_results", "at least 1"),
        ({"max_results": True}, "max_results", "whole number"),
    ],
)
def test_invalid_options_name_the_option_and_say_why(options, option, needle):
    with pytest.raises(OptionError) as info:
        SearchOptions(**options)
    assert info.value.option == option and needle in info.value.reason


# --- Building: what each vendor honours, and what it drops ------------------------------------

# The request field each vendor's option becomes, written out independently of the tables.
HONOURED: dict[str, dict[str, str]] = {
    "tavily": {
        "time_range": "time_range",
        "include_domains": "include_domains",
        "exclude_domains": "exclude_domains",
        "topic": "topic",
        "country": "country",
    },
    "exa": {
        "time_range": "startPublishedDate",
        "include_domains": "includeDomains",
        "exclude_domains": "excludeDomains",
        "topic": "category",
        "country": "userLocation",
        "safe_search": "moderation",
    },
    "brave": {
        "time_range": "freshness",
        "country": "country",
        "language": "search_lang",
        "safe_search": "safesearch",
    },
    "serper": {"time_range": "tbs", "country": "gl", "language": "hl"},
    "serpapi": {
        "time_range": "tbs",
        "country": "gl",
        "language": "hl",
        "safe_search": "safe",
        "topic": "tbm",
    },
    "scavio": {
        "time_range": "time_period",
        "country": "gl",
        "language": "hl",
        "safe_search": "safe",
    },
    "searxng": {
        "time_range": "time_range",
        "language": "language",
        "safe_search": "safesearch",
        "topic": "categories",
    },
    "linkup": {
        "time_range": "fromDate",
        "include_domains": "includeDomains",
        "exclude_domains": "excludeDomains",
    },
    "jina": {"include_domains": "site", "country": "gl", "language": "hl", "topic": "type"},
    "firecrawl": {"time_range": "tbs", "country": "country", "topic": "sources"},
}


@pytest.mark.parametrize("vendor", sorted(P))
def test_each_option_alone_is_written_to_its_field_or_dropped(vendor):
    baseline = fields(build(vendor)[0])
    for name in OPTION_NAMES[1:]:
        value = VALUES[name][0] if name != "topic" else "news"
        request, dropped = build(vendor, **{name: value})
        added = set(fields(request)) - set(baseline)
        if name in HONOURED[vendor]:
            assert dropped == () and added == {HONOURED[vendor][name]}, (vendor, name)
        else:
            assert dropped == (name,) and fields(request) == baseline, (vendor, name)


@pytest.mark.parametrize("vendor", sorted(P))
def test_options_read_back_from_the_request_they_built(vendor):
    """read_options is the inverse of the table: every honoured value comes back, except
    values honoured by sending nothing (Exa's general topic), which read back unset."""
    baseline = fields(build(vendor)[0])
    for name in HONOURED[vendor]:
        for value in VALUES[name]:
            request, dropped = build(vendor, **{name: value})
            if dropped:  # a value this vendor lacks (a country outside Brave's list)
                continue
            got = getattr(read_back(vendor, request), name)
            if fields(request) == baseline:
                assert got is None, (vendor, name, value)
            else:
                assert got == value, (vendor, name, value)


@pytest.mark.parametrize("vendor", sorted(P))
def test_max_results_reads_back_and_none_sends_the_vendors_default(vendor):
    profile = P[vendor]
    request, _ = build(vendor, max_results=4)
    expected = 4 if profile.max_results_field else None
    assert read_back(vendor, request).max_results == expected
    unset, _ = build(vendor)
    assert profile.max_results_field not in fields(unset)


def test_topic_general_is_honoured_everywhere_news_only_where_supported():
    for vendor in P:
        assert build(vendor, topic="general")[1] == ()
    news = {v for v in P if build(v, topic="news")[1] == ()}
    assert news == {"tavily", "exa", "serpapi", "searxng", "jina", "firecrawl"}


def test_time_ranges_become_dates_counted_back_from_now():
    exa, _ = build("exa", time_range="week")
    assert exa.json_body["startPublishedDate"] == "2024-05-03T15:00:00.000Z"
    linkup, _ = build("linkup", time_range="month")
    assert linkup.json_body["fromDate"] == "2024-04-10"
    assert fields(build("brave", time_range="year")[0])["freshness"] == "py"
    assert fields(build("serpapi", time_range="day")[0])["tbs"] == "qdr:d"
    assert fields(build("scavio", time_range="day")[0])["time_period"] == "last_day"


def test_a_start_date_reads_as_the_narrowest_range_covering_it():
    def since(days: float) -> str | None:
        return range_since(NOW - timedelta(days=days), NOW)

    assert [since(d) for d in (0.5, 1, 1.9, 3, 7.9, 20, 31, 100, 366)] == [
        "day",
        "day",
        "day",
        "week",
        "week",
        "month",
        "month",
        "year",
        "year",
    ]
    assert since(400) is None  # older than any range: not expressible


def test_values_converted_for_the_vendor():
    assert fields(build("tavily", country="GB")[0])["country"] == "united kingdom"
    assert fields(build("brave", language="ja")[0])["search_lang"] == "jp"
    assert fields(build("brave", safe_search=False)[0])["safesearch"] == "off"
    assert fields(build("searxng", safe_search=False)[0])["safesearch"] == "0"
    assert fields(build("serpapi", safe_search=False)[0])["safe"] == "off"
    assert fields(build("serper", country="DE")[0])["gl"] == "de"
    assert fields(build("firecrawl", topic="news")[0])["sources"] == ["news"]
    assert len(TAVILY_COUNTRIES) == 166


def test_values_a_vendor_lacks_are_dropped_not_sent():
    assert build("tavily", country="AQ")[1] == ("country",)  # not in Tavily's list
    assert build("brave", country="EE")[1] == ("country",)  # not one of Brave's regions
    assert build("brave", language="sw")[1] == ("language",)
    # Scavio's SafeSearch is off unless asked: false is honoured by sending nothing.
    request, dropped = build("scavio", safe_search=False)
    assert dropped == () and "safe" not in fields(request)


def test_options_that_exclude_each_other_drop_the_second():
    _, dropped = build("tavily", topic="news", country="US")  # country: general searches only
    assert dropped == ("country",)
    request, dropped = build("exa", include_domains=("a.com",), exclude_domains=("b.com",))
    assert dropped == ("exclude_domains",) and "excludeDomains" not in request.json_body


def test_a_custom_profile_uses_the_table_of_the_vendor_it_extends():
    mine = dataclasses.replace(P["tavily"], name="my-tavily", family="tavily")
    assert build(mine, time_range="day")[1] == ()
    # Written from scratch (no `extends`): the same fields, none of Tavily's record.
    alien = VendorProfile(
        name="acme",
        query_locations=P["tavily"].query_locations,
        results_paths=P["tavily"].results_paths,
        search_path=P["tavily"].search_path,
    )
    assert build(alien, time_range="day", topic="general")[1] == ("time_range",)


def test_building_without_options_is_the_plain_request():
    for profile in P.values():
        plain = build_search_request(profile, "q", 5)
        assert build_search(profile, "q", SearchOptions(max_results=5), now=NOW) == (plain, ())


# --- Reading an agent's own request -----------------------------------------------------------


def test_read_options_from_requests_as_sdks_send_them():
    body = json.dumps(
        {"query": "q", "max_results": 7, "time_range": "w", "topic": "finance", "country": "japan"}
    ).encode()
    got = read_options(P["tavily"], "POST", "/search", {}, body, now=NOW)
    assert got == SearchOptions(max_results=7, time_range="week", country="JP")
    brave = {
        "q": "q",
        "count": "3",
        "freshness": "2024-05-01to2024-05-10",
        "safesearch": "moderate",
    }
    got = read_options(P["brave"], "GET", "/res/v1/news/search", brave, b"", now=NOW)
    assert got == SearchOptions(max_results=3, time_range="month", topic="news")
    serper = json.dumps({"q": "q", "tbs": "qdr:h,sbd:1", "gl": "us", "hl": "en-GB"}).encode()
    got = read_options(P["serper"], "POST", "/news", {}, serper, now=NOW)
    assert got == SearchOptions(time_range="day", topic="news", country="US", language="en")
    exa = json.dumps({"query": "q", "userLocation": {"country": "fr"}, "category": "company"})
    assert read_options(P["exa"], "POST", "/search", {}, exa.encode()) == SearchOptions(
        country="FR"
    )
    form = b"q=x&language=fr-FR&categories=news&safesearch=1"
    got = read_options(P["searxng"], "POST", "/search", {}, form, now=NOW)
    assert got == SearchOptions(language="fr", topic="news")  # moderate has no equivalent


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[1, 2]",
        b'{"time_range": 5, "include_domains": 5, "country": "zz", "topic": ["news"]}',
    ],
)
def test_read_options_never_raises_on_junk(body):
    assert read_options(P["tavily"], "POST", "/search", {"max_results": "-1"}, body) == (
        SearchOptions()
    )


def test_get_requests_are_read_from_the_query_string_only():
    body = json.dumps({"freshness": "pd"}).encode()
    assert read_options(P["brave"], "GET", "/x", {"freshness": "pw"}, body).time_range == "week"


# --- The agent's own key ----------------------------------------------------------------------


def test_a_key_goes_where_its_vendor_reads_it():
    tavily = with_credential(P["tavily"], build("tavily")[0], "tvly-1")
    assert tavily.headers["Authorization"] == "Bearer tvly-1"
    brave = with_credential(P["brave"], build("brave")[0], "BSA")
    assert brave.headers["X-Subscription-Token"] == "BSA"
    serpapi = with_credential(P["serpapi"], build("serpapi")[0], "sk")
    assert serpapi.query_params["api_key"] == "sk" and "api_key" not in serpapi.headers
    assert P["searxng"].key_slot is None
    with pytest.raises(ValueError, match="takes no API key"):
        with_credential(P["searxng"], build("searxng")[0], "k")
    with pytest.raises(ValueError, match="one non-empty line"):
        with_credential(P["exa"], build("exa")[0], "k\r\nX-Evil: 1")


def test_a_route_prefix_cannot_take_the_openapi_path():
    raw = {"routes": {"x": {"prefix": "/openapi.json", "upstream": "http://127.0.0.1:1"}}}
    with pytest.raises(ConfigError, match=r"/openapi\.json"):
        parse_config(raw, {})


# --- Result details ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2024-01-15", ("2024-01-15", "2024-01-15")),
        ("2024-01-15T10:20:30Z", ("2024-01-15T10:20:30+00:00", "2024-01-15")),
        ("2024-01-15 10:20:30", ("2024-01-15T10:20:30", "2024-01-15")),
        ("Jan 15, 2024", ("2024-01-15", "2024-01-15")),
        ("15 January 2024", ("2024-01-15", "2024-01-15")),
        ("3 days ago", ("2024-05-07", "2024-05-07")),
        ("an hour ago", ("2024-05-10", "2024-05-10")),
        (1705314030, ("2024-01-15T10:20:30+00:00", "2024-01-15")),
        ("sometime", None),
        (None, None),
        (True, None),
    ],
)
def test_vendor_dates_are_normalised(value, expected):
    assert parse_date(value, NOW) == expected


def test_details_are_read_per_vendor():
    tavily = {
        "results": [
            {"url": "https://a", "title": "A", "content": "x", "score": 0.9},
            {"url": "https://b", "content": "y", "score": 0.5, "published_date": "2024-05-01"},
        ]
    }
    details = extract_details(P["tavily"], tavily, now=NOW)
    assert details["https://a"].score == 0.9 and details["https://a"].position == 1
    assert details["https://b"].date == "2024-05-01" and details["https://b"].position == 2
    serpapi = {"organic_results": [{"link": "https://c", "position": 4, "date": "May 2, 2024"}]}
    c = extract_details(P["serpapi"], serpapi, now=NOW)["https://c"]
    assert (c.position, c.date, c.score) == (4, "2024-05-02", None)
    brave = {"web": {"results": [{"url": "https://d", "age": "2 days ago", "page_age": "junk"}]}}
    assert extract_details(P["brave"], brave, now=NOW)["https://d"].date == "2024-05-08"
    assert extract_details(P["linkup"], {"nope": 1}, now=NOW) == {}


def test_details_are_read_only_as_far_as_results_are():
    huge = {"results": [{"url": f"https://x/{i}", "score": 0.5} for i in range(200_000)]}
    details = extract_details(P["tavily"], huge, now=NOW)
    assert len(details) == MAX_ITEMS_READ
    assert details[f"https://x/{MAX_ITEMS_READ - 1}"].position == MAX_ITEMS_READ

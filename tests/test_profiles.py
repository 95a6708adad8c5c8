"""Tests for vendor profiles on bodies shaped like each vendor's real answers (see VENDORS.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from multidict import CIMultiDict

from policies.core.flow import Request
from policies.profiles import (
    BUILTIN_PROFILES,
    Assessment,
    ProfileError,
    QueryLocation,
    QueryRef,
    RateLimitHint,
    SearchRequest,
    SearchResult,
    VendorProfile,
    Verdict,
    assess,
    build_search_request,
    classify,
    extract_query,
    extract_results,
    normalize_results,
    ratelimit_hint,
    replace_query,
    request_query,
)

P = BUILTIN_PROFILES


def custom(query: str = "q", **fields: Any) -> VendorProfile:
    """A custom profile reading the query from JSON field `query` and results from `items`."""
    fields.setdefault("results_paths", (("items",),))
    return VendorProfile("acme", (QueryLocation("json", query),), **fields)


def j(data: Any) -> bytes:
    return json.dumps(data).encode()


# Successful answers, one per vendor, with the vendor's own field names.
OK_BODIES: dict[str, dict[str, Any]] = {
    "tavily": {
        "query": "aiohttp",
        "results": [{"url": "https://a.example/1", "title": "A1", "content": "c1", "score": 0.9}],
        "response_time": 1.2,
    },
    "serper": {
        "searchParameters": {"q": "aiohttp", "type": "search"},
        "organic": [{"title": "A1", "link": "https://a.example/1", "snippet": "s1", "position": 1}],
        "credits": 1,
    },
    "brave": {
        "type": "search",
        "query": {"original": "aiohttp"},
        "web": {
            "type": "search",
            "results": [{"title": "A1", "url": "https://a.example/1", "description": "d1"}],
        },
    },
    "exa": {
        "requestId": "r1",
        "results": [{"id": "x", "url": "https://a.example/1", "title": "A1", "text": "t1"}],
    },
    "serpapi": {
        "search_metadata": {"status": "Success"},
        "organic_results": [
            {"position": 1, "title": "A1", "link": "https://a.example/1", "snippet": "s1"}
        ],
    },
    "scavio": {
        "organic_results": [
            {"position": 1, "title": "A1", "link": "https://a.example/1", "snippet": "s1"}
        ]
    },
    "searxng": {
        "query": "aiohttp",
        "number_of_results": 1,
        "results": [{"url": "https://a.example/1", "title": "A1", "content": "c1"}],
    },
    "linkup": {
        "results": [{"type": "text", "name": "A1", "url": "https://a.example/1", "content": "c1"}]
    },
    "jina": {
        "code": 200,
        "status": 20000,
        "data": [{"title": "A1", "url": "https://a.example/1", "description": "d1"}],
    },
    "firecrawl": {
        "success": True,
        "data": {
            "web": [
                {"url": "https://a.example/1", "title": "A1", "description": "d1", "position": 1}
            ]
        },
    },
}

# Empty answers as each vendor sends them: (status, body).
EMPTY_ANSWERS: dict[str, tuple[int, dict[str, Any]]] = {
    "tavily": (200, {"query": "zzz", "results": [], "response_time": 0.5}),
    "serper": (200, {"searchParameters": {"q": "zzz"}, "organic": [], "credits": 1}),
    "brave": (200, {"type": "search", "query": {"original": "zzz"}}),  # no `web` at all
    "exa": (200, {"requestId": "r1", "results": []}),
    "serpapi": (
        200,
        {
            "search_metadata": {"status": "Success"},
            "search_information": {"organic_results_state": "Fully empty"},
            "error": "Google hasn't returned any results for this query.",
        },
    ),
    "scavio": (200, {"organic_results": []}),
    "searxng": (200, {"query": "zzz", "number_of_results": 0, "results": []}),
    "linkup": (
        400,
        {
            "statusCode": 400,
            "error": {"code": "SEARCH_QUERY_NO_RESULT", "message": "no result", "details": []},
        },
    ),
    "jina": (200, {"code": 200, "status": 20000, "data": []}),
    "firecrawl": (200, {"success": True, "data": {"web": []}}),
}


def test_every_vendor_has_a_profile() -> None:
    assert sorted(P) == sorted(OK_BODIES) == sorted(EMPTY_ANSWERS)


@pytest.mark.parametrize("vendor", sorted(OK_BODIES))
def test_answer_with_results_is_ok(vendor: str) -> None:
    assert classify(P[vendor], 200, j(OK_BODIES[vendor])) is Verdict.OK


@pytest.mark.parametrize("vendor", sorted(EMPTY_ANSWERS))
def test_vendor_empty_answer_is_empty(vendor: str) -> None:
    status, body = EMPTY_ANSWERS[vendor]
    assert classify(P[vendor], status, j(body)) is Verdict.EMPTY


@pytest.mark.parametrize("vendor", sorted(P))
def test_html_error_page_with_200_is_malformed_except_jina_text_mode(vendor: str) -> None:
    verdict = classify(P[vendor], 200, b"<html><body>Bad gateway</body></html>")
    assert verdict is (Verdict.OK if vendor == "jina" else Verdict.MALFORMED)


@pytest.mark.parametrize("vendor", sorted(P))
def test_truncated_json_and_non_object_json_are_malformed(vendor: str) -> None:
    truncated = j(OK_BODIES[vendor])[:-5]
    expected = Verdict.OK if vendor == "jina" else Verdict.MALFORMED
    assert classify(P[vendor], 200, truncated) is expected
    assert classify(P[vendor], 200, b"[1, 2]") is Verdict.MALFORMED


@pytest.mark.parametrize("vendor", ["tavily", "exa", "linkup", "jina", "searxng"])
def test_missing_result_list_is_malformed_where_the_vendor_always_sends_it(vendor: str) -> None:
    assert classify(P[vendor], 200, j({"requestId": "r1"})) is Verdict.MALFORMED


@pytest.mark.parametrize("vendor", ["brave", "serper", "serpapi", "scavio", "firecrawl"])
def test_missing_result_list_is_empty_where_the_vendor_leaves_it_out(vendor: str) -> None:
    assert classify(P[vendor], 200, j({"type": "search"})) is Verdict.EMPTY


def test_result_list_of_the_wrong_type_is_malformed() -> None:
    assert classify(P["tavily"], 200, j({"results": {"url": "x"}})) is Verdict.MALFORMED
    assert classify(P["jina"], 200, j({"code": 200, "data": None})) is Verdict.MALFORMED


def test_serpapi_results_beat_an_error_field() -> None:
    body = {**OK_BODIES["serpapi"], "error": "something minor"}
    assert classify(P["serpapi"], 200, j(body)) is Verdict.OK


def test_custom_profile_empty_when_body_field_rescues_a_missing_list() -> None:
    profile = custom(empty_when_body_field="notice")
    assert classify(profile, 200, j({"notice": "no results"})) is Verdict.EMPTY
    assert classify(profile, 200, j({"other": 1})) is Verdict.MALFORMED


@pytest.mark.parametrize("status", [432, 433])
def test_tavily_plan_limits_are_terminal(status: int) -> None:
    body = j({"detail": {"error": "This request exceeds your plan's set usage limit."}})
    assert assess(P["tavily"], status, body) == Assessment(
        Verdict.TERMINAL, "This request exceeds your plan's set usage limit."
    )


def test_tavily_429_and_500_pass_to_the_retry_rules() -> None:
    body = j({"detail": {"error": "Too many requests"}})
    assert classify(P["tavily"], 429, body) is Verdict.PASS
    assert classify(P["tavily"], 500, b"Internal Server Error") is Verdict.PASS


def test_linkup_429_is_terminal_only_for_insufficient_credits() -> None:
    credits = j({"statusCode": 429, "error": {"code": "INSUFFICIENT_FUNDS_CREDITS", "message": ""}})
    too_many = j({"statusCode": 429, "error": {"code": "TOO_MANY_REQUESTS", "message": ""}})
    first = assess(P["linkup"], 429, credits)
    second = assess(P["linkup"], 429, too_many)
    assert (first.verdict, first.error_code) == (Verdict.TERMINAL, "INSUFFICIENT_FUNDS_CREDITS")
    assert (second.verdict, second.error_code) == (Verdict.PASS, "TOO_MANY_REQUESTS")


def test_linkup_other_400_is_not_empty() -> None:
    body = j({"statusCode": 400, "error": {"code": "INVALID_REQUEST", "message": "bad depth"}})
    assert classify(P["linkup"], 400, body) is Verdict.PASS


def test_linkup_empty_answer_reports_its_code() -> None:
    status, body = EMPTY_ANSWERS["linkup"]
    assert assess(P["linkup"], status, j(body)).error_code == "SEARCH_QUERY_NO_RESULT"


def test_brave_invalid_token_422_is_terminal_and_429_passes() -> None:
    invalid = j(
        {
            "type": "ErrorResponse",
            "error": {"id": "e1", "status": 422, "code": "SUBSCRIPTION_TOKEN_INVALID"},
        }
    )
    limited = j({"type": "ErrorResponse", "error": {"status": 429, "code": "RATE_LIMITED"}})
    result = assess(P["brave"], 422, invalid)
    assert (result.verdict, result.error_code) == (Verdict.TERMINAL, "SUBSCRIPTION_TOKEN_INVALID")
    assert assess(P["brave"], 429, limited).verdict is Verdict.PASS


@pytest.mark.parametrize(
    ("vendor", "body", "code"),
    [
        (
            "exa",
            {"requestId": "r", "error": "out of credits", "tag": "NO_MORE_CREDITS"},
            "NO_MORE_CREDITS",
        ),
        (
            "scavio",
            {"error": {"code": "insufficient_credits", "message": "top up"}},
            "insufficient_credits",
        ),
        (
            "jina",
            {"data": None, "code": 402, "name": "InsufficientBalanceError"},
            "InsufficientBalanceError",
        ),
        ("firecrawl", {"success": False, "error": "Payment required"}, "Payment required"),
    ],
)
def test_out_of_credits_402_is_terminal(vendor: str, body: dict[str, Any], code: str) -> None:
    result = assess(P[vendor], 402, j(body))
    assert (result.verdict, result.error_code) == (Verdict.TERMINAL, code)


def test_error_status_with_junk_body_passes_without_code() -> None:
    result = assess(P["exa"], 503, b"\xff\xfe not json")
    assert (result.verdict, result.error_code) == (Verdict.PASS, None)


# --- query extraction -----------------------------------------------------------------------


def test_serper_query_in_json_body() -> None:
    ref = extract_query(P["serper"], path="/search", query={}, body=j({"q": "aiohttp", "num": 5}))
    assert ref == QueryRef(QueryLocation("json", "q"), "aiohttp")


def test_a_request_asked_again_answers_for_itself_and_the_profile_asking() -> None:
    # Policies ask in a row about one request: the answer is kept, but only for that request
    # object and that profile.
    both = Request("r", "POST", "/search", "", CIMultiDict(), j({"query": "x", "q": "y"}), "i", "")
    other = Request("r", "POST", "/search", "q=z", CIMultiDict(), b"", "i", "")
    assert request_query(P["tavily"], both) == QueryRef(QueryLocation("json", "query"), "x")
    assert request_query(P["serper"], both) == QueryRef(QueryLocation("json", "q"), "y")
    assert request_query(P["serper"], other) == QueryRef(QueryLocation("query", "q"), "z")
    assert request_query(P["tavily"], other) is None
    assert request_query(P["tavily"], both) == QueryRef(QueryLocation("json", "query"), "x")


def test_serper_langchain_query_string_without_body() -> None:
    ref = extract_query(P["serper"], path="/search", query={"q": "aiohttp"}, body=b"")
    assert ref == QueryRef(QueryLocation("query", "q"), "aiohttp")


def test_serper_batch_array_body_has_no_single_query() -> None:
    body = j([{"q": "a"}, {"q": "b"}])
    assert extract_query(P["serper"], path="/search", query={}, body=body) is None


def test_brave_query_parameter() -> None:
    ref = extract_query(P["brave"], path="/res/v1/web/search", query={"q": "rust"}, body=b"")
    assert ref == QueryRef(QueryLocation("query", "q"), "rust")


def test_jina_query_in_path_is_decoded() -> None:
    ref = extract_query(P["jina"], path="/what%20is%20aiohttp%3F", query={}, body=b"")
    assert ref == QueryRef(QueryLocation("path", "/"), "what is aiohttp?")


def test_jina_post_body_and_bare_root() -> None:
    ref = extract_query(P["jina"], path="/", query={}, body=j({"q": "aiohttp"}))
    assert ref == QueryRef(QueryLocation("json", "q"), "aiohttp")
    assert extract_query(P["jina"], path="/", query={}, body=b"") is None
    assert extract_query(P["jina"], path="/v1/other", query={}, body=b"") is None


def test_searxng_form_body() -> None:
    ref = extract_query(P["searxng"], path="/search", query={}, body=b"q=caf%C3%A9+paris&pageno=2")
    assert ref == QueryRef(QueryLocation("form", "q"), "café paris")


@pytest.mark.parametrize(
    "body", [b"not json", b"\xff\xfe\x00", b"[1,2]", b'"text"', b"null", b"{", b"[" * 100_000]
)
def test_junk_body_means_no_query(body: bytes) -> None:
    assert extract_query(P["tavily"], path="/search", query={}, body=body) is None


@pytest.mark.parametrize("value", [5, None, ["a"], {"text": "a"}, True])
def test_query_that_is_not_text_is_reported(value: Any) -> None:
    ref = extract_query(P["tavily"], path="/search", query={}, body=j({"query": value}))
    assert ref == QueryRef(QueryLocation("json", "query"), "", is_text=False)


def test_nested_json_location_in_custom_profile() -> None:
    profile = custom("params.q")
    body = j({"params": {"q": "deep", "lang": "en"}, "id": 1})
    ref = extract_query(profile, path="/", query={}, body=body)
    assert ref == QueryRef(QueryLocation("json", "params.q"), "deep")
    _, _, new_body = replace_query(profile, ref, "shallow", path="/", query_string="", body=body)
    assert json.loads(new_body) == {"params": {"q": "shallow", "lang": "en"}, "id": 1}


# --- replace_query --------------------------------------------------------------------------


def test_replace_json_query_keeps_other_fields_and_order() -> None:
    body = j({"api_key": "k", "query": "old “quoted” 2024", "max_results": 5, "topic": "news"})
    ref = extract_query(P["tavily"], path="/search", query={}, body=body)
    assert ref is not None
    path, qs, new_body = replace_query(
        P["tavily"], ref, "новый запрос", path="/search", query_string="x=1", body=body
    )
    assert (path, qs) == ("/search", "x=1")
    assert new_body == (
        '{"api_key":"k","query":"новый запрос","max_results":5,"topic":"news"}'.encode()
    )
    assert extract_query(P["tavily"], path=path, query={}, body=new_body) == QueryRef(
        QueryLocation("json", "query"), "новый запрос"
    )


def test_replace_query_string_keeps_other_parameters_verbatim() -> None:
    ref = QueryRef(QueryLocation("query", "q"), "old query")
    path, qs, body = replace_query(
        P["brave"],
        ref,
        "new & improved",
        path="/res/v1/web/search",
        query_string="count=10&q=old+query&safesearch=strict&x=%2F",
        body=b"",
    )
    assert (path, body) == ("/res/v1/web/search", b"")
    assert qs == "count=10&q=new%20%26%20improved&safesearch=strict&x=%2F"


def test_replace_query_string_adds_missing_parameter() -> None:
    ref = QueryRef(QueryLocation("query", "q"), "a")
    _, qs, _ = replace_query(P["serper"], ref, "b c", path="/search", query_string="", body=b"")
    assert qs == "q=b%20c"


def test_replace_jina_path_segment_percent_encodes() -> None:
    ref = extract_query(P["jina"], path="/old%20query", query={}, body=b"")
    assert ref is not None
    path, qs, body = replace_query(
        P["jina"], ref, "a/b c?", path="/old%20query", query_string="num=3", body=b""
    )
    assert (path, qs, body) == ("/a%2Fb%20c%3F", "num=3", b"")
    assert extract_query(P["jina"], path=path, query={}, body=b"") == QueryRef(
        QueryLocation("path", "/"), "a/b c?"
    )


def test_replace_form_body_keeps_other_fields() -> None:
    body = b"q=old&pageno=2&categories=general"
    ref = extract_query(P["searxng"], path="/search", query={}, body=body)
    assert ref is not None
    _, _, new_body = replace_query(
        P["searxng"], ref, "new q", path="/search", query_string="", body=body
    )
    assert new_body == b"q=new%20q&pageno=2&categories=general"


def test_replace_query_rejects_a_location_of_another_profile() -> None:
    ref = QueryRef(QueryLocation("json", "query"), "x")
    with pytest.raises(ValueError, match="not a query location of brave"):
        replace_query(P["brave"], ref, "y", path="/", query_string="", body=b"{}")


# --- results --------------------------------------------------------------------------------


@pytest.mark.parametrize("vendor", sorted(OK_BODIES))
def test_extract_results_for_every_vendor(vendor: str) -> None:
    snippet = {"tavily": "c1", "searxng": "c1", "linkup": "c1", "exa": "t1"}.get(vendor)
    if snippet is None:
        snippet = "d1" if vendor in ("brave", "jina", "firecrawl") else "s1"
    assert extract_results(P[vendor], OK_BODIES[vendor]) == [
        SearchResult("A1", "https://a.example/1", snippet)
    ]


def test_extract_results_tolerates_missing_fields_and_junk_items() -> None:
    body = {
        "results": [
            {"url": "https://a.example/1"},
            "junk",
            {"title": "no url"},
            {"url": "https://a.example/2", "title": None, "content": 5},
        ]
    }
    assert extract_results(P["tavily"], body) == [
        SearchResult("", "https://a.example/1", ""),
        SearchResult("", "https://a.example/2", ""),
    ]


def test_extract_results_from_empty_or_odd_bodies() -> None:
    assert extract_results(P["brave"], {"type": "search"}) == []
    assert extract_results(P["tavily"], None) == []
    assert extract_results(P["tavily"], {"results": "nope"}) == []


def test_extract_results_uses_alternative_lists_and_fields() -> None:
    news = {"news": [{"title": "N", "link": "https://n.example/", "snippet": "s", "date": "1h"}]}
    assert extract_results(P["serper"], news) == [SearchResult("N", "https://n.example/", "s")]
    highlights = {"results": [{"url": "https://e.example/", "highlights": ["one.", "two."]}]}
    assert extract_results(P["exa"], highlights) == [
        SearchResult("", "https://e.example/", "one. two.")
    ]


def _results(*urls: str) -> list[SearchResult]:
    return [SearchResult(f"t{i}", url, "") for i, url in enumerate(urls)]


def test_normalize_dedupes_urls_ignoring_scheme_slash_fragment_and_host_case() -> None:
    results = _results(
        "https://Example.com/a/",
        "http://example.com/a",
        "https://EXAMPLE.COM/a#section",
        "https://example.com/A",
        "https://example.com/a?x=1",
    )
    assert normalize_results(results, max_results=10) == [results[0], results[3], results[4]]


def test_normalize_blocks_domains_with_subdomains_but_not_lookalikes() -> None:
    results = _results(
        "https://pinterest.com/x",
        "https://www.Pinterest.com/y",
        "https://notpinterest.com/z",
        "https://ok.example/",
    )
    kept = normalize_results(results, max_results=10, blocked_domains=("pinterest.com",))
    assert kept == [results[2], results[3]]


def test_normalize_blocks_file_types_on_the_path_only() -> None:
    results = _results(
        "https://a.example/paper.PDF",
        "https://a.example/view?file=x.pdf",
        "https://a.example/deck.pptx#p2",
        "https://a.example/page",
    )
    kept = normalize_results(results, max_results=10, blocked_extensions=(".pdf", "pptx"))
    assert kept == [results[1], results[3]]


def test_normalize_keeps_order_and_cuts_after_filtering() -> None:
    results = _results(
        "https://a.example/1",
        "https://blocked.example/2",
        "https://a.example/1/",
        "https://a.example/3",
        "https://a.example/4",
    )
    kept = normalize_results(results, max_results=2, blocked_domains=["blocked.example"])
    assert kept == [results[0], results[3]]
    assert normalize_results(results, max_results=0) == []


# --- rate-limit headers ---------------------------------------------------------------------


def test_brave_comma_lists_use_the_per_second_window() -> None:
    headers = {
        "X-RateLimit-Limit": "1, 15000",
        "X-RateLimit-Remaining": "0, 14999",
        "X-RateLimit-Reset": "1, 1419704",
    }
    assert ratelimit_hint(P["brave"], headers) == RateLimitHint(0, 1.0)


def test_brave_exhausted_month_window_binds() -> None:
    headers = {"x-ratelimit-remaining": "1, 0", "x-ratelimit-reset": "1, 86400"}
    assert ratelimit_hint(P["brave"], headers) == RateLimitHint(0, 86400.0)


def test_brave_fewest_remaining_window_binds_when_none_is_exhausted() -> None:
    headers = {"X-RateLimit-Remaining": "20, 3", "X-RateLimit-Reset": "1, 500"}
    assert ratelimit_hint(P["brave"], headers) == RateLimitHint(3, 500.0)


def test_scavio_single_window() -> None:
    headers = {"X-RateLimit-Remaining": "42", "X-RateLimit-Reset": "37"}
    assert ratelimit_hint(P["scavio"], headers) == RateLimitHint(42, 37.0)


def test_reset_given_as_unix_time_needs_now() -> None:
    headers = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "1700000060"}
    assert ratelimit_hint(P["scavio"], headers) is None
    assert ratelimit_hint(P["scavio"], headers, now=1_700_000_000.0) == RateLimitHint(0, 60.0)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"X-RateLimit-Remaining": "1, 5"},
        {"X-RateLimit-Remaining": "soon", "X-RateLimit-Reset": "1"},
        {"X-RateLimit-Remaining": "1", "X-RateLimit-Reset": "nan"},
        {"X-RateLimit-Remaining": "-1", "X-RateLimit-Reset": "1"},
    ],
)
def test_absent_or_unparseable_headers_give_no_hint(headers: dict[str, str]) -> None:
    assert ratelimit_hint(P["brave"], headers) is None


def test_vendors_without_ratelimit_headers_give_no_hint() -> None:
    headers = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "5"}
    assert ratelimit_hint(P["tavily"], headers) is None


# --- normalised search requests -------------------------------------------------------------

EXPECTED_REQUESTS: dict[str, SearchRequest] = {
    "tavily": SearchRequest("POST", "/search", {}, {"query": "q1", "max_results": 7}, {}),
    "serper": SearchRequest("POST", "/search", {}, {"q": "q1", "num": 7}, {}),
    "brave": SearchRequest("GET", "/res/v1/web/search", {"q": "q1", "count": "7"}, None, {}),
    "exa": SearchRequest(
        "POST",
        "/search",
        {},
        {"query": "q1", "numResults": 7, "contents": {"text": {"maxCharacters": 1000}}},
        {},
    ),
    "serpapi": SearchRequest(
        "GET", "/search.json", {"q": "q1", "num": "7", "engine": "google"}, None, {}
    ),
    "scavio": SearchRequest("POST", "/api/v2/google", {}, {"query": "q1"}, {}),
    "searxng": SearchRequest("GET", "/search", {"q": "q1", "format": "json"}, None, {}),
    "linkup": SearchRequest(
        "POST",
        "/v1/search",
        {},
        {"q": "q1", "maxResults": 7, "depth": "standard", "outputType": "searchResults"},
        {},
    ),
    "jina": SearchRequest("POST", "/", {}, {"q": "q1", "num": 7}, {"Accept": "application/json"}),
    "firecrawl": SearchRequest("POST", "/v2/search", {}, {"query": "q1", "limit": 7}, {}),
}


@pytest.mark.parametrize("vendor", sorted(EXPECTED_REQUESTS))
def test_build_search_request_for_every_vendor(vendor: str) -> None:
    request = build_search_request(P[vendor], "q1", 7)
    assert request == EXPECTED_REQUESTS[vendor]


def test_build_search_request_caps_and_floors_the_count() -> None:
    assert build_search_request(P["brave"], "q", 50).query_params["count"] == "20"
    assert build_search_request(P["tavily"], "q", 50).json_body == {"query": "q", "max_results": 20}
    assert build_search_request(P["serper"], "q", 0).json_body == {"q": "q", "num": 1}


def test_build_search_request_does_not_share_mutable_extras() -> None:
    first = build_search_request(P["exa"], "q", 3)
    assert first.json_body is not None
    first.json_body["contents"]["text"]["maxCharacters"] = 1
    second = build_search_request(P["exa"], "q", 3)
    assert second.json_body is not None
    assert second.json_body["contents"] == {"text": {"maxCharacters": 1000}}


def test_build_search_request_needs_a_search_path() -> None:
    profile = custom()
    with pytest.raises(ValueError, match="acme: the profile has no search_path"):
        build_search_request(profile, "q", 3)


# --- the profile's own rules ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"results_paths": ()}, "results"),
        ({"search_method": "PUT"}, "search_method"),
        ({"search_path": "search"}, "search_path"),
        ({"search_path": "/s", "search_method": "GET"}, "query"),
        ({"max_results_cap": 0}, "max_results_cap"),
    ],
)
def test_inconsistent_profile_names_the_config_key(fields: dict[str, Any], key: str) -> None:
    with pytest.raises(ProfileError) as excinfo:
        custom(**fields)
    assert excinfo.value.key == key
    assert str(excinfo.value) == f"{key}: {excinfo.value.reason}"


def test_profiles_are_frozen_and_hashable() -> None:
    assert len({P["brave"], P["brave"], P["tavily"]}) == 2
    with pytest.raises(AttributeError):
        P["brave"].search_path = "/x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        P["linkup"].terminal_body_codes[500] = frozenset()  # type: ignore[index]

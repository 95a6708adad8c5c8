"""The built-in vendor profiles, as data: one VendorProfile per supported search API."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from policies.core.profile import QueryKind, QueryLocation, VendorProfile


def _path(dotted: str) -> tuple[str, ...]:
    return tuple(dotted.split(".")) if dotted else ()


def _loc(kind: QueryKind, field: str) -> QueryLocation:
    return QueryLocation(kind, field)


BUILTIN_PROFILES: Mapping[str, VendorProfile] = MappingProxyType(
    {
        p.name: p
        for p in (
            VendorProfile(
                name="tavily",
                query_locations=(_loc("json", "query"),),
                results_paths=(("results",),),
                snippet_fields=("content",),
                terminal_statuses=frozenset({432, 433}),  # plan / pay-as-you-go limit
                error_code_paths=(_path("detail.error"),),
                search_path="/search",
                max_results_field="max_results",
                max_results_cap=20,
            ),
            VendorProfile(
                name="serper",
                # LangChain's wrapper POSTs with `q` in the query string and no body.
                query_locations=(_loc("json", "q"), _loc("query", "q")),
                # /search, /news, /images, /places ... each name their list differently.
                results_paths=tuple(
                    (k,) for k in ("organic", "news", "images", "places", "videos", "shopping")
                ),
                url_fields=("link",),
                # Unverified that `organic` is always sent: absent counts as empty, not broken.
                missing_results_is_empty=True,
                error_code_paths=(_path("message"),),
                search_path="/search",
                max_results_field="num",
            ),
            VendorProfile(
                name="brave",
                query_locations=(_loc("query", "q"),),
                results_paths=(("web", "results"), ("results",)),  # web search; news/videos
                snippet_fields=("description",),
                missing_results_is_empty=True,  # `web` is left out when nothing was found
                # A bad key is 422 SUBSCRIPTION_TOKEN_INVALID; other 422s are the request's own.
                terminal_body_codes={422: frozenset({"SUBSCRIPTION_TOKEN_INVALID"})},
                error_code_paths=(_path("error.code"),),
                ratelimit_headers=True,
                search_method="GET",
                search_path="/res/v1/web/search",
                max_results_field="count",
                max_results_cap=20,
            ),
            VendorProfile(
                name="exa",
                query_locations=(_loc("json", "query"),),
                results_paths=(("results",),),
                snippet_fields=("text", "summary", "highlights"),
                terminal_statuses=frozenset({402}),  # NO_MORE_CREDITS
                error_code_paths=(_path("tag"), _path("error.code"), _path("error")),
                search_path="/search",
                max_results_field="numResults",
                # Without `contents` Exa returns no text to use as a snippet.
                search_extra={"contents": {"text": {"maxCharacters": 1000}}},
            ),
            VendorProfile(
                name="serpapi",
                query_locations=(_loc("query", "q"),),
                results_paths=tuple(
                    (k,) for k in ("organic_results", "news_results", "jobs_results")
                ),
                url_fields=("link",),
                # Empty is HTTP 200 with a top-level "error"; other engines omit the list.
                missing_results_is_empty=True,
                empty_when_body_field="error",
                error_code_paths=(_path("error"),),
                search_method="GET",
                search_path="/search.json",
                max_results_field="num",
                search_extra={"engine": "google"},
            ),
            VendorProfile(
                name="scavio",
                query_locations=(_loc("json", "query"),),
                results_paths=(("organic_results",),),
                url_fields=("link",),
                missing_results_is_empty=True,  # Google-style SERP: unverified it is always sent
                terminal_statuses=frozenset({402}),  # insufficient credits
                error_code_paths=(_path("error.code"), _path("error")),
                ratelimit_headers=True,
                search_path="/api/v2/google",
            ),
            VendorProfile(
                name="searxng",
                query_locations=(_loc("query", "q"), _loc("form", "q")),
                results_paths=(("results",),),
                snippet_fields=("content",),
                search_method="GET",
                search_path="/search",
                search_extra={"format": "json"},
            ),
            VendorProfile(
                name="linkup",
                query_locations=(_loc("json", "q"),),
                results_paths=(("results",), ("sources",)),  # searchResults; sourcedAnswer
                title_fields=("name",),
                snippet_fields=("content", "snippet"),
                empty_status_codes={400: frozenset({"SEARCH_QUERY_NO_RESULT"})},
                # 429 is also TOO_MANY_REQUESTS, which is transient: only the body code decides.
                terminal_body_codes={429: frozenset({"INSUFFICIENT_FUNDS_CREDITS"})},
                error_code_paths=(_path("error.code"),),
                search_path="/v1/search",
                max_results_field="maxResults",
                search_extra={"depth": "standard", "outputType": "searchResults"},
            ),
            VendorProfile(
                name="jina",
                query_locations=(_loc("query", "q"), _loc("json", "q"), _loc("path", "/")),
                results_paths=(("data",),),
                snippet_fields=("description", "content"),
                non_json_ok=True,  # without Accept: application/json Jina answers in text
                terminal_statuses=frozenset({402}),  # InsufficientBalanceError
                error_code_paths=(_path("name"), _path("code")),
                search_path="/",
                max_results_field="num",
                search_headers={"Accept": "application/json"},
            ),
            VendorProfile(
                name="firecrawl",
                query_locations=(_loc("json", "query"),),
                results_paths=(("data", "web"), ("data", "news"), ("data", "images")),
                snippet_fields=("description", "snippet", "markdown"),
                missing_results_is_empty=True,  # `sources` may leave out any one list
                terminal_statuses=frozenset({402}),  # payment required
                error_code_paths=(_path("error"),),
                search_path="/v2/search",
                max_results_field="limit",
            ),
        )
    }
)

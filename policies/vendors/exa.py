"""Exa (POST /search, `query` in the body, `results[]` with `text`): its whole record. Without
`contents` Exa sends no text to use as a snippet, so every search asks for some."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from policies.core.errors import ProxyError
from policies.core.options import (
    OMIT,
    OptionField,
    SearchOptions,
    VendorOptions,
    domain_field,
    iso_start,
    read_bool,
    read_start,
    table,
)
from policies.core.profile import (
    AnswerTemplate,
    CredentialSlot,
    DetailFields,
    QueryLocation,
    VendorProfile,
)


def _read_location(value: Any, now: datetime) -> Any:
    """`userLocation` is a country code or {"country": code, ...}."""
    if isinstance(value, dict):
        value = value.get("country")
    return value if isinstance(value, str) else None


def _excludes(options: SearchOptions) -> bool:
    return not options.include_domains  # Exa takes one of includeDomains and excludeDomains


def _error_body(err: ProxyError, request_id: str) -> dict[str, Any]:
    return {"requestId": request_id, "error": err.message, "tag": err.type.upper()}


EXA = VendorProfile(
    name="exa",
    query_locations=(QueryLocation("json", "query"),),
    results_paths=(("results",),),
    snippet_fields=("text", "summary", "highlights"),
    terminal_statuses=frozenset({402}),  # NO_MORE_CREDITS
    error_code_paths=(("tag",), ("error", "code"), ("error",)),
    search_path="/search",
    max_results_field="numResults",
    search_extra={"contents": {"text": {"maxCharacters": 1000}}},
    key_slot=CredentialSlot("header", "x-api-key"),
    # exa-py 2.28 (its snake_case options go out camelCased).
    options=VendorOptions(
        {
            "time_range": OptionField("startPublishedDate", iso_start, read_start),
            "include_domains": domain_field("includeDomains"),
            "exclude_domains": domain_field("excludeDomains", _excludes),
            # No `category` is a general search.
            "topic": OptionField("category", *table({"news": "news"}, default=OMIT)),
            "country": OptionField("userLocation", read=_read_location),
            "safe_search": OptionField("moderation", read=read_bool),
        }
    ),
    details=DetailFields(score=("score",), published=("publishedDate",)),
    answer=AnswerTemplate(
        envelope={"requestId": "search-proxy-failover", "resolvedSearchType": "neural"},
        extra={"id": "$url", "score": None, "publishedDate": None, "author": None},
    ),
    error_shape=_error_body,
)

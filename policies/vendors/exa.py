"""Exa (POST /search, `query` in the body, `results[]` with `text`): its whole record, and its
extract API (POST /contents). Without `contents` Exa sends no text to use as a snippet, so every
search asks for some."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from policies.core.errors import ProxyError
from policies.core.extract import (
    ExtractAnswer,
    ExtractApi,
    ExtractRequest,
    PageFormat,
    PageMiss,
    PageRead,
    object_of,
    status_of,
    text_of,
)
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


def _extract(urls: tuple[str, ...], fmt: PageFormat, max_chars: int) -> ExtractRequest:
    # On /contents the content options are top-level fields (on /search, under `contents`).
    body = {"urls": list(urls), "text": {"maxCharacters": max_chars}}
    return ExtractRequest("POST", "/contents", body)


def _read_extract(data: Any, urls: tuple[str, ...], fmt: PageFormat) -> ExtractAnswer:
    """`results[]` id (the URL asked)/url/title/text, and since May 2025 `statuses[]`: one per
    URL, `{"id", "status": "error", "error": {"tag", "httpStatusCode"}}` for a failed one."""
    data = object_of(data)
    pages = tuple(
        # Exa's text is markdown whatever was asked.
        PageRead(
            text_of(r.get("id")) or text_of(r.get("url")),
            text_of(r.get("title")),
            text_of(r.get("text")),
            "markdown",
        )
        for r in data.get("results") or ()
        if isinstance(r, dict) and text_of(r.get("text"))
    )
    misses = []
    for s in data.get("statuses") or ():
        if isinstance(s, dict) and s.get("status") == "error":
            error = object_of(s.get("error"))
            why, code = text_of(error.get("tag")) or "error", status_of(error.get("httpStatusCode"))
            misses.append(PageMiss(text_of(s.get("id")), why, code))
    return ExtractAnswer(pages, tuple(misses))


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
    # No documented cap on URLs a call; 10 keeps one answer of long pages well under a route's
    # max_response_bytes.
    extract=ExtractApi(batch=10, build=_extract, read=_read_extract),
)

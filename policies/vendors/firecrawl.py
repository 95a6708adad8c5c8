"""Firecrawl (POST /v2/search, `query` in the body, `data.web[]` with `description`): its whole
record, and its extract API (POST /v2/scrape, one URL a call). `sources` picks web, news or
images, and each list may be left out when empty."""

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
from policies.core.options import OMIT, OptionField, VendorOptions, qdr, read_code, read_qdr
from policies.core.profile import (
    AnswerTemplate,
    CredentialSlot,
    DetailFields,
    QueryLocation,
    VendorProfile,
)


def _sources(value: Any, now: datetime) -> Any:
    return ["news"] if value == "news" else OMIT


def _read_sources(value: Any, now: datetime) -> Any:
    """`sources` is a list of names or of {"type": name} objects."""
    if not isinstance(value, list):
        return None
    names: set[Any] = {v.get("type") if isinstance(v, dict) else v for v in value}
    return {frozenset({"news"}): "news", frozenset({"web"}): "general"}.get(frozenset(names))


def _error_body(err: ProxyError, request_id: str) -> dict[str, Any]:
    return {"success": False, "error": err.message}


def _extract(urls: tuple[str, ...], fmt: PageFormat, max_chars: int) -> ExtractRequest:
    # Firecrawl has no plain-text format: markdown is the nearest, and says so in `format`.
    body = {"url": urls[0], "formats": ["markdown"], "onlyMainContent": True}
    return ExtractRequest("POST", "/v2/scrape", body)


def _read_extract(data: Any, urls: tuple[str, ...], fmt: PageFormat) -> ExtractAnswer:
    """`{"success": true, "data": {"markdown", "metadata": {"title", "statusCode", "error"}}}`;
    a page that answered an error status comes back as a success with that statusCode."""
    data = object_of(data)
    page = object_of(data.get("data"))
    meta = object_of(page.get("metadata"))
    code = status_of(meta.get("statusCode"))
    url = urls[0]
    if data.get("success") is False or (code is not None and code >= 400):
        why = text_of(data.get("error")) or text_of(meta.get("error"))
        why = why or (f"the page answered {code}" if code else "failed")
        return ExtractAnswer(misses=(PageMiss(url, why, code),))
    content = text_of(page.get("markdown"))
    if not content:
        return ExtractAnswer(misses=(PageMiss(url, "no content"),))
    return ExtractAnswer((PageRead(url, text_of(meta.get("title")), content, "markdown"),))


FIRECRAWL = VendorProfile(
    name="firecrawl",
    query_locations=(QueryLocation("json", "query"),),
    results_paths=(("data", "web"), ("data", "news"), ("data", "images")),
    snippet_fields=("description", "snippet", "markdown"),
    missing_results_is_empty=True,  # `sources` may leave out any one list
    terminal_statuses=frozenset({402}),  # payment required
    error_code_paths=(("error",),),
    search_path="/v2/search",
    max_results_field="limit",
    key_slot=CredentialSlot("header", "Authorization", "Bearer "),
    # Firecrawl v2 /search.
    options=VendorOptions(
        {
            "time_range": OptionField("tbs", qdr, read_qdr),
            "country": OptionField("country", read=read_code),
            "topic": OptionField("sources", _sources, _read_sources),
        }
    ),
    details=DetailFields(position=("position",), published=("date",)),  # news: date
    answer=AnswerTemplate(envelope={"success": True}, extra={"position": "$position"}),
    error_shape=_error_body,
    extract=ExtractApi(batch=1, build=_extract, read=_read_extract),
)

"""Jina search (s.jina.ai: POST / or GET /{query}, `q`, `data[]` with `description`): its whole
record, and its reader (r.jina.ai: POST / with `url`, one page a call), which needs a route of
its own. Without `Accept: application/json` Jina answers in text, a valid answer too."""

from __future__ import annotations

from typing import Any

from policies.core.errors import ProxyError, is_rate_limit
from policies.core.extract import (
    ExtractAnswer,
    ExtractApi,
    ExtractRequest,
    PageFormat,
    PageMiss,
    PageRead,
    object_of,
    text_of,
)
from policies.core.options import (
    OptionField,
    VendorOptions,
    domain_field,
    lower,
    read_code,
    table,
)
from policies.core.profile import (
    AnswerTemplate,
    CredentialSlot,
    DetailFields,
    QueryLocation,
    VendorProfile,
)


def _error_body(err: ProxyError, request_id: str) -> dict[str, Any]:
    name = "TooManyRequestsError" if is_rate_limit(err) else "ServiceUnavailableError"
    return {
        "data": None,
        "code": err.status,
        "name": name,
        "status": err.status * 100,
        "message": err.message,
        "readableMessage": err.message,
    }


def _extract(urls: tuple[str, ...], fmt: PageFormat, max_chars: int) -> ExtractRequest:
    headers = {"Accept": "application/json", "X-Return-Format": fmt, "X-Retain-Images": "none"}
    return ExtractRequest("POST", "/", {"url": urls[0]}, headers=headers)


def _read_extract(data: Any, urls: tuple[str, ...], fmt: PageFormat) -> ExtractAnswer:
    """`{"code": 200, "data": {"title", "url", "content"}}`; a page it cannot read is an error
    status with `readableMessage`, which the engine reads as it reads any vendor's."""
    data = object_of(data)
    page = object_of(data.get("data"))
    content = text_of(page.get("content"))
    if not content:
        why = text_of(data.get("readableMessage")) or text_of(data.get("message"))
        return ExtractAnswer(misses=(PageMiss(urls[0], why or "no content"),))
    return ExtractAnswer((PageRead(urls[0], text_of(page.get("title")), content, fmt),))


JINA = VendorProfile(
    name="jina",
    query_locations=(
        QueryLocation("query", "q"),
        QueryLocation("json", "q"),
        QueryLocation("path", "/"),
    ),
    results_paths=(("data",),),
    snippet_fields=("description", "content"),
    non_json_ok=True,  # without Accept: application/json Jina answers in text
    terminal_statuses=frozenset({402}),  # InsufficientBalanceError
    error_code_paths=(("name",), ("code",)),
    search_path="/",
    max_results_field="num",
    search_headers={"Accept": "application/json"},
    key_slot=CredentialSlot("header", "Authorization", "Bearer "),
    # s.jina.ai's parameters (jina-ai/reader's searcher): `site` adds site: operators.
    options=VendorOptions(
        {
            "include_domains": domain_field("site"),
            "country": OptionField("gl", lower, read_code),
            "language": OptionField("hl", read=read_code),
            "topic": OptionField("type", *table({"news": "news", "general": "web"})),
        }
    ),
    details=DetailFields(published=("date", "publishedTime")),
    answer=AnswerTemplate(envelope={"code": 200, "status": 20000}, extra={"content": "$snippet"}),
    error_shape=_error_body,
    extract=ExtractApi(batch=1, build=_extract, read=_read_extract, origin="https://r.jina.ai"),
)

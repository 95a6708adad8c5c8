"""Jina search (s.jina.ai: POST / or GET /{query}, `q`, `data[]` with `description`): its whole
record. Without `Accept: application/json` Jina answers in text, which is a valid answer too."""

from __future__ import annotations

from typing import Any

from policies.core.errors import ProxyError, is_rate_limit
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
)

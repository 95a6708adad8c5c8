"""Serper (POST /search, /news, /images ..., `q`, `organic[]` with `link`): its whole record.
LangChain's wrapper POSTs with `q` in the query string and no body."""

from __future__ import annotations

from typing import Any

from policies.core.errors import ProxyError
from policies.core.options import OptionField, VendorOptions, lower, qdr, read_code, read_qdr
from policies.core.profile import (
    AnswerTemplate,
    CredentialSlot,
    DetailFields,
    QueryLocation,
    VendorProfile,
)


def _error_body(err: ProxyError, request_id: str) -> dict[str, Any]:
    return {"message": err.message, "statusCode": err.status}


SERPER = VendorProfile(
    name="serper",
    query_locations=(QueryLocation("json", "q"), QueryLocation("query", "q")),
    # /search, /news, /images, /places ... each name their list differently.
    results_paths=tuple(
        (k,) for k in ("organic", "news", "images", "places", "videos", "shopping")
    ),
    url_fields=("link",),
    # Unverified that `organic` is always sent: absent counts as empty, not broken.
    missing_results_is_empty=True,
    error_code_paths=(("message",),),
    search_path="/search",
    max_results_field="num",
    key_slot=CredentialSlot("header", "X-API-KEY"),
    # Serper's /search (news is its /news endpoint).
    options=VendorOptions(
        {
            "time_range": OptionField("tbs", qdr, read_qdr),
            "country": OptionField("gl", lower, read_code),
            "language": OptionField("hl", read=read_code),
        },
        news_paths=("/news",),
    ),
    details=DetailFields(position=("position",), published=("date",)),
    answer=AnswerTemplate(
        envelope={"searchParameters": {"q": "$query"}}, extra={"position": "$position"}
    ),
    error_shape=_error_body,
)

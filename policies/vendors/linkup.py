"""Linkup (POST /v1/search, `q` in the body, `results[]` with `name` and `content`): its whole
record. An empty result is 400 SEARCH_QUERY_NO_RESULT; a 429's body code says whether it is
out of credits (terminal) or too many requests (transient)."""

from __future__ import annotations

from typing import Any

from policies.core.errors import (
    BadRequest,
    ClientFault,
    DeadlineExceeded,
    ProxyError,
    UpstreamTimeout,
    is_rate_limit,
)
from policies.core.options import (
    OptionField,
    VendorOptions,
    date_start,
    domain_field,
    read_start,
)
from policies.core.profile import (
    AnswerTemplate,
    CredentialSlot,
    DetailFields,
    QueryLocation,
    VendorProfile,
)


def _error_code(err: ProxyError) -> str:
    # linkup-sdk picks its exception class by status and this code.
    if is_rate_limit(err):
        return "TOO_MANY_REQUESTS"
    if isinstance(err, DeadlineExceeded | UpstreamTimeout):
        return "REQUEST_DEADLINE_EXCEEDED"
    if isinstance(err, BadRequest):
        return "INVALID_REQUEST"
    if isinstance(err, ClientFault):
        return err.type.upper()
    return "SERVICE_UNAVAILABLE"


def _error_body(err: ProxyError, request_id: str) -> dict[str, Any]:
    return {
        "statusCode": err.status,
        "error": {"code": _error_code(err), "message": err.message, "details": []},
    }


LINKUP = VendorProfile(
    name="linkup",
    query_locations=(QueryLocation("json", "q"),),
    results_paths=(("results",), ("sources",)),  # searchResults; sourcedAnswer
    title_fields=("name",),
    snippet_fields=("content", "snippet"),
    empty_status_codes={400: frozenset({"SEARCH_QUERY_NO_RESULT"})},
    # 429 is also TOO_MANY_REQUESTS, which is transient: only the body code decides.
    terminal_body_codes={429: frozenset({"INSUFFICIENT_FUNDS_CREDITS"})},
    error_code_paths=(("error", "code"),),
    search_path="/v1/search",
    max_results_field="maxResults",
    search_extra={"depth": "standard", "outputType": "searchResults"},
    key_slot=CredentialSlot("header", "Authorization", "Bearer "),
    # linkup-sdk 0.24.
    options=VendorOptions(
        {
            "time_range": OptionField("fromDate", date_start, read_start),
            "include_domains": domain_field("includeDomains"),
            "exclude_domains": domain_field("excludeDomains"),
        }
    ),
    details=DetailFields(),  # Linkup's results carry no score, date or rank
    # linkup-sdk's result model requires `type` and `favicon`.
    answer=AnswerTemplate(extra={"type": "text", "favicon": ""}),
    error_shape=_error_body,
)

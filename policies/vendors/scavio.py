"""Scavio (POST /api/v2/google, `query` in the body, Google-style `organic_results[]`): its
whole record. 402 is out of credits; X-RateLimit-* headers announce its per-minute window."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from policies.core.errors import ProxyError
from policies.core.options import OMIT, OptionField, VendorOptions, lower, read_code, table
from policies.core.profile import (
    AnswerTemplate,
    CredentialSlot,
    DetailFields,
    QueryLocation,
    VendorProfile,
)


def _safe(value: Any, now: datetime) -> Any:
    return "active" if value else OMIT  # SafeSearch is off unless `safe: active`


def _read_safe(value: Any, now: datetime) -> Any:
    return True if value == "active" else None


def _error_body(err: ProxyError, request_id: str) -> dict[str, Any]:
    return {"error": {"code": err.type, "message": err.message}}


SCAVIO = VendorProfile(
    name="scavio",
    query_locations=(QueryLocation("json", "query"),),
    results_paths=(("organic_results",),),
    url_fields=("link",),
    missing_results_is_empty=True,  # Google-style SERP: unverified it is always sent
    terminal_statuses=frozenset({402}),  # insufficient credits
    error_code_paths=(("error", "code"), ("error",)),
    ratelimit_headers=True,
    search_path="/api/v2/google",
    key_slot=CredentialSlot("header", "Authorization", "Bearer "),
    # scavio 0.28, endpoint google_search (/api/v2/google).
    options=VendorOptions(
        {
            "time_range": OptionField(
                "time_period",
                *table(
                    {
                        "day": "last_day|last_hour",
                        "week": "last_week",
                        "month": "last_month",
                        "year": "last_year",
                    }
                ),
            ),
            "country": OptionField("gl", lower, read_code),
            "language": OptionField("hl", read=read_code),
            "safe_search": OptionField("safe", _safe, _read_safe),
        }
    ),
    details=DetailFields(position=("position",), published=("date",)),
    answer=AnswerTemplate(envelope={"query": "$query"}, extra={"position": "$position"}),
    error_shape=_error_body,
)

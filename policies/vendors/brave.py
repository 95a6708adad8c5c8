"""Brave (GET /res/v1/web/search, `q`, `web.results[]` with `description`): its whole record. A
bad key is 422 SUBSCRIPTION_TOKEN_INVALID, and X-RateLimit-* headers announce its windows."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from policies.core.errors import ProxyError, is_rate_limit
from policies.core.options import OptionField, VendorOptions, read_code, read_start, table
from policies.core.profile import (
    AnswerTemplate,
    CredentialSlot,
    DetailFields,
    QueryLocation,
    VendorProfile,
)

# Fixed lists of regions and search languages (Brave's documentation); anything else is refused
# with a 422 that reads like a bad key, so it is dropped instead.
BRAVE_COUNTRIES = frozenset(
    "AR AU AT BE BR CA CL DK FI FR DE HK IN ID IT JP KR MY MX NL NZ NO CN PL PT PH RU SA ZA ES SE "
    "CH TW TR GB US".split()
)
_LANGUAGES = {
    **{c: c for c in "ar eu bn bg ca hr cs da nl en et fi fr gl de gu he hi hu is it kn ko lv "
       "lt ms ml mr nb pl pa ro ru sr sk sl es sv ta te th tr uk vi".split()},
    "ja": "jp", "zh": "zh-hans|zh-hant", "pt": "pt-br|pt-pt", "no": "nb",
}  # fmt: skip
_FRESHNESS = table({"day": "pd", "week": "pw", "month": "pm", "year": "py"})


def _country(value: Any, now: datetime) -> Any:
    return value if value in BRAVE_COUNTRIES else None


def _read_freshness(value: Any, now: datetime) -> Any:
    """pd/pw/pm/py, or a custom `YYYY-MM-DDtoYYYY-MM-DD` range read from its start."""
    if isinstance(value, str) and "to" in value:
        return read_start(value.split("to")[0], now)
    return _FRESHNESS[1](value, now)


def _read_safe(value: Any, now: datetime) -> Any:
    return {"strict": True, "off": False}.get(value) if isinstance(value, str) else None


def _error_body(err: ProxyError, request_id: str) -> dict[str, Any]:
    code = "RATE_LIMITED" if is_rate_limit(err) else err.type.upper()
    return {
        "type": "ErrorResponse",
        "error": {
            "id": request_id,
            "status": err.status,
            "code": code,
            "detail": err.message,
            "meta": {"component": "search-proxy"},
        },
    }


BRAVE = VendorProfile(
    name="brave",
    query_locations=(QueryLocation("query", "q"),),
    results_paths=(("web", "results"), ("results",)),  # web search; news/videos
    snippet_fields=("description",),
    missing_results_is_empty=True,  # `web` is left out when nothing was found
    # A bad key is 422 SUBSCRIPTION_TOKEN_INVALID; other 422s are the request's own.
    terminal_body_codes={422: frozenset({"SUBSCRIPTION_TOKEN_INVALID"})},
    error_code_paths=(("error", "code"),),
    ratelimit_headers=True,
    search_method="GET",
    search_path="/res/v1/web/search",
    max_results_field="count",
    max_results_cap=20,
    key_slot=CredentialSlot("header", "X-Subscription-Token"),
    # Web search; news is another endpoint, so topic news is dropped here.
    options=VendorOptions(
        {
            "time_range": OptionField("freshness", _FRESHNESS[0], _read_freshness),
            "country": OptionField("country", _country, read_code),
            "language": OptionField("search_lang", *table(_LANGUAGES)),
            "safe_search": OptionField(
                "safesearch", table({True: "strict", False: "off"})[0], _read_safe
            ),
        },
        news_paths=("/res/v1/news/search",),
    ),
    # page_age is ISO; age is often relative ("2 days ago"). Fetch metadata when asked for.
    details=DetailFields(published=("page_age", "age"), updated=("fetched_content_timestamp",)),
    answer=AnswerTemplate(
        envelope={"type": "search", "query": {"original": "$query"}, "web": {"type": "search"}},
        extra={"type": "search_result"},
    ),
    error_shape=_error_body,
)

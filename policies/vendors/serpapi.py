"""SerpAPI (GET /search.json, `q` and `engine`, `organic_results[]` with `link`): its whole
record. An empty result is HTTP 200 with a top-level `error`; the key is the `api_key` param."""

from __future__ import annotations

from typing import Any

from policies.core.errors import ProxyError
from policies.core.options import (
    OMIT,
    OptionField,
    VendorOptions,
    lower,
    qdr,
    read_code,
    read_qdr,
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
    return {"error": err.message}


SERPAPI = VendorProfile(
    name="serpapi",
    query_locations=(QueryLocation("query", "q"),),
    results_paths=tuple((k,) for k in ("organic_results", "news_results", "jobs_results")),
    url_fields=("link",),
    # Empty is HTTP 200 with a top-level "error"; other engines omit the list.
    missing_results_is_empty=True,
    empty_when_body_field="error",
    error_code_paths=(("error",),),
    search_method="GET",
    search_path="/search.json",
    max_results_field="num",
    search_extra={"engine": "google"},
    key_slot=CredentialSlot("query", "api_key"),
    options=VendorOptions(
        {
            "time_range": OptionField("tbs", qdr, read_qdr),
            "country": OptionField("gl", lower, read_code),
            "language": OptionField("hl", read=read_code),
            "safe_search": OptionField("safe", *table({True: "active", False: "off"})),
            "topic": OptionField("tbm", *table({"news": "nws"}, default=OMIT)),
        }
    ),
    details=DetailFields(position=("position",), published=("date",)),
    answer=AnswerTemplate(
        envelope={"search_metadata": {"status": "Success"}, "search_parameters": {"q": "$query"}},
        extra={"position": "$position"},
    ),
    error_shape=_error_body,
)

"""SearXNG (GET or form POST /search with `format=json`, `results[]` with `content`): its whole
record. A self-hosted metasearch engine: it takes no API key and has no JSON error shape."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from policies.core.options import (
    TIME_RANGES,
    OptionField,
    VendorOptions,
    read_code,
    table,
)
from policies.core.profile import AnswerTemplate, DetailFields, QueryLocation, VendorProfile


def _read_language(value: Any, now: datetime) -> Any:
    return None if value in ("all", "auto") else read_code(value, now)


def _read_categories(value: Any, now: datetime) -> Any:
    parts = {p.strip() for p in value.split(",")} if isinstance(value, str) else set()
    return next(iter(parts)) if len(parts) == 1 and parts <= {"general", "news"} else None


SEARXNG = VendorProfile(
    name="searxng",
    query_locations=(QueryLocation("query", "q"), QueryLocation("form", "q")),
    results_paths=(("results",),),
    snippet_fields=("content",),
    search_method="GET",
    search_path="/search",
    search_extra={"format": "json"},
    key_slot=None,  # no API key: an agent's own key has nowhere to go
    options=VendorOptions(
        {
            "time_range": OptionField("time_range", *table({r: r for r in TIME_RANGES})),
            "language": OptionField("language", read=_read_language),
            "safe_search": OptionField("safesearch", *table({True: "2", False: "0"})),
            "topic": OptionField(
                "categories",
                table({"general": "general", "news": "news"})[0],
                _read_categories,
            ),
        }
    ),
    details=DetailFields(score=("score",), published=("publishedDate", "pubdate")),
    answer=AnswerTemplate(
        envelope={
            "query": "$query",
            "number_of_results": "$count",
            "answers": [],
            "corrections": [],
            "infoboxes": [],
            "suggestions": [],
            "unresponsive_engines": [],
        },
    ),
    # SearXNG has no JSON error shape of its own for a client to read: the proxy's errors on
    # its routes keep the proxy's own `{"error": {...}}` body.
    error_shape=None,
)

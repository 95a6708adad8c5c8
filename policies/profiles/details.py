"""What a vendor says about each result besides title, URL and snippet: relevance score,
published and updated dates, rank, read by the detail fields of the vendor's record; dates
normalised."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from policies.core.profile import VendorProfile
from policies.profiles.reading import MAX_ITEMS_READ, find_results


@dataclass(frozen=True, slots=True)
class ResultDetails:
    """One result's details. Dates are ISO 8601 (`published_date` as precise as the vendor
    gave it, `date` its day); None when the vendor did not say."""

    position: int  # the vendor's rank, else the 1-based place in its result list
    score: float | None = None
    published_date: str | None = None
    date: str | None = None  # YYYY-MM-DD of published_date
    last_updated: str | None = None  # YYYY-MM-DD


_RELATIVE = re.compile(
    r"^(?:(an?|\d+)\s+)?(second|sec|minute|min|hour|hr|day|week|month|year)s?\s+ago$", re.I
)
_UNIT_DAYS = {"day": 1.0, "week": 7.0, "month": 30.0, "year": 365.0}
_FORMATS = ("%b %d, %Y", "%B %d, %Y", "%d %b %Y", "%d %B %Y", "%b %d %Y", "%B %d %Y")


def parse_date(value: Any, now: datetime) -> tuple[str, str] | None:
    """(published_date, date) from a vendor's date: ISO 8601, a Unix timestamp, "Jan 15, 2024",
    or relative ("3 days ago", "1 hour ago", counted back from `now`); None if unreadable."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = value / 1000 if value > 1e11 else value  # milliseconds
        try:
            when = datetime.fromtimestamp(seconds, UTC)
        except (OverflowError, OSError, ValueError):
            return None
        return when.isoformat(), when.date().isoformat()
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip()
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        pass
    else:
        day = parsed.date().isoformat()
        return (day if len(text) <= 10 else parsed.isoformat()), day
    for fmt in _FORMATS:
        try:
            day = datetime.strptime(text, fmt).date().isoformat()
        except ValueError:
            continue
        return day, day
    match = _RELATIVE.match(text)
    if match:
        count = 1 if match.group(1) in (None, "a", "an", "A", "An") else int(match.group(1))
        unit = match.group(2).lower()
        days = _UNIT_DAYS.get(unit, 0.0) * count
        if unit in ("hour", "hr"):
            days = count / 24
        elif unit in ("minute", "min", "second", "sec"):
            days = 0.0
        day = (now - timedelta(days=days)).date().isoformat()
        return day, day
    return None


def _first(item: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    return next((item[n] for n in names if item.get(n) not in (None, "")), None)


def _first_date(
    item: Mapping[str, Any], names: tuple[str, ...], now: datetime
) -> tuple[str, str] | None:
    return next((d for d in (parse_date(item.get(n), now) for n in names) if d), None)


def _url(item: Mapping[str, Any], fields: tuple[str, ...]) -> str:
    for name in fields:
        value = item.get(name)
        if isinstance(value, str) and value:
            return value
    return ""


def extract_details(
    profile: VendorProfile, body_json: Any, *, now: datetime
) -> dict[str, ResultDetails]:
    """Details of the vendor's results by URL, from the first MAX_ITEMS_READ items (the first
    item with a URL wins); items without a URL count for positions but are not listed. `now`
    anchors relative dates."""
    items = find_results(profile, body_json)
    if not isinstance(items, list):
        return {}
    fields = profile.details
    out: dict[str, ResultDetails] = {}
    for index, item in enumerate(items[:MAX_ITEMS_READ], start=1):
        if not isinstance(item, dict):
            continue
        url = _url(item, profile.url_fields)
        if not url or url in out:
            continue
        score = _first(item, fields.score)
        rank = _first(item, fields.position)
        published = _first_date(item, fields.published, now)
        updated = _first_date(item, fields.updated, now)
        out[url] = ResultDetails(
            position=rank if isinstance(rank, int) and not isinstance(rank, bool) else index,
            score=float(score)
            if isinstance(score, int | float) and not isinstance(score, bool)
            else None,
            published_date=published[0] if published else None,
            date=published[1] if published else None,
            last_updated=updated[1] if updated else None,
        )
    return out

"""The small JSON readers every profile function shares: parse a body without raising, follow a
dotted path, find a profile's result list."""

from __future__ import annotations

from typing import Any

import orjson

from policies.core.profile import VendorProfile

NOT_JSON: Any = object()
MISSING: Any = object()
NOT_A_LIST: Any = object()

# The items of a vendor's result list read at most (its results, their details). A search asks
# for 50 at most, and no vendor sends more than a few hundred; a list of hundreds of thousands
# (a broken or hostile vendor) would otherwise cost an object each and hold the event loop for
# seconds.
MAX_ITEMS_READ = 1000


# The last body parsed and what it parsed to. A request's body is read by several policies in
# a row (the guard, failover, search recovery, the hedge find its query), and an answer by the
# classifier and whoever reads its results: bytes are immutable, so the same object parses
# the same. Callers must not change what they get (replace_query copies first).
_last: tuple[bytes, Any] = (b"", NOT_JSON)


def forget() -> None:
    """Let the last parse go (a request ended): kept on, a vendor's answer of many small
    results, which parses to many times its own size, would stay in memory until the next
    body came, outside the memory budget."""
    global _last
    _last = (b"", NOT_JSON)


def load_json(body: bytes) -> Any:
    """`body` parsed as JSON, NOT_JSON when it is empty or is not JSON; never raises."""
    global _last
    if body is _last[0]:
        return _last[1]
    if not body or not body.strip():
        return NOT_JSON
    _last = (b"", NOT_JSON)  # the last parse goes first: two large ones are never held at once
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:  # also past its nesting limit, or not UTF-8
        data = NOT_JSON
    _last = (body, data)
    return data


def dig(data: Any, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return MISSING
        data = data[key]
    return data


def find_results(profile: VendorProfile, data: Any) -> Any:
    """The first result list present, MISSING if none is, NOT_A_LIST if one is not a list."""
    for path in profile.results_paths:
        value = dig(data, path)
        if value is MISSING:
            continue
        return value if isinstance(value, list) else NOT_A_LIST
    return MISSING

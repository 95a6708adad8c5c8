"""The small JSON readers every profile function shares: parse a body without raising, follow a
dotted path, find a profile's result list."""

from __future__ import annotations

import json
from typing import Any

from policies.core.profile import VendorProfile

NOT_JSON: Any = object()
MISSING: Any = object()
NOT_A_LIST: Any = object()


def load_json(body: bytes) -> Any:
    if not body or not body.strip():
        return NOT_JSON
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return NOT_JSON


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

"""Unified search options written into a vendor's search request (`apply_options`, naming what
it cannot honour) and read back out of one in its own shape (`read_options`), by the option
table of the vendor's record. Pure: relative time ranges count back from an injected `now`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

from policies.core.options import OMIT, OptionError, SearchOptions
from policies.core.profile import SearchRequest, VendorProfile


def _utc(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(UTC)
    return now if now.tzinfo is not None else now.replace(tzinfo=UTC)


def _param(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def apply_options(
    profile: VendorProfile,
    request: SearchRequest,
    options: SearchOptions,
    *,
    now: datetime | None = None,
) -> tuple[SearchRequest, tuple[str, ...]]:
    """`request` with every option the vendor can honour written into it, and the names of the
    options it cannot (in OPTION_NAMES order). max_results is left to the request builder.

    `now` is the time relative ranges count back from (default: the current time); GET requests
    carry options as query parameters, POST requests as top-level JSON body fields.
    """
    table = profile.options
    now = _utc(now)
    params = dict(request.query_params)
    body = dict(request.json_body) if request.json_body is not None else None
    dropped: list[str] = []
    for name in options.requested():
        value = getattr(options, name)
        spec = table.fields.get(name)
        if spec is None:
            if not (name == "topic" and value == "general"):
                dropped.append(name)
            continue
        wire = spec.write(value, now) if spec.when is None or spec.when(options) else None
        if wire is None:
            dropped.append(name)
        elif wire is not OMIT:
            if body is None:
                params[spec.field] = _param(wire)
            else:
                body[spec.field] = wire
    built = dataclasses.replace(request, query_params=params, json_body=body)
    return built, tuple(dropped)


def read_options(
    profile: VendorProfile,
    method: str,
    path: str,
    query_params: Mapping[str, str],
    body: bytes,
    *,
    now: datetime | None = None,
) -> SearchOptions:
    """The unified options an agent's request in this vendor's own shape asks for.

    The inverse of the vendor's table where it is well defined: values with no unified
    equivalent (Brave `safesearch=moderate`, a Tavily `finance` topic) and anything malformed
    are left unset; never raises. A body is read for methods other than GET, as a JSON object
    or else a form; its fields win over query parameters of the same name.
    """
    now = _utc(now)
    source: dict[str, Any] = dict(query_params)
    if method.upper() != "GET" and body:
        source.update(_body_fields(body))
    table = profile.options
    found: dict[str, Any] = {}
    if profile.max_results_field and profile.max_results_field in source:
        found["max_results"] = _read_count(source[profile.max_results_field])
    for name, spec in table.fields.items():
        if spec.field in source:
            found[name] = spec.read(source[spec.field], now)
    if any(path.endswith(suffix) for suffix in table.news_paths):
        found["topic"] = "news"
    valid: dict[str, Any] = {}
    for name, value in found.items():
        if value is None:
            continue
        try:
            SearchOptions(**{name: value})
        except OptionError:
            continue
        valid[name] = value
    return SearchOptions(**valid)


def _body_fields(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        try:
            return dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True))
        except (UnicodeDecodeError, ValueError):
            return {}
    return data if isinstance(data, dict) else {}


def _read_count(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None

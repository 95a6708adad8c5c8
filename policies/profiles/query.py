"""Finding a request's query, rewriting it in place, and building a normalised search request
(with unified options and, when the agent sends one, its own API key)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, unquote_plus

import orjson

from policies.core.flow import Request
from policies.core.options import SearchOptions
from policies.core.profile import (
    QueryLocation,
    QueryRef,
    SearchRequest,
    VendorProfile,
    first_location,
)
from policies.profiles.options import apply_options
from policies.profiles.reading import MISSING, dig, load_json


def _ref(location: QueryLocation, value: Any) -> QueryRef:
    if isinstance(value, str):
        return QueryRef(location, value)
    return QueryRef(location, "", is_text=False)


def _form_pairs(body: bytes) -> list[tuple[str, str]] | None:
    try:
        return parse_qsl(body.decode("utf-8"), keep_blank_values=True)
    except (UnicodeDecodeError, ValueError):
        return None


# The last request asked about, for which profile, and its answer. Several policies of one
# route ask in a row about the same request (the guard, failover, search recovery, the
# hedge): a Request never changes, so the same object has the same query.
_last: tuple[Request | None, VendorProfile | None, QueryRef | None] = (None, None, None)


def request_query(profile: VendorProfile, request: Request) -> QueryRef | None:
    """Where `request`'s query is, if it is a search call the profile recognises."""
    global _last
    last_request, last_profile, ref = _last
    if request is last_request and profile is last_profile:
        return ref
    text = request.query_string
    query = dict(parse_qsl(text, keep_blank_values=True)) if text else {}
    ref = extract_query(profile, path=request.path, query=query, body=request.body)
    _last = (request, profile, ref)
    return ref


def extract_query(
    profile: VendorProfile, *, path: str, query: Mapping[str, str], body: bytes
) -> QueryRef | None:
    """Find the request's query text; None when no location of the profile holds one.

    `path` is the upstream path as sent (percent-encoded), `query` the parsed query string.
    Junk bodies never raise: a location that cannot be read counts as absent, and a query
    that is present but not a string comes back with ``is_text=False``.
    """
    parsed: Any = MISSING
    form: list[tuple[str, str]] | None = None
    for loc in profile.query_locations:
        if loc.kind == "json":
            if parsed is MISSING:
                parsed = load_json(body)
            value = dig(parsed, loc.keys) if isinstance(parsed, dict) else MISSING
            if value is not MISSING:
                return _ref(loc, value)
        elif loc.kind == "query":
            if loc.field in query:
                return _ref(loc, query[loc.field])
        elif loc.kind == "form":
            if form is None:
                form = _form_pairs(body) or []
            for key, value in form:
                if key == loc.field:
                    return _ref(loc, value)
        else:
            rest = path[len(loc.field) :] if path.startswith(loc.field) else ""
            # A slash after the prefix means some other endpoint, not an encoded query.
            if rest and "/" not in rest:
                return QueryRef(loc, unquote(rest))
    return None


def set_param(encoded: str, key: str, value: str) -> str:
    """Set `key` in a urlencoded string, leaving every other pair byte for byte as it was."""
    pairs = encoded.split("&") if encoded else []
    new_pair = f"{quote(key, safe='')}={quote(value, safe='')}"
    out: list[str] = []
    replaced = False
    for pair in pairs:
        if unquote_plus(pair.split("=", 1)[0]) == key:
            out.append(new_pair)
            replaced = True
        else:
            out.append(pair)
    if not replaced:
        out.append(new_pair)
    return "&".join(out)


def replace_query(
    profile: VendorProfile,
    ref: QueryRef,
    new_query: str,
    *,
    path: str,
    query_string: str,
    body: bytes,
) -> tuple[str, str, bytes]:
    """Return (path, query_string, body) with the query at `ref` replaced and nothing else changed.

    JSON bodies keep their other fields and key order (re-serialised compactly, UTF-8 kept).
    Raises ValueError when `ref` is not one of the profile's locations or no longer fits.
    """
    loc = ref.location
    if loc not in profile.query_locations:
        raise ValueError(f"{loc.kind} {loc.field!r} is not a query location of {profile.name}")
    if loc.kind == "json":
        data = copy.deepcopy(load_json(body))  # load_json's answer is shared: never change it
        if not isinstance(data, dict):
            raise ValueError("the body is not a JSON object")
        target = data
        for key in loc.keys[:-1]:
            target = target.setdefault(key, {})
            if not isinstance(target, dict):
                raise ValueError(f"{loc.field}: {key!r} is not an object")
        target[loc.keys[-1]] = new_query
        new_body = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return path, query_string, new_body.encode("utf-8")
    if loc.kind == "query":
        return path, set_param(query_string, loc.field, new_query), body
    if loc.kind == "form":
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("the form body is not UTF-8") from None
        return path, query_string, set_param(text, loc.field, new_query).encode("utf-8")
    if not path.startswith(loc.field):
        raise ValueError(f"path {path!r} does not start with {loc.field!r}")
    return loc.field + quote(new_query, safe=""), query_string, body


def build_search_request(profile: VendorProfile, query: str, max_results: int) -> SearchRequest:
    """The request for a normalised search on this vendor, capped at its max_results limit."""
    if profile.search_path is None:
        raise ValueError(f"{profile.name}: the profile has no search_path")
    count = max(1, max_results)
    if profile.max_results_cap is not None:
        count = min(count, profile.max_results_cap)
    headers = dict(profile.search_headers)
    if profile.search_method == "GET":
        loc = first_location(profile, "query")
        assert loc is not None  # checked when the profile was built
        params = {loc.field: query}
        if profile.max_results_field:
            params[profile.max_results_field] = str(count)
        params.update({k: _param(v) for k, v in profile.search_extra.items()})
        return SearchRequest("GET", profile.search_path, params, None, headers)
    loc = first_location(profile, "json")
    assert loc is not None
    body: dict[str, Any] = {}
    target = body
    for key in loc.keys[:-1]:
        target = target.setdefault(key, {})
    target[loc.keys[-1]] = query
    if profile.max_results_field:
        body[profile.max_results_field] = count
    for key, value in profile.search_extra.items():
        body[key] = copy.deepcopy(value)
    return SearchRequest("POST", profile.search_path, {}, body, headers)


def _param(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# --- Unified options and the agent's own credentials ----------------------------------------


def build_search(
    profile: VendorProfile,
    query: str,
    options: SearchOptions | None = None,
    *,
    now: datetime | None = None,
) -> tuple[SearchRequest, tuple[str, ...]]:
    """The vendor's request for a search with unified options, and the names of the options
    this vendor cannot honour (dropped, never silently ignored).

    `options.max_results` None sends no result count (the vendor's default); `now` is the time
    relative ranges count back from (default: the current time). Pure otherwise.
    """
    options = options or SearchOptions()
    request = build_search_request(profile, query, options.max_results or 1)
    if options.max_results is None and profile.max_results_field:
        request.query_params.pop(profile.max_results_field, None)
        if request.json_body is not None:
            request.json_body.pop(profile.max_results_field, None)
    return apply_options(profile, request, options, now=now)


def with_credential(profile: VendorProfile, request: SearchRequest, key: str) -> SearchRequest:
    """`request` carrying `key` where this vendor reads it. Raises ValueError when the vendor
    takes no key, or the key is empty or spans lines."""
    slot = profile.key_slot
    if slot is None:
        raise ValueError(f"{profile.name} takes no API key")
    if not key.strip() or any(c in key for c in "\r\n\0"):
        raise ValueError("an API key must be one non-empty line")
    if slot.kind == "query":
        return dataclasses.replace(request, query_params={**request.query_params, slot.name: key})
    return dataclasses.replace(request, headers={**request.headers, slot.name: slot.prefix + key})


@functools.cache
def _quoted(fields: tuple[str, ...]) -> tuple[bytes, ...]:
    """Each field as a JSON object's key is written (a profile's few, built once)."""
    return tuple(b'"' + f.encode() + b'"' for f in fields)


def _object(body: bytes, fields: tuple[str, ...]) -> dict[str, Any] | None:
    """The JSON object `body` is, when it names one of `fields` (else None, unparsed)."""
    if not fields or not any(key in body for key in _quoted(fields)):
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def body_keys(body: bytes, fields: tuple[str, ...]) -> dict[str, str]:
    """The text values of `fields` at the top of JSON object `body`."""
    data = _object(body, fields)
    if data is None:
        return {}
    return {f: v for f in fields if isinstance(v := data.get(f), str) and v}


def with_body_key(body: bytes, fields: tuple[str, ...], key: str | None) -> bytes:
    """`body` with each of `fields` it has set to `key` (None: removed); as it was when it
    has none of them."""
    data = _object(body, fields)
    if data is None or not any(f in data for f in fields):
        return body
    for f in fields:
        if f in data:
            if key is None:
                del data[f]
            else:
                data[f] = key
    return orjson.dumps(data)

"""Custom vendor profiles (`profiles:` in the YAML): parsing one, and writing it back out as
YAML for the effective config. A profile that `extends` a built-in copies its whole record.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from policies.core.profile import QUERY_KINDS, ProfileError, QueryLocation, VendorProfile
from policies.core.settings import (
    Collector,
    ConfigError,
    boolean,
    choice,
    join,
    optional,
    status,
    statuses,
    text,
    texts,
    whole,
)
from policies.vendors import BUILTIN


def _dotted(value: Any, path: str, *, allow_body: bool) -> tuple[str, ...]:
    """`data.items` as keys; `""` (the body itself) only where `allow_body`."""
    keys = tuple(value.split(".")) if isinstance(value, str) and value else ()
    if not isinstance(value, str) or "" in keys or not (keys or allow_body):
        raise ConfigError(path, f"expected a dotted path, got {value!r}")
    return keys


def _dotted_list(value: Any, path: str, *, allow_body: bool) -> tuple[tuple[str, ...], ...]:
    if not isinstance(value, list):
        return (_dotted(value, path, allow_body=allow_body),)
    if not value:
        raise ConfigError(path, "expected a dotted path or a list of them, got []")
    return tuple(_dotted(v, f"{path}[{i}]", allow_body=allow_body) for i, v in enumerate(value))


def _field_names(value: Any, path: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (text(value, path),)
    if not isinstance(value, list) or not value:
        raise ConfigError(path, f"expected a field name or a list of them, got {value!r}")
    return texts(value, path)


def _codes_by_status(value: Any, path: str) -> dict[int, frozenset[str]]:
    if not isinstance(value, dict):
        raise ConfigError(
            path, f"expected a mapping of status code to a list of body codes, got {value!r}"
        )
    out: dict[int, frozenset[str]] = {}
    for raw_status, codes in value.items():
        where = join(path, str(raw_status))
        code = status(raw_status, where)
        out[code] = frozenset(texts([codes] if isinstance(codes, str) else codes, where))
    return out


def _query_locations(value: Any, path: str) -> tuple[QueryLocation, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(
            path, f"expected a list of {{json|query|form|path: field}} mappings, got {value!r}"
        )
    locations = []
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(item, dict) or len(item) != 1:
            raise ConfigError(
                where, f"expected one of json, query, form, path mapped to a field, got {item!r}"
            )
        ((kind, name),) = item.items()
        where = join(where, str(kind))
        if kind not in QUERY_KINDS:
            raise ConfigError(where, "unknown location kind (json, query, form, path)")
        name = text(name, where)
        try:
            locations.append(QueryLocation(kind, name))
        except ValueError as exc:  # the location's own rules, e.g. a path prefix ends in /
            raise ConfigError(where, str(exc)) from None
    return tuple(locations)


def _search_method(value: Any, path: str) -> str:
    if not isinstance(value, str) or value.upper() not in ("GET", "POST"):
        raise ConfigError(path, f"expected GET or POST, got {value!r}")
    return value.upper()


def _search_path(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(path, f"expected a path starting with '/', got {value!r}")
    return value


def _str_keyed(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(path, f"expected a mapping with string keys, got {value!r}")
    return dict(value)


def _str_values(value: Any, path: str) -> dict[str, str]:
    return {k: text(v, join(path, k)) for k, v in _str_keyed(value, path).items()}


# YAML key -> (VendorProfile field, parser), in the order they are checked.
_PROFILE_PARSERS: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    "query": ("query_locations", _query_locations),
    "results": ("results_paths", lambda v, p: _dotted_list(v, p, allow_body=True)),
    "url": ("url_fields", _field_names),
    "title": ("title_fields", _field_names),
    "snippet": ("snippet_fields", _field_names),
    "missing_results_is_empty": ("missing_results_is_empty", boolean),
    "non_json_ok": ("non_json_ok", boolean),
    "empty_when_body_field": ("empty_when_body_field", optional(text)),
    "empty_status_codes": ("empty_status_codes", _codes_by_status),
    "terminal_statuses": ("terminal_statuses", statuses),
    "terminal_body_codes": ("terminal_body_codes", _codes_by_status),
    "error_code_paths": ("error_code_paths", lambda v, p: _dotted_list(v, p, allow_body=False)),
    "ratelimit_headers": ("ratelimit_headers", boolean),
    "search_method": ("search_method", _search_method),
    "search_path": ("search_path", optional(_search_path)),
    "max_results_field": ("max_results_field", optional(text)),
    "max_results_cap": ("max_results_cap", optional(lambda v, p: whole(v, p, 1))),
    "search_extra": ("search_extra", _str_keyed),
    "search_headers": ("search_headers", _str_values),
}


def parse_profile(name: str, raw: Any, path: str) -> VendorProfile:
    """Build a custom vendor profile from its YAML mapping at `path`. Accepted keys:

    - ``extends``: a built-in vendor to start from: its whole record is copied (key slot,
      options, details, answer and error shapes too), and the other keys override it.
    - ``query``: list of one-key mappings ``{json|query|form|path: field}``, tried in order
      (json fields may be dotted; a path location's field is its prefix, e.g. ``/``).
    - ``results``: dotted path of the result list (``""`` = the body itself), or a list of
      alternatives tried in order.
    - ``url``, ``title``, ``snippet``: result field name, or a list of candidates
      (defaults ``url``, ``title``, ``snippet``).
    - ``missing_results_is_empty``: bool (default false): an absent list means EMPTY, not MALFORMED.
    - ``non_json_ok``: bool (default false): a 2xx non-JSON body counts as OK.
    - ``empty_when_body_field``: top-level field whose presence on a 2xx means EMPTY.
    - ``empty_status_codes``: ``{status: [body codes]}`` that mean EMPTY.
    - ``terminal_statuses``: list of statuses that are never worth retrying.
    - ``terminal_body_codes``: ``{status: [body codes]}`` that are never worth retrying.
    - ``error_code_paths``: dotted path, or list of them, where the body's error code lives.
    - ``ratelimit_headers``: bool: the vendor sends X-RateLimit-Remaining / X-RateLimit-Reset.
    - ``search_method`` (GET or POST, default POST), ``search_path``, ``max_results_field``,
      ``max_results_cap``, ``search_extra`` (fixed params or body fields), ``search_headers``:
      how to run a normalised search on this vendor.

    ``query`` and ``results`` are required unless ``extends`` is given.
    """
    parsers = {key: parse for key, (_, parse) in _PROFILE_PARSERS.items()}
    parsers["extends"] = lambda v, p: choice(v, p, tuple(sorted(BUILTIN)))
    collect = Collector()
    data = collect.parse(collect.keys(raw, path, tuple(parsers)), path, parsers)
    if isinstance(raw, dict) and "extends" not in raw:
        for key in ("query", "results"):
            if key not in raw:
                collect.add(join(path, key), "required key is missing (or use extends)")
    collect.raise_any()
    kwargs = {attr: data[key] for key, (attr, _) in _PROFILE_PARSERS.items() if key in data}
    base = BUILTIN[data["extends"]] if "extends" in data else None
    try:
        if base is not None:
            return replace(base, name=name, family=base.family or base.name, **kwargs)
        return VendorProfile(name=name, **kwargs)
    except ProfileError as exc:  # a rule across keys, e.g. a GET search needs a query location
        raise ConfigError(join(path, exc.key), exc.reason) from None


def _dotted_text(paths: tuple[tuple[str, ...], ...]) -> list[str]:
    return [".".join(keys) for keys in paths]


def _plain(value: Any) -> Any:
    """Frozen collections as plain YAML data, sets sorted."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, frozenset):
        return sorted(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


# VendorProfile field -> its YAML form, where _plain's is not what the profile parser takes.
_PROFILE_SHOWN: dict[str, Callable[[Any], Any]] = {
    "query_locations": lambda locations: [{loc.kind: loc.field} for loc in locations],
    "results_paths": _dotted_text,
    "error_code_paths": _dotted_text,
}


def profile_document(profile: VendorProfile) -> dict[str, Any]:
    """A custom profile as the YAML that parse_profile reads back into an equal profile: every
    key written out, and `extends` naming the built-in whose record it copied (the parts YAML
    has no keys for). Under `extends`, an unset value is written as null: it clears the
    built-in's."""
    doc: dict[str, Any] = {"extends": profile.family} if profile.family else {}
    for key, (attr, _) in _PROFILE_PARSERS.items():
        value = getattr(profile, attr)
        if (value is None and not profile.family) or (attr == "error_code_paths" and not value):
            continue  # the default, and a value the parser has no spelling for
        doc[key] = None if value is None else _PROFILE_SHOWN.get(attr, _plain)(value)
    return doc

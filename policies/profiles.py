"""Vendor profiles: where each search API keeps the query, the results and its error codes.

Plain data plus pure functions (no I/O), shared by the search-recovery policy and the tests.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import parse_qsl, quote, unquote, unquote_plus, urlsplit

QueryKind = Literal["json", "query", "form", "path"]
QUERY_KINDS: tuple[str, ...] = ("json", "query", "form", "path")

_NOT_JSON: Any = object()
_MISSING: Any = object()
_NOT_A_LIST: Any = object()
# Reset values this large are Unix timestamps, not "seconds from now".
_EPOCH_THRESHOLD = 1_000_000_000.0


@dataclass(frozen=True, slots=True)
class QueryLocation:
    """One place a request may carry its query text.

    - ``json``: a (dotted) key of a JSON-object body, e.g. ``query`` or ``params.q``.
    - ``query``: a query-string parameter.
    - ``form``: a field of an ``application/x-www-form-urlencoded`` body.
    - ``path``: the single path segment after the prefix ``field`` (e.g. ``/`` for Jina's
      ``GET /{query}``), percent-encoded.
    """

    kind: QueryKind
    field: str

    def __post_init__(self) -> None:
        if self.kind not in QUERY_KINDS:
            raise ValueError(f"unknown query location kind {self.kind!r}")
        if self.kind == "path":
            if not (self.field.startswith("/") and self.field.endswith("/")):
                raise ValueError(
                    f"a path location needs a prefix like '/' or '/search/', got {self.field!r}"
                )
        elif not self.field or (self.kind == "json" and "" in self.field.split(".")):
            raise ValueError(f"a {self.kind} location needs a field name, got {self.field!r}")

    @property
    def keys(self) -> tuple[str, ...]:
        """The dotted `field` split into keys (json locations)."""
        return tuple(self.field.split("."))


@dataclass(frozen=True, slots=True)
class QueryRef:
    """Where a request's query was found; `is_text` is False when the value is not a string."""

    location: QueryLocation
    text: str  # "" when is_text is False
    is_text: bool = True


class Verdict(Enum):
    """What a vendor's answer means for search recovery and retries."""

    OK = "ok"  # 2xx with at least one result
    EMPTY = "empty"  # the vendor found nothing (whatever status it uses to say so)
    MALFORMED = "malformed"  # 2xx that is not JSON, or lacks a result list the vendor always sends
    TERMINAL = "terminal"  # quota, credits or key problems: retrying cannot help, not an outage
    PASS = "pass"  # any other non-2xx: the generic retry rules decide


@dataclass(frozen=True, slots=True)
class Assessment:
    """A verdict and the vendor's error code found in the body (for messages and logs)."""

    verdict: Verdict
    error_code: str | None = None


@dataclass(frozen=True, slots=True)
class SearchResult:
    title: str
    url: str
    snippet: str


@dataclass(frozen=True, slots=True)
class RateLimitHint:
    """Requests left in the binding rate-limit window and seconds until it resets."""

    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class SearchRequest:
    """What to send a vendor for a normalised search; `json_body` is None for GET requests."""

    method: str
    path: str
    query_params: dict[str, str]
    json_body: dict[str, Any] | None
    headers: dict[str, str]


@dataclass(frozen=True)
class VendorProfile:
    """Everything the proxy knows about one search vendor's API; built once, shared by requests.

    Mapping fields are frozen into read-only mappings on construction, so a profile built from
    plain dicts (or YAML) cannot be changed afterwards.
    """

    name: str
    query_locations: tuple[QueryLocation, ...]  # tried in order; the first one present wins
    results_paths: tuple[tuple[str, ...], ...]  # alternatives, first present wins; () = the body
    url_fields: tuple[str, ...] = ("url",)  # candidates, first non-empty string wins
    title_fields: tuple[str, ...] = ("title",)
    snippet_fields: tuple[str, ...] = ("snippet",)
    missing_results_is_empty: bool = False  # absent result list: EMPTY instead of MALFORMED
    non_json_ok: bool = False  # a 2xx non-JSON body is a valid answer (Jina's text mode)
    empty_when_body_field: str | None = None  # top-level field that marks an empty 2xx answer
    empty_status_codes: Mapping[int, frozenset[str]] = dataclasses.field(default_factory=dict)
    terminal_statuses: frozenset[int] = frozenset()
    terminal_body_codes: Mapping[int, frozenset[str]] = dataclasses.field(default_factory=dict)
    error_code_paths: tuple[tuple[str, ...], ...] = ()
    ratelimit_headers: bool = False
    search_method: str = "POST"
    search_path: str | None = None
    max_results_field: str | None = None
    max_results_cap: int | None = None
    search_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    search_headers: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        freeze = object.__setattr__
        freeze(self, "query_locations", tuple(self.query_locations))
        freeze(self, "results_paths", tuple(tuple(p) for p in self.results_paths))
        freeze(self, "url_fields", tuple(self.url_fields))
        freeze(self, "title_fields", tuple(self.title_fields))
        freeze(self, "snippet_fields", tuple(self.snippet_fields))
        freeze(self, "empty_status_codes", _freeze_codes(self.empty_status_codes))
        freeze(self, "terminal_statuses", frozenset(self.terminal_statuses))
        freeze(self, "terminal_body_codes", _freeze_codes(self.terminal_body_codes))
        freeze(self, "error_code_paths", tuple(tuple(p) for p in self.error_code_paths))
        freeze(self, "search_extra", MappingProxyType(copy.deepcopy(dict(self.search_extra))))
        freeze(self, "search_headers", MappingProxyType(dict(self.search_headers)))
        # Messages name the profile_from_mapping keys, so config errors point at the YAML.
        if not self.results_paths:
            raise ValueError("results: at least one results path is needed")
        if self.search_method not in ("GET", "POST"):
            raise ValueError(f"search_method: expected GET or POST, got {self.search_method!r}")
        if self.search_path is not None:
            if not self.search_path.startswith("/"):
                raise ValueError(f"search_path: must start with '/', got {self.search_path!r}")
            kind = "query" if self.search_method == "GET" else "json"
            if _first_location(self, kind) is None:
                raise ValueError(f"query: a {self.search_method} search needs a {kind} location")
        if self.max_results_cap is not None and self.max_results_cap < 1:
            raise ValueError(f"max_results_cap: must be at least 1, got {self.max_results_cap}")

    def __hash__(self) -> int:
        # The generated hash would fail on the read-only mappings; equal profiles share a name.
        return hash(self.name)

    @property
    def results_path(self) -> tuple[str, ...]:
        """The primary results path."""
        return self.results_paths[0]


def _freeze_codes(codes: Mapping[int, Any]) -> Mapping[int, frozenset[str]]:
    return MappingProxyType({int(k): frozenset(v) for k, v in codes.items()})


def _first_location(profile: VendorProfile, kind: str) -> QueryLocation | None:
    return next((loc for loc in profile.query_locations if loc.kind == kind), None)


def _path(dotted: str) -> tuple[str, ...]:
    return tuple(dotted.split(".")) if dotted else ()


def _loc(kind: QueryKind, field: str) -> QueryLocation:
    return QueryLocation(kind, field)


BUILTIN_PROFILES: Mapping[str, VendorProfile] = MappingProxyType(
    {
        p.name: p
        for p in (
            VendorProfile(
                name="tavily",
                query_locations=(_loc("json", "query"),),
                results_paths=(("results",),),
                snippet_fields=("content",),
                terminal_statuses=frozenset({432, 433}),  # plan / pay-as-you-go limit
                error_code_paths=(_path("detail.error"),),
                search_path="/search",
                max_results_field="max_results",
                max_results_cap=20,
            ),
            VendorProfile(
                name="serper",
                # LangChain's wrapper POSTs with `q` in the query string and no body.
                query_locations=(_loc("json", "q"), _loc("query", "q")),
                # /search, /news, /images, /places ... each name their list differently.
                results_paths=tuple(
                    (k,) for k in ("organic", "news", "images", "places", "videos", "shopping")
                ),
                url_fields=("link",),
                # Unverified that `organic` is always sent: absent counts as empty, not broken.
                missing_results_is_empty=True,
                error_code_paths=(_path("message"),),
                search_path="/search",
                max_results_field="num",
            ),
            VendorProfile(
                name="brave",
                query_locations=(_loc("query", "q"),),
                results_paths=(("web", "results"), ("results",)),  # web search; news/videos
                snippet_fields=("description",),
                missing_results_is_empty=True,  # `web` is left out when nothing was found
                terminal_statuses=frozenset({422}),  # SUBSCRIPTION_TOKEN_INVALID
                error_code_paths=(_path("error.code"),),
                ratelimit_headers=True,
                search_method="GET",
                search_path="/res/v1/web/search",
                max_results_field="count",
                max_results_cap=20,
            ),
            VendorProfile(
                name="exa",
                query_locations=(_loc("json", "query"),),
                results_paths=(("results",),),
                snippet_fields=("text", "summary", "highlights"),
                terminal_statuses=frozenset({402}),  # NO_MORE_CREDITS
                error_code_paths=(_path("tag"), _path("error.code"), _path("error")),
                search_path="/search",
                max_results_field="numResults",
                # Without `contents` Exa returns no text to use as a snippet.
                search_extra={"contents": {"text": {"maxCharacters": 1000}}},
            ),
            VendorProfile(
                name="serpapi",
                query_locations=(_loc("query", "q"),),
                results_paths=tuple(
                    (k,) for k in ("organic_results", "news_results", "jobs_results")
                ),
                url_fields=("link",),
                # Empty is HTTP 200 with a top-level "error"; other engines omit the list.
                missing_results_is_empty=True,
                empty_when_body_field="error",
                error_code_paths=(_path("error"),),
                search_method="GET",
                search_path="/search.json",
                max_results_field="num",
                search_extra={"engine": "google"},
            ),
            VendorProfile(
                name="scavio",
                query_locations=(_loc("json", "query"),),
                results_paths=(("organic_results",),),
                url_fields=("link",),
                missing_results_is_empty=True,  # Google-style SERP: unverified it is always sent
                terminal_statuses=frozenset({402}),  # insufficient credits
                error_code_paths=(_path("error.code"), _path("error")),
                ratelimit_headers=True,
                search_path="/api/v2/google",
            ),
            VendorProfile(
                name="searxng",
                query_locations=(_loc("query", "q"), _loc("form", "q")),
                results_paths=(("results",),),
                snippet_fields=("content",),
                search_method="GET",
                search_path="/search",
                search_extra={"format": "json"},
            ),
            VendorProfile(
                name="linkup",
                query_locations=(_loc("json", "q"),),
                results_paths=(("results",), ("sources",)),  # searchResults; sourcedAnswer
                title_fields=("name",),
                snippet_fields=("content", "snippet"),
                empty_status_codes={400: frozenset({"SEARCH_QUERY_NO_RESULT"})},
                # 429 is also TOO_MANY_REQUESTS, which is transient: only the body code decides.
                terminal_body_codes={429: frozenset({"INSUFFICIENT_FUNDS_CREDITS"})},
                error_code_paths=(_path("error.code"),),
                search_path="/v1/search",
                max_results_field="maxResults",
                search_extra={"depth": "standard", "outputType": "searchResults"},
            ),
            VendorProfile(
                name="jina",
                query_locations=(_loc("query", "q"), _loc("json", "q"), _loc("path", "/")),
                results_paths=(("data",),),
                snippet_fields=("description", "content"),
                non_json_ok=True,  # without Accept: application/json Jina answers in text
                terminal_statuses=frozenset({402}),  # InsufficientBalanceError
                error_code_paths=(_path("name"), _path("code")),
                search_path="/",
                max_results_field="num",
                search_headers={"Accept": "application/json"},
            ),
            VendorProfile(
                name="firecrawl",
                query_locations=(_loc("json", "query"),),
                results_paths=(("data", "web"), ("data", "news"), ("data", "images")),
                snippet_fields=("description", "snippet", "markdown"),
                missing_results_is_empty=True,  # `sources` may leave out any one list
                terminal_statuses=frozenset({402}),  # payment required
                error_code_paths=(_path("error"),),
                search_path="/v2/search",
                max_results_field="limit",
            ),
        )
    }
)


# --- JSON helpers -------------------------------------------------------------------------


def _load_json(body: bytes) -> Any:
    if not body or not body.strip():
        return _NOT_JSON
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return _NOT_JSON


def _dig(data: Any, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return _MISSING
        data = data[key]
    return data


def _find_results(profile: VendorProfile, data: Any) -> Any:
    """The first result list present, _MISSING if none is, _NOT_A_LIST if one is not a list."""
    for path in profile.results_paths:
        value = _dig(data, path)
        if value is _MISSING:
            continue
        return value if isinstance(value, list) else _NOT_A_LIST
    return _MISSING


# --- query --------------------------------------------------------------------------------


def _ref(location: QueryLocation, value: Any) -> QueryRef:
    if isinstance(value, str):
        return QueryRef(location, value)
    return QueryRef(location, "", is_text=False)


def _form_pairs(body: bytes) -> list[tuple[str, str]] | None:
    try:
        return parse_qsl(body.decode("utf-8"), keep_blank_values=True)
    except (UnicodeDecodeError, ValueError):
        return None


def extract_query(
    profile: VendorProfile, *, path: str, query: Mapping[str, str], body: bytes
) -> QueryRef | None:
    """Find the request's query text; None when no location of the profile holds one.

    `path` is the upstream path as sent (percent-encoded), `query` the parsed query string.
    Junk bodies never raise: a location that cannot be read counts as absent, and a query
    that is present but not a string comes back with ``is_text=False``.
    """
    parsed: Any = _MISSING
    form: list[tuple[str, str]] | None = None
    for loc in profile.query_locations:
        if loc.kind == "json":
            if parsed is _MISSING:
                parsed = _load_json(body)
            value = _dig(parsed, loc.keys) if isinstance(parsed, dict) else _MISSING
            if value is not _MISSING:
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


def _replace_pairs(encoded: str, key: str, value: str) -> str:
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
        data = _load_json(body)
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
        return path, _replace_pairs(query_string, loc.field, new_query), body
    if loc.kind == "form":
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("the form body is not UTF-8") from None
        return path, query_string, _replace_pairs(text, loc.field, new_query).encode("utf-8")
    if not path.startswith(loc.field):
        raise ValueError(f"path {path!r} does not start with {loc.field!r}")
    return loc.field + quote(new_query, safe=""), query_string, body


# --- responses ----------------------------------------------------------------------------


def _error_code(profile: VendorProfile, data: Any) -> str | None:
    for path in profile.error_code_paths:
        value = _dig(data, path)
        if isinstance(value, str) and value:
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    return None


def assess(profile: VendorProfile, status: int, body: bytes) -> Assessment:
    """Classify a vendor answer and report the error code its body carries, if any.

    Order: terminal status or body code; empty status+code (e.g. Linkup 400); other non-2xx
    pass; a 2xx is MALFORMED when it is not JSON (unless `non_json_ok`) or its result list is
    missing (unless `missing_results_is_empty`) or not a list, EMPTY when the list is empty
    or `empty_when_body_field` is present, else OK.
    """
    data = _load_json(body)
    code = _error_code(profile, data) if data is not _NOT_JSON else None
    if status in profile.terminal_statuses or code in profile.terminal_body_codes.get(status, ()):
        return Assessment(Verdict.TERMINAL, code)
    if code in profile.empty_status_codes.get(status, ()):
        return Assessment(Verdict.EMPTY, code)
    if not 200 <= status < 300:
        return Assessment(Verdict.PASS, code)
    if data is _NOT_JSON:
        return Assessment(Verdict.OK if profile.non_json_ok else Verdict.MALFORMED)
    if not isinstance(data, dict) and all(profile.results_paths):
        return Assessment(Verdict.MALFORMED)
    results = _find_results(profile, data)
    if results is _NOT_A_LIST:
        return Assessment(Verdict.MALFORMED, code)
    if results is not _MISSING and results:
        return Assessment(Verdict.OK, code)
    field = profile.empty_when_body_field
    if results is not _MISSING or profile.missing_results_is_empty:
        return Assessment(Verdict.EMPTY, code)
    if field is not None and isinstance(data, dict) and field in data:
        return Assessment(Verdict.EMPTY, code)
    return Assessment(Verdict.MALFORMED, code)


def classify(profile: VendorProfile, status: int, body: bytes) -> Verdict:
    """The verdict alone; see `assess` for the rules and the error code."""
    return assess(profile, status, body).verdict


def _first_text(item: Mapping[str, Any], fields: tuple[str, ...]) -> str:
    for name in fields:
        value = item.get(name)
        if isinstance(value, str) and value:
            return value
        # Exa's highlights are a list of sentences.
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return " ".join(value)
    return ""


def extract_results(profile: VendorProfile, body_json: Any) -> list[SearchResult]:
    """The vendor's results; items that are not objects or have no URL are skipped."""
    results = _find_results(profile, body_json)
    if not isinstance(results, list):
        return []
    out: list[SearchResult] = []
    for item in results:
        if not isinstance(item, dict):
            continue
        url = _first_text(item, profile.url_fields)
        if url:
            title = _first_text(item, profile.title_fields)
            out.append(SearchResult(title, url, _first_text(item, profile.snippet_fields)))
    return out


def _url_key(url: str) -> str:
    """Identity of a URL for deduplication: no scheme or fragment, host lower-cased, no final /."""
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return url.strip()
    key = parts.netloc.lower() + parts.path.rstrip("/")
    return f"{key}?{parts.query}" if parts.query else key


def _norm_domain(domain: str) -> str:
    domain = domain.strip().lower().rstrip(".")
    if domain.startswith("*."):
        domain = domain[2:]
    return domain.lstrip(".")


def normalize_results(
    results: list[SearchResult],
    *,
    max_results: int,
    blocked_domains: tuple[str, ...] | list[str] = (),
    blocked_extensions: tuple[str, ...] | list[str] = (),
) -> list[SearchResult]:
    """Dedupe by URL, drop blocked domains (with subdomains) and file types, keep order, cut."""
    domains = tuple(d for d in (_norm_domain(d) for d in blocked_domains) if d)
    extensions = tuple(
        e if e.startswith(".") else "." + e
        for e in (e.strip().lower() for e in blocked_extensions)
        if e
    )
    seen: set[str] = set()
    out: list[SearchResult] = []
    for result in results:
        if len(out) >= max_results:
            break
        key = _url_key(result.url)
        if key in seen:
            continue
        try:
            parts = urlsplit(result.url.strip())
            host = (parts.hostname or "").rstrip(".")
        except ValueError:
            parts, host = None, ""
        if any(host == d or host.endswith("." + d) for d in domains):
            continue
        if parts is not None and unquote(parts.path).lower().endswith(extensions):
            continue
        seen.add(key)
        out.append(result)
    return out


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        # Plain dicts are case-sensitive; CIMultiDict answers above already.
        value = next((v for k, v in headers.items() if k.lower() == name.lower()), None)
    return value


def ratelimit_hint(
    profile: VendorProfile, headers: Mapping[str, str], *, now: float | None = None
) -> RateLimitHint | None:
    """Read X-RateLimit-Remaining/-Reset; None when the vendor sends none or they do not parse.

    Brave sends comma-separated windows (per second, per month). The binding window is the
    exhausted one with the longest reset if any is exhausted, else the one with the fewest
    requests left (the first on ties, i.e. the per-second window). A reset that looks like a
    Unix timestamp is converted with `now` (wall-clock seconds), or ignored without it.
    """
    if not profile.ratelimit_headers:
        return None
    remaining_raw = _header(headers, "X-RateLimit-Remaining")
    reset_raw = _header(headers, "X-RateLimit-Reset")
    if remaining_raw is None or reset_raw is None:
        return None
    try:
        remaining = [int(v.strip()) for v in remaining_raw.split(",")]
        resets = [float(v.strip()) for v in reset_raw.split(",")]
    except ValueError:
        return None
    windows: list[tuple[int, float]] = []
    for left, reset in zip(remaining, resets, strict=False):
        if not math.isfinite(reset) or reset < 0 or left < 0:
            return None
        if reset >= _EPOCH_THRESHOLD:
            if now is None:
                return None
            reset = max(0.0, reset - now)
        windows.append((left, reset))
    if not windows:
        return None
    exhausted = [w for w in windows if w[0] == 0]
    left, reset = (
        max(exhausted, key=lambda w: w[1]) if exhausted else min(windows, key=lambda w: w[0])
    )
    return RateLimitHint(left, reset)


def build_search_request(profile: VendorProfile, query: str, max_results: int) -> SearchRequest:
    """The request for a normalised search on this vendor, capped at its max_results limit."""
    if profile.search_path is None:
        raise ValueError(f"{profile.name}: the profile has no search_path")
    count = max(1, max_results)
    if profile.max_results_cap is not None:
        count = min(count, profile.max_results_cap)
    headers = dict(profile.search_headers)
    if profile.search_method == "GET":
        loc = _first_location(profile, "query")
        assert loc is not None  # checked when the profile was built
        params = {loc.field: query}
        if profile.max_results_field:
            params[profile.max_results_field] = str(count)
        params.update({k: _param(v) for k, v in profile.search_extra.items()})
        return SearchRequest("GET", profile.search_path, params, None, headers)
    loc = _first_location(profile, "json")
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


# --- custom profiles ------------------------------------------------------------------------

_MAPPING_KEYS = (
    "extends",
    "query",
    "results",
    "url",
    "title",
    "snippet",
    "missing_results_is_empty",
    "non_json_ok",
    "empty_when_body_field",
    "empty_status_codes",
    "terminal_statuses",
    "terminal_body_codes",
    "error_code_paths",
    "ratelimit_headers",
    "search_method",
    "search_path",
    "max_results_field",
    "max_results_cap",
    "search_extra",
    "search_headers",
)


def _want_str(value: Any, key: str, what: str = "a string") -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key}: expected {what}")
    return value


def _want_bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false")
    return value


def _want_list(value: Any, key: str, what: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{key}: expected {what}")
    return list(value)


def _dotted(value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, str) or (value and "" in value.split(".")):
        raise ValueError(f"{key}: expected a dotted path string")
    return _path(value)


def _dotted_list(value: Any, key: str, *, allow_body: bool) -> tuple[tuple[str, ...], ...]:
    items = value if isinstance(value, list | tuple) else [value]
    paths = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]" if isinstance(value, list | tuple) else key
        path = _dotted(item, where)
        if not path and not allow_body:
            raise ValueError(f"{where}: expected a dotted path string")
        paths.append(path)
    if not paths:
        raise ValueError(f"{key}: expected a dotted path string or a list of them")
    return tuple(paths)


def _names(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (_want_str(value, key, "a field name"),)
    items = _want_list(value, key, "a field name or a list of them")
    if not items:
        raise ValueError(f"{key}: expected a field name or a list of them")
    return tuple(_want_str(v, f"{key}[{i}]", "a field name") for i, v in enumerate(items))


def _status(value: Any, key: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 100 <= value <= 599:
        raise ValueError(f"{key}: expected an HTTP status code (100-599)")
    return value


def _codes_by_status(value: Any, key: str) -> dict[int, frozenset[str]]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}: expected a mapping of status code to a list of body codes")
    out: dict[int, frozenset[str]] = {}
    for raw_status, codes in value.items():
        where = f"{key}.{raw_status}"
        status = _status(raw_status, where)
        if isinstance(codes, str):
            codes = [codes]
        items = _want_list(codes, where, "a list of body codes")
        out[status] = frozenset(
            _want_str(c, f"{where}[{i}]", "a body code string") for i, c in enumerate(items)
        )
    return out


def _query_locations(value: Any, key: str) -> tuple[QueryLocation, ...]:
    what = "a list of {json|query|form|path: field} mappings"
    items = _want_list(value, key, what)
    if not items:
        raise ValueError(f"{key}: expected {what}")
    locations = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(item, Mapping) or len(item) != 1:
            raise ValueError(f"{where}: expected one of json, query, form, path mapped to a field")
        ((kind, field),) = item.items()
        if kind not in QUERY_KINDS:
            raise ValueError(f"{where}.{kind}: unknown location kind (json, query, form, path)")
        try:
            locations.append(QueryLocation(kind, _want_str(field, f"{where}.{kind}")))
        except ValueError as exc:
            if str(exc).startswith(f"{where}."):
                raise
            raise ValueError(f"{where}.{kind}: {exc}") from None
    return tuple(locations)


def _plain_mapping(value: Any, key: str, *, str_values: bool) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{key}: expected a mapping with string keys")
    if str_values:
        for k, v in value.items():
            _want_str(v, f"{key}.{k}")
    return dict(value)


def profile_from_mapping(name: str, mapping: Mapping[str, Any]) -> VendorProfile:
    """Build a custom vendor profile from a plain (YAML-shaped) mapping.

    Errors are ValueErrors whose message starts with the offending key's path, e.g.
    ``results: expected a dotted path string``. Accepted keys:

    - ``extends``: a built-in profile name to start from; the other keys override it.
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
    if not isinstance(mapping, Mapping):
        raise ValueError("expected a mapping of profile keys")
    for key in mapping:
        if key not in _MAPPING_KEYS:
            raise ValueError(f"{key}: unknown key (accepted: {', '.join(_MAPPING_KEYS)})")
    fields: dict[str, Any] = {}
    m = mapping
    if "query" in m:
        fields["query_locations"] = _query_locations(m["query"], "query")
    if "results" in m:
        fields["results_paths"] = _dotted_list(m["results"], "results", allow_body=True)
    for key, attr in (
        ("url", "url_fields"),
        ("title", "title_fields"),
        ("snippet", "snippet_fields"),
    ):
        if key in m:
            fields[attr] = _names(m[key], key)
    for key in ("missing_results_is_empty", "non_json_ok", "ratelimit_headers"):
        if key in m:
            fields[key] = _want_bool(m[key], key)
    if "empty_when_body_field" in m:
        value = m["empty_when_body_field"]
        fields["empty_when_body_field"] = (
            None if value is None else _want_str(value, "empty_when_body_field", "a field name")
        )
    for key in ("empty_status_codes", "terminal_body_codes"):
        if key in m:
            fields[key] = _codes_by_status(m[key], key)
    if "terminal_statuses" in m:
        items = _want_list(m["terminal_statuses"], "terminal_statuses", "a list of status codes")
        fields["terminal_statuses"] = frozenset(
            _status(s, f"terminal_statuses[{i}]") for i, s in enumerate(items)
        )
    if "error_code_paths" in m:
        fields["error_code_paths"] = _dotted_list(
            m["error_code_paths"], "error_code_paths", allow_body=False
        )
    if "search_method" in m:
        method = m["search_method"]
        if not isinstance(method, str) or method.upper() not in ("GET", "POST"):
            raise ValueError("search_method: expected GET or POST")
        fields["search_method"] = method.upper()
    if "search_path" in m:
        value = m["search_path"]
        if value is not None and (not isinstance(value, str) or not value.startswith("/")):
            raise ValueError("search_path: expected a path starting with '/'")
        fields["search_path"] = value
    if "max_results_field" in m:
        value = m["max_results_field"]
        fields["max_results_field"] = (
            None if value is None else _want_str(value, "max_results_field", "a field name")
        )
    if "max_results_cap" in m:
        value = m["max_results_cap"]
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError("max_results_cap: expected a positive integer")
        fields["max_results_cap"] = value
    if "search_extra" in m:
        fields["search_extra"] = _plain_mapping(m["search_extra"], "search_extra", str_values=False)
    if "search_headers" in m:
        fields["search_headers"] = _plain_mapping(
            m["search_headers"], "search_headers", str_values=True
        )

    if "extends" in m:
        base_name = m["extends"]
        if not isinstance(base_name, str) or base_name not in BUILTIN_PROFILES:
            raise ValueError(
                f"extends: expected a built-in profile name ({', '.join(sorted(BUILTIN_PROFILES))})"
            )
        return dataclasses.replace(BUILTIN_PROFILES[base_name], name=name, **fields)
    for required in ("query", "results"):
        if required not in m:
            raise ValueError(f"{required}: required (or use extends)")
    return VendorProfile(name=name, **fields)

"""The vendor-profile data model: everything the proxy knows about one search API (where it keeps
its query and results, what an answer means, its key, options, details, answer and error shapes).
Plain frozen data; the records are in policies/vendors/, the functions reading them in profiles/.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, Literal

from policies.core.errors import ProxyError
from policies.core.extract import ExtractApi
from policies.core.options import NO_OPTIONS, VendorOptions

QueryKind = Literal["json", "query", "form", "path"]
QUERY_KINDS: tuple[str, ...] = ("json", "query", "form", "path")


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


@dataclass(frozen=True, slots=True)
class CredentialSlot:
    """Where a vendor takes its API key: a header (with a scheme prefix) or a query parameter."""

    kind: Literal["header", "query"]
    name: str
    prefix: str = ""


@dataclass(frozen=True, slots=True)
class DetailFields:
    """Where one vendor's result items keep their details; candidates tried in order."""

    score: tuple[str, ...] = ()
    published: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    position: tuple[str, ...] = ()


@dataclass(frozen=True)
class AnswerTemplate:
    """A vendor's answer around its results, so its SDK parses results another vendor found: the
    fixed `envelope` (`$query`, `$count` filled per answer) and each result's `extra` fields
    (`$url`, `$title`, `$snippet`, `$position` filled per result). The result list and its
    url, title and snippet fields go where the profile reads them."""

    envelope: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("envelope", "extra"):
            value = copy.deepcopy(dict(getattr(self, name)))
            object.__setattr__(self, name, MappingProxyType(value))


@dataclass(frozen=True)
class McpPreset:
    """A vendor's remote MCP server, which a route's `mcp: {server: <vendor>}` starts from: the
    tools safe to cache and retry per call, and each search tool's query argument."""

    idempotent_tools: tuple[str, ...] = ()
    search_tools: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "idempotent_tools", tuple(self.idempotent_tools))
        object.__setattr__(self, "search_tools", MappingProxyType(dict(self.search_tools)))


@dataclass(frozen=True, slots=True)
class HealthCall:
    """A call of the vendor's that costs no credits and answers `expect` while its API is up
    (Tavily's usage endpoint): what a route's breaker probes with unless told otherwise."""

    method: str
    path: str  # under the route's upstream, with an optional ?query
    expect: frozenset[int] = frozenset({200})


# (a proxy error, the request id) -> the body a vendor's SDK reads its own errors from
ErrorShape = Callable[[ProxyError, str], dict[str, Any]]


class ProfileError(ValueError):
    """An inconsistent VendorProfile; `key` is the custom-profile config key at fault."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


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
    # What a custom profile cannot write in YAML: it has them by `extends`, which copies the
    # built-in's record whole; a profile written from scratch has none of them.
    key_slot: CredentialSlot | None = None  # where an agent's own key goes; None: no key taken
    # Top-level JSON body fields the vendor also reads a key from (Tavily's `api_key`, which
    # tavily-mcp and older wrappers send beside the header): a client token there is removed,
    # and a route injecting its own key puts it there too, so the vendor sees one key.
    key_fields: tuple[str, ...] = ()
    options: VendorOptions = NO_OPTIONS  # unified option -> request field; unlisted: dropped
    details: DetailFields = DetailFields()  # score, dates and rank of each result
    answer: AnswerTemplate = dataclasses.field(default_factory=AnswerTemplate)
    error_shape: ErrorShape | None = None  # None: the proxy's own `{"error": {...}}`
    mcp: McpPreset | None = None  # the vendor's remote MCP server, where it has one
    extract: ExtractApi | None = None  # its API reading pages by URL (/v1/fetch), where it has one
    health: HealthCall | None = None  # a free call for the breaker's active probe, if any
    # The built-in this profile `extends` ("" for a built-in, or a profile from scratch), so the
    # effective config shows it; nothing decides by it.
    family: str = dataclasses.field(default="", compare=False)

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
        # Errors name the custom-profile config keys, so config errors point at the YAML.
        if not self.results_paths:
            raise ProfileError("results", "at least one results path is needed")
        if self.search_method not in ("GET", "POST"):
            raise ProfileError("search_method", f"expected GET or POST, got {self.search_method!r}")
        if self.search_path is not None:
            if not self.search_path.startswith("/"):
                raise ProfileError("search_path", f"must start with '/', got {self.search_path!r}")
            kind = "query" if self.search_method == "GET" else "json"
            if first_location(self, kind) is None:
                raise ProfileError(
                    "query", f"a {self.search_method} search needs a {kind} location"
                )
        if self.max_results_cap is not None and self.max_results_cap < 1:
            raise ProfileError("max_results_cap", f"must be at least 1, got {self.max_results_cap}")

    def __hash__(self) -> int:
        # The generated hash would fail on the read-only mappings; equal profiles share a name.
        return hash(self.name)

    @property
    def results_path(self) -> tuple[str, ...]:
        """The primary results path."""
        return self.results_paths[0]


def _freeze_codes(codes: Mapping[int, Any]) -> Mapping[int, frozenset[str]]:
    return MappingProxyType({int(k): frozenset(v) for k, v in codes.items()})


def first_location(profile: VendorProfile, kind: str) -> QueryLocation | None:
    return next((loc for loc in profile.query_locations if loc.kind == kind), None)

"""The vocabulary of a vendor's extract API (reading pages by URL), for its record in
policies/vendors/: the request to send for some URLs, and what its answer says of each URL."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

PageFormat = Literal["markdown", "text"]
PAGE_FORMATS: tuple[PageFormat, ...] = ("markdown", "text")


@dataclass(frozen=True, slots=True)
class ExtractRequest:
    """What to send a vendor for some URLs: method, path on its origin, query, JSON body and
    headers besides the route's own (its key)."""

    method: str
    path: str
    json_body: Mapping[str, Any] | None = None
    query_params: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PageRead:
    """One page as the vendor read it. `url` is the URL asked for (the vendor's own spelling
    of it when it differs, matched back by the engine); `format` is what `content` is in."""

    url: str
    title: str
    content: str
    format: PageFormat


@dataclass(frozen=True, slots=True)
class PageMiss:
    """A URL the vendor says it could not read, in its words; `status` is the page's own HTTP
    status when the vendor tells it."""

    url: str
    reason: str
    status: int | None = None


@dataclass(frozen=True, slots=True)
class ExtractAnswer:
    """What one answer says: the pages read and the URLs missed. A URL asked for that is in
    neither was left out of the answer (the engine counts it missed)."""

    pages: tuple[PageRead, ...] = ()
    misses: tuple[PageMiss, ...] = ()


# (URLs, format asked, the most characters wanted per page) -> the request for them
BuildExtract = Callable[[tuple[str, ...], PageFormat, int], ExtractRequest]
# (the answer's JSON, the URLs asked, the format asked) -> what it says of each
ReadExtract = Callable[[Any, tuple[str, ...], PageFormat], ExtractAnswer]


@dataclass(frozen=True)
class ExtractApi:
    """A vendor's extract API: how many URLs one call takes, the request for them and the
    reading of its answer. `origin` is set when the API lives on another host than the
    vendor's search (Jina's reader at r.jina.ai): only a route pointed there can call it."""

    batch: int
    build: BuildExtract
    read: ReadExtract
    origin: str | None = None

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"an extract API takes at least one URL a call, got {self.batch}")


def text_of(value: Any) -> str:
    """A vendor's string field, or "" when it is missing or not a string."""
    return value if isinstance(value, str) else ""


def status_of(value: Any) -> int | None:
    """A vendor's HTTP status field, or None when it is missing or not a whole number."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def object_of(value: Any) -> dict[str, Any]:
    """A vendor's JSON object field, or {} when it is missing or not an object."""
    return value if isinstance(value, dict) else {}

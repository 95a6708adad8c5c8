"""What /v1/fetch deals in: a page as it is answered, why one provider did not give one, and the
URLs it accepts (http and https, no credentials) in the canonical form the page cache keys on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from yarl import URL

from policies.core.extract import PAGE_FORMATS, PageFormat
from policies.fetch.addresses import DEFAULT_PORTS

__all__ = [
    "MAX_URL_CHARS",
    "PAGE_FORMATS",
    "Miss",
    "Page",
    "PageFormat",
    "canonical_url",
    "check_url",
]

MAX_URL_CHARS = 2048


@dataclass(frozen=True, slots=True)
class Page:
    """One page as the agent gets it: `url` as it asked, `content` in `format` (what the
    provider gave, which may be markdown when text was asked), `fetched_at` in wall seconds.
    `cut`: the content was longer than the proxy keeps (fetch_api.max_page_chars)."""

    url: str
    title: str
    content: str
    format: PageFormat
    provider: str
    fetched_at: float
    cut: bool = False
    from_cache: bool = False
    stale: bool = False  # served from the cache past its ttl because every provider failed


# failed: this provider could not read this page (a 404, a page it cannot render);
# unavailable: the provider itself failed or was not asked (down, circuit open, no key, out of
# credits, the request's vendor calls spent); refused: the direct fetcher would not go there.
MissKind = Literal["failed", "unavailable", "refused"]


@dataclass(frozen=True, slots=True)
class Miss:
    """Why one provider did not give one page, in a few words."""

    provider: str
    kind: MissKind
    reason: str
    retry_after_s: float | None = None
    terminal: bool = False  # a bad key or no credits: retrying this provider cannot help


def check_url(value: object) -> str | None:
    """Why `value` is not a URL /v1/fetch reads (None: it is): an absolute http(s) URL with a
    host, without credentials, spaces or control characters, at most MAX_URL_CHARS long."""
    if not isinstance(value, str):
        return "must be a URL, as text"
    if not value or len(value) > MAX_URL_CHARS:
        return f"must be a URL of 1 to {MAX_URL_CHARS} characters"
    if any(c <= " " or c == "\x7f" for c in value):
        return "must not contain spaces or control characters (percent-encode them)"
    try:
        url = URL(value)
        url.port  # noqa: B018  # a port out of range raises only when read
    except ValueError as exc:
        return f"is not a usable URL ({exc})"
    if url.scheme not in DEFAULT_PORTS or not url.raw_host:
        return 'must be an absolute http or https URL, like "https://example.com/page"'
    if url.raw_user is not None or url.raw_password is not None:
        return "must not carry credentials (user:password@): the proxy never sends any"
    return None


def canonical_url(url: str) -> str:
    """The form two spellings of one page share (the page cache's key): lower-case scheme and
    host (IDNA), no default port, no fragment, `/` for an empty path; path and query as sent
    (their order and case can matter to the site)."""
    parsed = URL(url)
    host = parsed.raw_host or ""
    if ":" in host:
        host = f"[{host}]"
    port = parsed.explicit_port
    if port is not None and port != DEFAULT_PORTS.get(parsed.scheme):
        host += f":{port}"
    query = f"?{parsed.raw_query_string}" if parsed.raw_query_string else ""
    return f"{parsed.scheme}://{host.lower()}{parsed.raw_path or '/'}{query}"

"""Reading results out of a vendor's answer and normalising them: dedupe by URL, block
domains and file types, cut to the requested count."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from policies.core.profile import SearchResult, VendorProfile
from policies.profiles.reading import MAX_ITEMS_READ, find_results


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
    """The vendor's results, from the first MAX_ITEMS_READ items of its list; items that are
    not objects or have no URL are skipped."""
    results = find_results(profile, body_json)
    if not isinstance(results, list):
        return []
    out: list[SearchResult] = []
    for item in results[:MAX_ITEMS_READ]:
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

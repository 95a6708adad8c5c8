"""Merging several providers' result lists into one (`/v1/search` `mode: merge`): the same page
found twice is one result (by canonical URL), and the list is ranked by reciprocal rank fusion
(Cormack, Clarke & Büttcher 2009), which needs no comparable scores across vendors. Pure
functions: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

T = TypeVar("T")

# RRF's constant: the weight of rank r is 1 / (K + r). 60 is the paper's, and everyone's.
K = 60
# Parameters that say who sent a visitor, never which page it is.
TRACKING = frozenset(
    {
        "fbclid",
        "gclid",
        "dclid",
        "gbraid",
        "wbraid",
        "msclkid",
        "yclid",
        "twclid",
        "igshid",
        "mc_cid",
        "mc_eid",
        "_ga",
        "_gl",
        "_hsenc",
        "_hsmi",
        "mkt_tok",
        "ref_src",
        "ref_url",
    }
)
_DEFAULT_PORTS = {"http": 80, "https": 443}


def canonical_url(url: str) -> str:
    """The page a URL names, whatever its spelling: scheme and host in lower case, no `www.`,
    no default port, no trailing slash, no fragment, no `utm_*` or other tracking parameters,
    the remaining parameters in order. A URL that does not parse is its own key."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return url.strip()
    host = (parts.hostname or "").rstrip(".")
    if host.startswith("www."):
        host = host[4:]
    scheme = parts.scheme.lower()
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        host = f"{host}:{port}"
    params = [
        (name, value)
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
        if not name.lower().startswith("utm_") and name.lower() not in TRACKING
    ]
    query = urlencode(sorted(params))
    return urlunsplit((scheme, host, parts.path.rstrip("/"), query, ""))


@dataclass(frozen=True, slots=True)
class Fused:
    """One page of the merged list: the best-ranked copy of it, every provider that found it
    (in the order the providers were given), and its fused score."""

    item: Any
    providers: tuple[str, ...]
    score: float


def fuse(ranked: Mapping[str, Sequence[T]], url_of: Callable[[T], str], k: int = K) -> list[Fused]:
    """Merge each provider's ranked list (provider -> its results, best first) by reciprocal
    rank fusion: a page scores sum(1 / (k + rank)) over the lists that hold it, so pages several
    providers rank high come first. A page keeps the copy from the list that ranks it best
    (the first list on a tie); equal scores keep the order of first appearance."""
    order = list(ranked)
    best: dict[str, tuple[int, int, T]] = {}  # page -> (rank, list index, copy)
    found: dict[str, set[str]] = {}
    score: dict[str, float] = {}
    first_seen: dict[str, tuple[int, int]] = {}
    for index, provider in enumerate(order):
        seen: set[str] = set()
        for rank, item in enumerate(ranked[provider], start=1):
            page = canonical_url(url_of(item))
            if page in seen:
                continue  # a list naming a page twice counts it once, at its best rank
            seen.add(page)
            score[page] = score.get(page, 0.0) + 1.0 / (k + rank)
            found.setdefault(page, set()).add(provider)
            first_seen.setdefault(page, (rank, index))
            if page not in best or (rank, index) < best[page][:2]:
                best[page] = (rank, index, item)
    pages = sorted(score, key=lambda p: (-score[p], first_seen[p]))
    return [Fused(best[p][2], tuple(n for n in order if n in found[p]), score[p]) for p in pages]

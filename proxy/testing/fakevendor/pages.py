"""The vendors' extract APIs as the fake answers them: Tavily extract, Exa contents, Firecrawl
scrape and Jina's reader, each in its own shape, with a deterministic page per URL
(`make_page`) and, per URL, the vendors that fail to read it (`FakeVendor.fail_page`).

=============  ============================================  =================================
vendor         path (prefixed, bare)                         a page / a URL it fails on
=============  ============================================  =================================
tavily         POST /tavily/extract, /extract                results[] / failed_results[]
exa            POST /exa/contents, /contents                 results[] / statuses[] error
firecrawl      POST /firecrawl/v2/scrape, /v2/scrape         data.markdown / statusCode 404
jina-reader    POST /jina-reader/                            data.content / 422 readableMessage
=============  ============================================  =================================
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.testing.fakevendor.vendors import slugify

EXTRACT_VENDORS = ("tavily", "exa", "firecrawl", "jina-reader")


@dataclass(frozen=True)
class FakePage:
    url: str
    title: str
    content: str


def make_page(url: str) -> FakePage:
    """The page the fake serves for `url`, the same from every vendor."""
    slug = slugify(url.split("://", 1)[-1]) or "page"
    title = f"Page {slug}"
    return FakePage(url, title, f"# {title}\n\nThe text of {url}, as read by a fake vendor.")


Fails = Callable[[str], bool]  # whether this vendor fails to read the URL


def _tavily(body: Any, fails: Fails) -> tuple[int, Any]:
    urls = _list(body, "urls")
    results = [make_page(u) for u in urls if not fails(u)]
    return 200, {
        "results": [
            {"url": p.url, "title": p.title, "raw_content": p.content, "images": []}
            for p in results
        ],
        "failed_results": [{"url": u, "error": "Failed to fetch url"} for u in urls if fails(u)],
        "response_time": 0.01,
    }


def _exa(body: Any, fails: Fails) -> tuple[int, Any]:
    urls = _list(body, "urls") or _list(body, "ids")
    limit = body.get("text", {}).get("maxCharacters") if isinstance(body, dict) else None
    results, statuses = [], []
    for url in urls:
        if fails(url):
            error = {"tag": "CRAWL_NOT_FOUND", "httpStatusCode": 404}
            statuses.append({"id": url, "status": "error", "error": error})
            continue
        page = make_page(url)
        text = page.content[:limit] if isinstance(limit, int) else page.content
        results.append({"id": url, "url": url, "title": page.title, "text": text})
        statuses.append({"id": url, "status": "success"})
    return 200, {"requestId": "fake-contents", "results": results, "statuses": statuses}


def _firecrawl(body: Any, fails: Fails) -> tuple[int, Any]:
    url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str):
        return 400, {"success": False, "error": "url is required"}
    page = make_page(url)
    status = 404 if fails(url) else 200
    markdown = "# Not Found" if fails(url) else page.content
    meta = {"title": page.title, "sourceURL": url, "url": url, "statusCode": status}
    return 200, {"success": True, "data": {"markdown": markdown, "metadata": meta}}


def _jina_reader(body: Any, fails: Fails) -> tuple[int, Any]:
    url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str) or fails(url):
        message = f"Failed to goto {url}: net::ERR_NAME_NOT_RESOLVED"
        return 422, {
            "data": None,
            "code": 422,
            "name": "AssertionFailureError",
            "status": 42206,
            "message": message,
            "readableMessage": f"AssertionFailureError: {message}",
        }
    page = make_page(url)
    data = {"title": page.title, "url": url, "content": page.content, "usage": {"tokens": 42}}
    return 200, {"code": 200, "status": 20000, "data": data}


READERS: dict[str, Callable[[Any, Fails], tuple[int, Any]]] = {
    "tavily": _tavily,
    "exa": _exa,
    "firecrawl": _firecrawl,
    "jina-reader": _jina_reader,
}


def extract_answer(
    vendor: str, body: Any, failing: Mapping[str, Collection[str] | None]
) -> tuple[int, Any]:
    """`vendor`'s answer to an extract request; `failing`: URL -> the vendors failing on it
    (None: all of them)."""

    def fails(url: str) -> bool:
        if url not in failing:
            return False
        who = failing[url]
        return who is None or vendor in who

    return READERS[vendor](body, fails)


def _list(body: Any, key: str) -> list[str]:
    value = body.get(key) if isinstance(body, dict) else None
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []

"""The ten vendors as the fake plays them: deterministic results, each vendor's answer and error
bodies, and how a request says which vendor and which query it is for."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl, quote

from aiohttp import web

from proxy.testing.fakevendor.faults import Received

VENDORS: tuple[str, ...] = (
    "tavily",
    "serper",
    "exa",
    "brave",
    "serpapi",
    "scavio",
    "searxng",
    "linkup",
    "jina",
    "firecrawl",
)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class FakeResult:
    """One deterministic search result."""

    url: str
    title: str
    snippet: str
    score: float
    position: int


def slugify(query: str) -> str:
    """Lower-case, non-alphanumerics collapsed to '-'; 'q' when nothing is left."""
    slug = re.sub(r"[^a-z0-9]+", "-", query.lower()).strip("-")
    return slug or "q"


def make_results(query: str, n: int = 3) -> list[FakeResult]:
    """The results every vendor shape is built from: url https://example.com/<slug>/<i>."""
    slug = slugify(query)
    return [
        FakeResult(
            url=f"https://example.com/{slug}/{i}",
            title=f"Result {i} for {query}",
            snippet=f"Snippet {i} about {query}.",
            score=round(max(0.05, 1.0 - 0.1 * i), 2),
            position=i,
        )
        for i in range(1, n + 1)
    ]


def expected_urls(query: str, n: int = 3) -> list[str]:
    """The urls a normal answer for ``query`` carries, in order."""
    return [r.url for r in make_results(query, n)]


# --------------------------------------------------------------------------- vendor shapes

COUNT_PARAM = {
    "tavily": "max_results",
    "serper": "num",
    "exa": "numResults",
    "brave": "count",
    "serpapi": "num",
    "scavio": "num_results",
    "searxng": "",
    "linkup": "maxResults",
    "jina": "num",
    "firecrawl": "limit",
}

_QUERY_PARAM = {"tavily": "query", "exa": "query", "scavio": "query", "firecrawl": "query"}

# where the result list lives, for missing_results()
_RESULTS_PATH = {
    "tavily": ("results",),
    "exa": ("results",),
    "brave": ("web",),
    "serpapi": ("organic_results",),
    "scavio": ("organic_results",),
    "searxng": ("results",),
    "linkup": ("results",),
    "jina": ("data",),
    "firecrawl": ("data", "web"),
}


def _tavily(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    return 200, {
        "query": q,
        "follow_up_questions": None,
        "answer": None,
        "images": [],
        "results": [
            {
                "url": r.url,
                "title": r.title,
                "content": r.snippet,
                "score": r.score,
                "raw_content": None,
            }
            for r in res
        ],
        "response_time": 0.01,
    }


def _exa(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    return 200, {
        "requestId": f"fake-{slugify(q)}",
        "resolvedSearchType": "neural",
        "results": [
            {
                "id": r.url,
                "url": r.url,
                "title": r.title,
                "text": r.snippet,
                "score": r.score,
                "publishedDate": None,
                "author": None,
            }
            for r in res
        ],
        "costDollars": {"total": 0.005},
    }


def _brave(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    payload: dict[str, Any] = {
        "type": "search",
        "query": {"original": q, "more_results_available": False},
    }
    if res:
        payload["web"] = {
            "type": "search",
            "results": [
                {
                    "title": r.title,
                    "url": r.url,
                    "description": r.snippet,
                    "type": "search_result",
                    "language": "en",
                    "family_friendly": True,
                }
                for r in res
            ],
            "family_friendly": True,
        }
    return 200, payload


def _serpapi(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    engine = str(p.get("engine", "google"))
    base = f"https://serpapi.com/search.json?engine={engine}&q={quote(q)}"
    payload: dict[str, Any] = {
        "search_metadata": {
            "id": f"fake-{slugify(q)}",
            "status": "Success",
            "json_endpoint": f"https://serpapi.com/searches/fake-{slugify(q)}.json",
        },
        "search_parameters": {"engine": engine, "q": q},
    }
    if not res:
        payload["search_information"] = {"organic_results_state": "Fully empty"}
        payload["error"] = "Google hasn't returned any results for this query."
        return 200, payload
    payload["search_information"] = {
        "organic_results_state": "Results for exact spelling",
        "total_results": len(res),
    }
    payload["organic_results"] = [
        {
            "position": r.position,
            "title": r.title,
            "link": r.url,
            "displayed_link": r.url.removeprefix("https://"),
            "snippet": r.snippet,
        }
        for r in res
    ]
    payload["serpapi_pagination"] = {"current": 1, "next": f"{base}&start=10"}
    return 200, payload


def _scavio(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    return 200, {
        "query": q,
        "organic_results": [
            {"position": r.position, "title": r.title, "link": r.url, "snippet": r.snippet}
            for r in res
        ],
        "credits_used": 1,
    }


def _searxng(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    if p.get("format") != "json":
        items = "".join(f'<article><a href="{r.url}">{r.title}</a></article>' for r in res)
        return 200, f"<!DOCTYPE html><html><body>{items}</body></html>"
    return 200, {
        "query": q,
        "number_of_results": len(res),
        "results": [
            {
                "url": r.url,
                "title": r.title,
                "content": r.snippet,
                "engine": "fake",
                "engines": ["fake"],
                "score": r.score,
                "category": "general",
            }
            for r in res
        ],
        "answers": [],
        "corrections": [],
        "infoboxes": [],
        "suggestions": [],
        "unresponsive_engines": [],
    }


LINKUP_FAVICON = "https://example.com/favicon.ico"


def _linkup(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    if not res:
        return 400, {
            "statusCode": 400,
            "error": {
                "code": "SEARCH_QUERY_NO_RESULT",
                "message": "The query did not yield any result",
                "details": [],
            },
        }
    if p.get("outputType") == "sourcedAnswer":
        return 200, {
            "answer": f"Fake answer about {q}.",
            "sources": [
                {"name": r.title, "url": r.url, "snippet": r.snippet, "favicon": LINKUP_FAVICON}
                for r in res
            ],
        }
    return 200, {
        "results": [
            {
                "type": "text",
                "name": r.title,
                "url": r.url,
                "content": r.snippet,
                "favicon": LINKUP_FAVICON,  # linkup-sdk requires it
            }
            for r in res
        ]
    }


def _jina(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    return 200, {
        "code": 200,
        "status": 20000,
        "data": [
            {
                "title": r.title,
                "url": r.url,
                "description": r.snippet,
                "content": r.snippet,
                "usage": {"tokens": 10},
            }
            for r in res
        ],
        "meta": {"usage": {"tokens": 10 * len(res)}},
    }


def _firecrawl(q: str, res: list[FakeResult], p: dict[str, Any], rec: Received) -> tuple[int, Any]:
    return 200, {
        "success": True,
        "data": {
            "web": [
                {
                    "url": r.url,
                    "title": r.title,
                    "description": r.snippet,
                    "position": r.position,
                }
                for r in res
            ]
        },
        "creditsUsed": 1,
    }


BUILDERS: dict[str, Callable[[str, list[FakeResult], dict[str, Any], Received], tuple[int, Any]]]
BUILDERS = {
    "tavily": _tavily,
    "exa": _exa,
    "brave": _brave,
    "serpapi": _serpapi,
    "scavio": _scavio,
    "searxng": _searxng,
    "linkup": _linkup,
    "jina": _jina,
    "firecrawl": _firecrawl,
}


def drop_results(vendor: str, payload: Any) -> None:
    path = _RESULTS_PATH.get(vendor)
    if not path or not isinstance(payload, dict):
        return
    target = payload
    for key in path[:-1]:
        target = target.get(key, {})
    if isinstance(target, dict):
        target.pop(path[-1], None)


_BRAVE_CODES = {
    400: "VALIDATION",
    401: "SUBSCRIPTION_TOKEN_INVALID",
    403: "OPTION_NOT_IN_PLAN",
    422: "SUBSCRIPTION_TOKEN_INVALID",
    429: "RATE_LIMITED",
}
_LINKUP_CODES = {
    400: "BAD_REQUEST",
    401: "UNAUTHORIZED",
    403: "FORBIDDEN",
    429: "TOO_MANY_REQUESTS",
}
_SCAVIO_CODES = {
    400: "bad_request",
    401: "unauthorized",
    402: "insufficient_credits",
    429: "rate_limited",
}
_EXA_TAGS = {401: "INVALID_API_KEY", 402: "NO_MORE_CREDITS", 429: "RATE_LIMIT_EXCEEDED"}
_JINA_NAMES = {
    400: "ParamValidationError",
    401: "AuthenticationRequiredError",
    402: "InsufficientBalanceError",
    429: "RateLimitTriggeredError",
}
_TAVILY_REASONS = {
    432: "This request exceeds your plan's set usage limit. Please upgrade your plan.",
    433: "This request exceeds the pay-as-you-go limit. You can increase your limit.",
}


def _reason(code: int) -> str:
    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return f"Error {code}"


def error_payload(
    vendor: str | None, code: int, error_code: str | None, message: str | None = None
) -> Any:
    """The vendor's own error body for ``code``."""
    if message is None and vendor == "tavily":
        message = _TAVILY_REASONS.get(code)
    msg = message or _reason(code)
    upper = error_code or msg.upper().replace(" ", "_")
    if vendor == "tavily":
        return {"detail": {"error": msg}}
    if vendor == "serper":
        return {"message": msg, "statusCode": code}
    if vendor == "brave":
        word = error_code or _BRAVE_CODES.get(code, "INTERNAL_ERROR")
        error = {"id": "fake", "status": code, "code": word, "detail": msg, "meta": {}}
        return {"type": "ErrorResponse", "error": error, "time": int(time.time())}
    if vendor == "exa":
        return {"requestId": "fake", "error": msg, "tag": error_code or _EXA_TAGS.get(code, upper)}
    if vendor == "linkup":
        word = error_code or _LINKUP_CODES.get(code, upper)
        return {"statusCode": code, "error": {"code": word, "message": msg, "details": []}}
    if vendor == "scavio":
        return {"error": {"code": error_code or _SCAVIO_CODES.get(code, upper), "message": msg}}
    if vendor == "jina":
        name = error_code or _JINA_NAMES.get(code, "InternalServerError")
        return {
            "data": None,
            "code": code,
            "name": name,
            "status": code * 100 + 1,
            "message": msg,
            "readableMessage": f"{name}: {msg}",
        }
    if vendor == "firecrawl":
        return {"success": False, "error": msg}
    if vendor == "searxng":
        return msg
    return {"error": error_code or msg, "status": code}


# --------------------------------------------------------------------------- helpers


def json_or_none(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def params_of(rec: Received) -> dict[str, Any]:
    """Query string, then form or JSON-object body, merged (body wins)."""
    out: dict[str, Any] = dict(parse_qsl(rec.query_string, keep_blank_values=True))
    if rec.body:
        ctype = rec.headers.get("Content-Type", "")
        if "application/x-www-form-urlencoded" in ctype:
            out.update(parse_qsl(rec.body.decode("utf-8", "replace"), keep_blank_values=True))
        else:
            obj = json_or_none(rec.body)
            if isinstance(obj, dict):
                out.update(obj)
    return out


def query_of(rec: Received, params: dict[str, Any] | None = None) -> str | None:
    """The search query of a vendor request, or None."""
    params = params_of(rec) if params is None else params
    if rec.vendor == "jina" and "q" not in params:
        tail = rec.path.removeprefix("/jina").lstrip("/")
        return tail or None
    value = params.get(_QUERY_PARAM.get(rec.vendor or "", "q"))
    if value is None and rec.vendor == "serper":
        batch = json_or_none(rec.body)
        if isinstance(batch, list) and batch and isinstance(batch[0], dict):
            value = batch[0].get("q")
    return None if value is None else str(value)


def route_bare_search(request: web.Request, body: bytes) -> str:
    """Which vendor a bare ``/search`` request is for (the rule is in the package docstring)."""
    query = request.query
    if request.method != "POST":
        if "engine" in query or "api_key" in query:
            return "serpapi"
        return "serper" if "apiKey" in query else "searxng"
    if request.content_type == "application/x-www-form-urlencoded":
        return "searxng"
    obj = json_or_none(body)
    if "q" in query or isinstance(obj, list) or (isinstance(obj, dict) and "q" in obj):
        return "serper"
    if "X-API-KEY" in request.headers:
        return "exa" if isinstance(obj, dict) and "query" in obj else "serper"
    return "tavily"

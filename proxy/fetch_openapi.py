"""`POST /v1/fetch` in the OpenAPI document at `GET /openapi.json`: its request, its answer and
the error shape it shares with /v1/search, with this config's limits."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from policies.fetch import MAX_URL_CHARS, PAGE_FORMATS

# A failed page's error.type: a provider could not read it; the direct fetcher refused its
# address (and no other provider read it); every provider was down, skipped or out of calls;
# every provider refused for good (bad key, no credits).
FAILURE_TYPES = ("page_failed", "page_refused", "providers_unavailable", "providers_refused")


def fetch_schemas(
    *, max_urls: int, max_chars: int, max_page_chars: int, providers: Sequence[str]
) -> dict[str, Any]:
    """The schemas of /v1/fetch's request and answer."""
    request = {
        "type": "object",
        "additionalProperties": False,
        "required": ["urls"],
        "description": "Unknown fields are refused with 400.",
        "properties": {
            "urls": {
                "type": "array",
                "items": {"type": "string", "format": "uri", "maxLength": MAX_URL_CHARS},
                "minItems": 1,
                "maxItems": max_urls,
                "uniqueItems": True,
                "description": "http(s) URLs of the pages to read, each once; no user:password@.",
            },
            "format": {
                "type": "string",
                "enum": list(PAGE_FORMATS),
                "description": "How the content is wanted (default markdown). A provider that "
                "gives only markdown says so in each result's `format`.",
            },
            "max_chars": {
                "type": "integer",
                "minimum": 1,
                "maximum": max_page_chars,
                "description": f"The longest content per page (default {max_chars}); longer "
                "pages are cut, with `truncated: true`.",
            },
            "providers": {
                "type": "array",
                "items": {"type": "string", "enum": list(providers)},
                "minItems": 1,
                "uniqueItems": True,
                "description": "Providers to try per URL, in order (default: "
                "fetch_api.providers); `direct` is the proxy's own fetcher.",
            },
        },
    }
    result = {
        "type": "object",
        "additionalProperties": False,
        "required": [
            "url",
            "title",
            "content",
            "provider",
            "fetched_at",
            "format",
            "truncated",
            "from_cache",
        ],
        "properties": {
            "url": {"type": "string", "description": "As asked."},
            "title": {"type": "string"},
            "content": {"type": "string"},
            "provider": {"type": "string", "description": "Who read the page."},
            "fetched_at": {
                "type": "string",
                "format": "date-time",
                "description": "When it was read (earlier when it comes from the cache).",
            },
            "format": {"type": "string", "enum": list(PAGE_FORMATS)},
            "truncated": {"type": "boolean", "description": "The content was cut."},
            "from_cache": {
                "type": "boolean",
                "description": "Answered by the page cache (stale ones only when every "
                "provider failed).",
            },
        },
    }
    failure = {
        "type": "object",
        "additionalProperties": False,
        "required": ["url", "error", "attempts"],
        "properties": {
            "url": {"type": "string"},
            "error": {
                "type": "object",
                "additionalProperties": False,
                "required": ["type", "message", "retry_after_s"],
                "properties": {
                    "type": {"type": "string", "enum": list(FAILURE_TYPES)},
                    "message": {
                        "type": "string",
                        "description": "What each provider said, and what to do.",
                    },
                    "retry_after_s": {"type": ["number", "null"]},
                },
            },
            "attempts": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["provider", "outcome", "reason"],
                    "properties": {
                        "provider": {"type": "string"},
                        "outcome": {"type": "string", "enum": ["failed", "unavailable", "refused"]},
                        "reason": {"type": "string"},
                    },
                },
            },
        },
    }
    answer = {
        "type": "object",
        "additionalProperties": False,
        "required": ["results", "failed"],
        "properties": {
            "results": {
                "type": "array",
                "items": {"$ref": "#/components/schemas/FetchResult"},
                "description": "Pages read, in the order asked.",
            },
            "failed": {
                "type": "array",
                "items": {"$ref": "#/components/schemas/FetchFailure"},
                "description": "URLs no provider read, in the order asked.",
            },
        },
    }
    return {
        "FetchRequest": request,
        "FetchAnswer": answer,
        "FetchResult": result,
        "FetchFailure": failure,
    }


def _fetch_path() -> dict[str, Any]:
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {
        "post": {
            "operationId": "fetch",
            "summary": "Read pages by URL through the providers, with failover per URL",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": "#/components/schemas/FetchRequest"},
                        "examples": {
                            "two": {
                                "value": {
                                    "urls": ["https://example.com/a", "https://example.com/b"],
                                    "format": "markdown",
                                    "max_chars": 8000,
                                }
                            }
                        },
                    }
                },
            },
            "responses": {
                "200": {
                    "description": "Each URL asked, in `results` or in `failed` (a page no "
                    "provider could read is no error of the request).",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/FetchAnswer"}}
                    },
                },
                "400": {
                    "description": "The body is wrong; the message names the field.",
                    "content": error,
                },
                "404": {"description": "No fetch provider is configured.", "content": error},
                "405": {"description": "Only POST is supported.", "content": error},
            },
        }
    }


def with_fetch(document: Mapping[str, Any], schemas: Mapping[str, Any]) -> dict[str, Any]:
    """`document` (/v1/search's) with /v1/fetch's path and `schemas` added."""
    merged = copy.deepcopy(dict(document))
    merged["paths"]["/v1/fetch"] = _fetch_path()
    merged["components"]["schemas"].update(copy.deepcopy(dict(schemas)))
    merged["info"]["description"] += (
        "\n\n`POST /v1/fetch` reads the pages an agent chose, through the vendors' extract "
        "APIs (and the proxy's own fetcher when enabled), with failover per URL."
    )
    return merged

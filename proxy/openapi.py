"""The OpenAPI 3.1 document of `POST /v1/search`, served at `GET /openapi.json`: the request
with every option, the answer, and the error shape. Built from the option tables, so the
per-vendor support it lists is the one the code applies."""

from __future__ import annotations

from typing import Any

from policies.profiles import BUILTIN_PROFILES, OPTION_NAMES, TIME_RANGES, TOPICS

VERSION = "1.0.0"


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    kind = schema["type"]
    return {**schema, "type": [kind, "null"]}


def option_support() -> dict[str, list[str]]:
    """Vendor -> the unified options it honours besides max_results, in OPTION_NAMES order;
    "topic (general only)" where news is dropped (general is every vendor's default)."""
    out: dict[str, list[str]] = {}
    for vendor, profile in BUILTIN_PROFILES.items():
        table = profile.options
        names = [n for n in OPTION_NAMES[1:] if n in table.fields or n == "topic"]
        out[vendor] = [
            "topic (general only)" if n == "topic" and n not in table.fields else n for n in names
        ]
    return out


def _support_table() -> str:
    lines = ["| vendor | options it honours |", "|---|---|"]
    lines += [f"| {v} | {', '.join(names)} |" for v, names in option_support().items()]
    return "\n".join(lines)


def _domains(max_domains: int, what: str) -> dict[str, Any]:
    return {
        "type": "array",
        "items": {"type": "string", "examples": ["example.com"]},
        "maxItems": max_domains,
        "description": f"Only results {what} these domains (subdomains included).",
    }


def openapi_document(
    *, max_batch: int, max_results: int, max_domains: int, max_providers: int | None = None
) -> dict[str, Any]:
    """The document; limits come from the search API so the two cannot disagree."""
    error_types = [
        "bad_request",
        "method_not_allowed",
        "body_too_large",
        "all_providers_failed",
        "all_providers_refused",
    ]
    request = {
        "type": "object",
        "description": (
            "Send `query` or `queries` (a batch), not both. Unknown fields are refused with 400."
        ),
        "additionalProperties": False,
        "oneOf": [{"required": ["query"]}, {"required": ["queries"]}],
        "properties": {
            "query": {"type": "string", "minLength": 1, "description": "What to search for."},
            "queries": {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "minItems": 1,
                "maxItems": max_batch,
                "description": "A batch: each is searched with the same options, answered in "
                "order under `responses`.",
            },
            "max_results": {
                "type": "integer",
                "minimum": 1,
                "maximum": max_results,
                "description": "Results wanted (default: search_api.max_results in the config). "
                "A vendor's own cap may return fewer.",
            },
            "providers": {
                "type": "array",
                "items": {"type": "string"},
                "minItems": 1,
                **({"maxItems": max_providers} if max_providers is not None else {}),
                "uniqueItems": True,
                "description": "Route names to try, in order (default: search_api.providers); "
                "search routes only, each at most once.",
            },
            "mode": {
                "type": "string",
                "enum": ["first", "merge", "race"],
                "default": "first",
                "description": "first: providers in order, the first with results answers. "
                "merge: up to search_api.merge_providers providers at once, their results "
                "deduplicated by canonical URL and ranked by reciprocal rank fusion, each "
                "listing `providers`. race: the first two providers at once, the first with "
                "results answers and the other is cancelled (then the rest in order).",
            },
            "time_range": {
                "type": "string",
                "enum": list(TIME_RANGES),
                "description": "Only results published or updated within the last day, week, "
                "month or year.",
            },
            "search_recency_filter": {
                "type": "string",
                "enum": list(TIME_RANGES),
                "description": "Perplexity's name for `time_range`.",
            },
            "include_domains": _domains(max_domains, "from"),
            "exclude_domains": _domains(max_domains, "not from"),
            "search_domain_filter": {
                "type": "array",
                "items": {"type": "string", "examples": ["example.com", "-pinterest.com"]},
                "description": "Perplexity's / LiteLLM's domain filter: a domain to include, or "
                "one prefixed with '-' to exclude. Not together with include_domains or "
                "exclude_domains.",
            },
            "topic": {
                "type": "string",
                "enum": list(TOPICS),
                "description": "general (web search, every vendor's default) or news.",
            },
            "country": {
                "type": "string",
                "pattern": "^[A-Za-z]{2}$",
                "description": "ISO 3166-1 alpha-2 code (US, DE, GB): where results should "
                "come from.",
            },
            "language": {
                "type": "string",
                "pattern": "^[A-Za-z]{2}$",
                "description": "ISO 639-1 code (en, de): the language results should be in.",
            },
            "safe_search": {
                "type": "boolean",
                "description": "true: filter adult content; false: do not.",
            },
            "max_tokens_per_page": {
                "type": "integer",
                "minimum": 1,
                "description": "Accepted for LiteLLM clients; no provider honours it, so it "
                "is always listed in dropped_options.",
            },
            "credentials": {
                "type": "object",
                "additionalProperties": {"type": "string", "minLength": 1, "maxLength": 4096},
                "description": "The caller's own API key per provider, e.g. "
                '{"tavily": "tvly-..."}. Used instead of the configured key for that '
                "provider only, sent where that vendor reads its key; never logged.",
                "examples": [{"tavily": "tvly-YOUR-KEY", "brave": "BSA-YOUR-KEY"}],
            },
        },
    }
    result = {
        "type": "object",
        "additionalProperties": False,
        "required": [
            "title",
            "url",
            "snippet",
            "date",
            "last_updated",
            "score",
            "published_date",
            "position",
            "provider",
        ],
        "properties": {
            "title": {"type": "string"},
            "url": {"type": "string"},
            "snippet": {"type": "string"},
            "date": _nullable(
                {"type": "string", "description": "Published date, YYYY-MM-DD, when known."}
            ),
            "last_updated": _nullable(
                {"type": "string", "description": "Last updated, YYYY-MM-DD, when known."}
            ),
            "score": _nullable(
                {"type": "number", "description": "The vendor's relevance score, when it has one."}
            ),
            "published_date": _nullable(
                {
                    "type": "string",
                    "description": "Published date or date-time (ISO 8601), as precise as the "
                    "vendor gave it.",
                }
            ),
            "position": {
                "type": "integer",
                "minimum": 1,
                "description": "The vendor's rank of this result.",
            },
            "provider": {"type": "string", "description": "The provider that found it."},
            "providers": {
                "type": "array",
                "items": {"type": "string"},
                "description": "mode: merge: every provider that found it, in the order asked.",
            },
        },
    }
    attempt = {
        "type": "object",
        "additionalProperties": False,
        "required": ["provider", "query", "outcome", "status", "ms", "dropped_options"],
        "properties": {
            "provider": {"type": "string"},
            "query": {"type": "string", "description": "The query sent (maybe simplified)."},
            "outcome": {
                "type": "string",
                "enum": ["results", "empty", "failed", "skipped", "cancelled"],
                "description": "cancelled: raced (mode: race) and another answered first.",
            },
            "status": _nullable({"type": "integer"}),
            "ms": {"type": "number"},
            "dropped_options": {"type": "array", "items": {"type": "string"}},
        },
    }
    answer = {
        "type": "object",
        "additionalProperties": False,
        "required": [
            "object",
            "query",
            "query_used",
            "provider",
            "results",
            "dropped_options",
            "from_cache",
            "cache_age_s",
            "attempts",
        ],
        "properties": {
            "object": {"const": "search"},
            "query": {"type": "string"},
            "query_used": {
                "type": "string",
                "description": "The query that found the results (simplified when the "
                "original found nothing).",
            },
            "provider": _nullable(
                {"type": "string", "description": "Who answered; null when none found results."}
            ),
            "results": {"type": "array", "items": {"$ref": "#/components/schemas/SearchResult"}},
            "dropped_options": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Options sent (by the names used) that the answering provider "
                "could not honour: its results are not filtered by them.",
            },
            "from_cache": {"type": "boolean"},
            "cache_age_s": _nullable({"type": "integer"}),
            "attempts": {"type": "array", "items": {"$ref": "#/components/schemas/Attempt"}},
            "providers": {
                "type": "array",
                "items": {"type": "string"},
                "description": "mode: merge: the providers whose results are merged.",
            },
        },
    }
    error = {
        "type": "object",
        "additionalProperties": False,
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": [
                    "type",
                    "message",
                    "route",
                    "attempts",
                    "upstream_status",
                    "retry_after_s",
                ],
                "properties": {
                    "type": {"type": "string", "examples": error_types},
                    "message": {
                        "type": "string",
                        "description": "One sentence: what happened and what to do.",
                    },
                    "route": _nullable({"type": "string"}),
                    "attempts": {"type": "integer", "minimum": 0},
                    "upstream_status": _nullable({"type": "integer"}),
                    "retry_after_s": _nullable({"type": "number"}),
                },
            }
        },
    }
    batch = {
        "type": "object",
        "additionalProperties": False,
        "required": ["responses"],
        "properties": {
            "responses": {
                "type": "array",
                "description": "One per query, in order: an answer, or that query's error.",
                "items": {
                    "oneOf": [
                        {"$ref": "#/components/schemas/SearchAnswer"},
                        {"$ref": "#/components/schemas/Error"},
                    ]
                },
            }
        },
    }

    def error_response(description: str, retry_after: bool = False) -> dict[str, Any]:
        headers: dict[str, Any] = {"X-Proxy-Error": {"$ref": "#/components/headers/ProxyError"}}
        if retry_after:
            headers["Retry-After"] = {"$ref": "#/components/headers/RetryAfter"}
        return {
            "description": description,
            "headers": headers,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "search-proxy search API",
            "version": VERSION,
            "description": (
                "One search API over the configured web-search vendors, tried in order, each "
                "through its own route's retries, rate limit, breaker and cache. The answer "
                "follows LiteLLM's search API (Perplexity's shape: `results[]` with title, "
                "url, snippet, date, last_updated) with extra fields.\n\n"
                "Options a vendor cannot honour are listed in `dropped_options`:\n\n"
                + _support_table()
            ),
        },
        "paths": {
            "/v1/search": {
                "post": {
                    "operationId": "search",
                    "summary": "Search the web across providers, with fallback in order",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/SearchRequest"},
                                "examples": {
                                    "simple": {"value": {"query": "rust async runtimes"}},
                                    "options": {
                                        "value": {
                                            "query": "EU AI act",
                                            "max_results": 5,
                                            "time_range": "week",
                                            "topic": "news",
                                            "country": "DE",
                                            "include_domains": ["europa.eu"],
                                        }
                                    },
                                },
                            }
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "Results (or an empty list when every provider "
                            "that answered found nothing); a batch answers `responses`.",
                            "headers": {"X-Request-Id": {"$ref": "#/components/headers/RequestId"}},
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "oneOf": [
                                            {"$ref": "#/components/schemas/SearchAnswer"},
                                            {"$ref": "#/components/schemas/BatchAnswer"},
                                        ]
                                    }
                                }
                            },
                        },
                        "400": error_response("The body is wrong; the message names the field."),
                        "405": error_response("Only POST is supported."),
                        "502": error_response(
                            "Every provider refused for good (bad key, no credits, no key "
                            "configured): retrying will not help."
                        ),
                        "503": error_response(
                            "Every provider failed or was skipped; retry after Retry-After.",
                            retry_after=True,
                        ),
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "summary": "This document",
                    "responses": {
                        "200": {
                            "description": "The OpenAPI 3.1 document.",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "SearchRequest": request,
                "SearchAnswer": answer,
                "SearchResult": result,
                "Attempt": attempt,
                "BatchAnswer": batch,
                "Error": error,
            },
            "headers": {
                "RequestId": {
                    "description": "The request's id (the caller's X-Request-Id, if sent).",
                    "schema": {"type": "string"},
                },
                "ProxyError": {
                    "description": "The error type, as in the body.",
                    "schema": {"type": "string"},
                },
                "RetryAfter": {
                    "description": "Seconds until a provider is expected to answer again.",
                    "schema": {"type": "integer"},
                },
            },
        },
    }

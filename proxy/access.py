"""A request's id and its one access-log line, the same wherever the request was answered (the
envelope, or the front replaying a hit)."""

from __future__ import annotations

import random
import re
from typing import Any

from multidict import CIMultiDictProxy

from policies.core.flow import Trace
from proxy.logs import info_line
from proxy.redact import redact_query

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def new_request_id() -> str:
    """32 random hex digits. An id only tells requests apart (no secret rides on it): the
    process's seeded generator, not a system call per request."""
    return f"{random.getrandbits(128):032x}"


def request_id(headers: CIMultiDictProxy[str]) -> str:
    """The agent's X-Request-Id when it is safe to log and forward, else a fresh one."""
    rid = headers.get("X-Request-Id", "")
    return rid if _REQUEST_ID.match(rid) else new_request_id()


def route_fields(trace: Trace) -> dict[str, object]:
    """What a route request's access line says it did; credentials are redacted by the log
    processor."""
    return {
        "upstream_ms": round(trace.upstream_seconds * 1000, 2),
        "attempts": trace.attempts,
        "retries": trace.retry_reasons or None,
        "cache": trace.cache,
        "breaker": trace.breaker,
        "provider": trace.provider,
        "hedges": trace.hedges or None,
        "rpc": trace.rpc,
    }


def access_line(
    request: Any,
    rid: str,
    route: str | None,
    status: int,
    elapsed: float,
    fields: dict[str, Any],
    *,
    cut: str | None,
    written: int,
    error: str | None,
) -> None:
    """The access-log line of one finished request (`request`: its method, path and query)."""
    info_line(
        {
            "request_id": rid,
            "route": route,
            "method": request.method,
            "path": request.path,
            "query": redact_query(request.query_string) if request.query_string else None,
            "status": status,
            "duration_ms": round(elapsed * 1000, 2),
            **fields,
            "cut": cut,
            "bytes": written,
            "error": error,
            "event": "request",
        }
    )

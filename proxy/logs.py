"""structlog set-up: one JSON line per event, with credentials redacted wherever they appear."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from typing import Any, TextIO

import orjson
import structlog

REDACTED = "<redacted>"
# Keys whose values are credentials, wherever they appear in an event (headers, bodies, config).
SECRET_KEYS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "x-subscription-token",
        "api-key",
        "api_key",
        "apikey",
        "token",
        "access_token",
        "cookie",
        "set-cookie",
        "password",
        "secret",
        "admin_token",
    }
)
# Query parameters that carry keys (SerpAPI's api_key, and the usual suspects).
_QUERY_SECRET = re.compile(
    r"(?i)(^|[?&])(api_key|apikey|key|token|access_token|auth|password|secret)=[^&#]*"
)
_BEARER = re.compile(r"(?i)\b(bearer|basic|token)\s+[A-Za-z0-9._~+/=-]{4,}")


def redact_query(query: str) -> str:
    """A query string with the values of key-bearing parameters replaced."""
    return _QUERY_SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}={REDACTED}", query)


def redact_value(key: str, value: Any) -> Any:
    """Redact one event value by its key, recursing into mappings and lists."""
    if key.lower() in SECRET_KEYS:
        return REDACTED
    if isinstance(value, str):
        if "=" in value:
            value = redact_query(value)
        if " " in value:
            value = _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", value)
        return value
    if isinstance(value, Mapping):
        return {k: redact_value(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_value(key, v) for v in value]
    return value


def _redact(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in event.items():
        if isinstance(value, str | Mapping | list | tuple) or key.lower() in SECRET_KEYS:
            event[key] = redact_value(key, value)
    return event


def _orjson_dumps(obj: Any, default: Any = None) -> bytes:
    return orjson.dumps(obj, default=default or str)


def configure_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Set structlog up once per process; JSON by default, console lines for humans."""
    out = stream or sys.stdout
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _redact,
    ]
    if fmt == "json":
        processors.append(structlog.processors.JSONRenderer(serializer=_orjson_dumps))
        # orjson renders bytes: write them to the text stream's binary buffer underneath.
        factory: Any = structlog.BytesLoggerFactory(out.buffer)
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
        factory = structlog.PrintLoggerFactory(out)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )

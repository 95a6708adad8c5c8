"""structlog set-up: one JSON line per event, with credentials redacted wherever they appear,
including in what aiohttp, asyncio and other libraries log through the standard logging module."""

from __future__ import annotations

import logging
import re
import sys
import traceback
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

import orjson
import structlog

from policies.core.credentials import is_credential_name
from proxy.redact import REDACTED, redact_bytes, redact_query, redact_text

__all__ = [
    "REDACTED",
    "Redactor",
    "configure_logging",
    "learn_secrets",
    "redact_query",
    "redact_value",
]

# Shorter configured values (`free`, `json`) are not hidden wherever they appear: they would
# hide ordinary words, and are no keys.
MIN_SECRET_CHARS = 8


def redact_value(key: str, value: Any, known: re.Pattern[str] | None = None) -> Any:
    """Redact one event value by its key (a credential name hides the whole value), recursing
    into mappings and lists; text is searched for credentials in a recognisable shape and for
    the `known` secrets."""
    if value is not None and is_credential_name(key):
        return REDACTED
    if isinstance(value, str):
        value = redact_text(value)
        return known.sub(REDACTED, value) if known is not None else value
    if isinstance(value, Mapping):
        return {k: redact_value(str(k), v, known) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_value(key, v, known) for v in value]
    return value


class Redactor:
    """The structlog processor that hides credentials: values under credential names,
    credentials in a recognisable shape inside text, and the config's own secrets (its
    headers.set values, tokens, passwords) wherever they appear."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self.secrets: set[str] = set()
        self.known: re.Pattern[str] | None = None
        self.learn(secrets)

    def learn(self, secrets: Iterable[str]) -> None:
        """Hide these secrets too (a reloaded config's); those known already stay hidden, for
        requests still running on the config before."""
        self.secrets |= {s for s in secrets if len(s) >= MIN_SECRET_CHARS}
        known = sorted(self.secrets, key=len, reverse=True)
        self.known = re.compile("|".join(map(re.escape, known))) if known else None

    def __call__(self, _: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        known = self.known
        for key, value in event.items():
            if value is None:
                continue
            kind = type(value)
            if kind is str:
                if is_credential_name(key):
                    event[key] = REDACTED
                else:
                    text = redact_text(value)
                    event[key] = known.sub(REDACTED, text) if known is not None else text
            elif kind in _NUMBERS:  # a number is hidden under a credential's name only
                if is_credential_name(key):
                    event[key] = REDACTED
            else:
                event[key] = redact_value(key, value, known)
        return event


class _Worker:
    """The structlog processor that names the worker writing each line."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, _: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("worker", self.index)
        return event


# Exact types, tested before anything slower: most fields of a line are these.
_NUMBERS = frozenset({int, float, bool})


def _orjson_dumps(obj: Any, default: Any = None) -> bytes:
    return orjson.dumps(obj, default=default or str)


class StdlibBridge(logging.Handler):
    """Writes the records of the standard logging module (aiohttp.server, aiohttp.access,
    aiohttp.web, asyncio, ...) as our own redacted lines. aiohttp's errors quote the bytes of
    a request they could not parse, an Authorization line among them: bytes literals are left
    out of the message and the traceback."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: dict[str, Any] = {"logger": record.name}
            if record.exc_info and record.exc_info[1] is not None:
                text = "".join(traceback.format_exception(*record.exc_info))
                fields["exception"] = redact_bytes(text)
            # make_filtering_bound_logger knows the standard levels only.
            level = min(logging.CRITICAL, max(logging.DEBUG, record.levelno // 10 * 10))
            message = redact_bytes(record.getMessage())
            structlog.get_logger(record.name).log(level, message, **fields)
        except Exception:  # a record that cannot be written is dropped, never half-written
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:
        # logging's own fallback prints the record's message and arguments to stderr unredacted.
        return


def _route_stdlib_logging(level: int) -> None:
    """Every standard-library logger, and warnings, through StdlibBridge only: no handler
    of logging's own (nor its last-resort stderr handler) writes a record unredacted."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(StdlibBridge())
    root.setLevel(level)
    logging.captureWarnings(True)


# The redactor of the configured logs: a reload teaches it the new config's secrets.
_REDACTOR: Redactor | None = None


def learn_secrets(secrets: Iterable[str]) -> None:
    """Hide these secrets too in every line from now on (a reloaded config's)."""
    if _REDACTOR is not None:
        _REDACTOR.learn(secrets)


class Level:
    """What the configured level lets through, for lines whose fields cost something to build:
    a hot path builds its debug line only when `LEVEL.debug` (true until configure_logging
    says otherwise: structlog's own default prints every level)."""

    debug = True


LEVEL = Level()


def configure_logging(
    level: str = "info",
    fmt: str = "json",
    stream: TextIO | None = None,
    secrets: Iterable[str] = (),
    worker: int | None = None,
) -> None:
    """Set structlog up once per process; JSON by default, console lines for humans. `secrets`
    (the config's, `secret_values`) never appear in a line, wherever they turn up. A `worker`
    of several (server.workers) says its index in every line."""
    global _REDACTOR
    out = stream or sys.stdout
    numeric = logging.getLevelNamesMapping()[level.upper()]
    LEVEL.debug = numeric <= logging.DEBUG
    _REDACTOR = Redactor(secrets)
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.format_exc_info,
        _REDACTOR,
        # After the redactor: the level and time are the proxy's own words.
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if worker is not None:
        processors.insert(0, _Worker(worker))
    if fmt == "json":
        processors.append(structlog.processors.JSONRenderer(serializer=_orjson_dumps))
        # orjson renders bytes: write them to the text stream's binary buffer underneath.
        factory: Any = structlog.BytesLoggerFactory(out.buffer)
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
        factory = structlog.PrintLoggerFactory(out)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    _route_stdlib_logging(numeric)

"""structlog set-up: one JSON line per event, with credentials redacted wherever they appear,
including in what aiohttp, asyncio and other libraries log through the standard logging module."""

from __future__ import annotations

import logging
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

import orjson
import structlog

from policies.core.credentials import is_credential_name
from proxy.redact import REDACTED, redact_bytes, redact_query, redact_text

__all__ = [
    "REDACTED",
    "Redactor",
    "configure_logging",
    "info_line",
    "learn_secrets",
    "redact_query",
    "redact_value",
    "reset_logging",
]

# Shorter configured values (`free`, `json`) are not hidden wherever they appear: they would
# hide ordinary words, and are no keys.
MIN_SECRET_CHARS = 8
# Field names whose verdict (a credential's name or not) a Redactor remembers: a line's names
# are the code's own, a few dozen; past this many, any more are judged each time.
NAMES_KEPT = 256


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
        self._names: dict[str, bool] = {}
        self.learn(secrets)

    def learn(self, secrets: Iterable[str]) -> None:
        """Hide these secrets too (a reloaded config's); those known already stay hidden, for
        requests still running on the config before."""
        self.secrets |= {s for s in secrets if len(s) >= MIN_SECRET_CHARS}
        known = sorted(self.secrets, key=len, reverse=True)
        self.known = re.compile("|".join(map(re.escape, known))) if known else None

    def _credential(self, key: str) -> bool:
        verdict = is_credential_name(key)
        if len(self._names) < NAMES_KEPT:
            self._names[key] = verdict
        return verdict

    def __call__(self, _: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        known, names = self.known, self._names
        for key, value in event.items():
            if value is None:
                continue
            kind = type(value)
            if kind is str:
                credential = names.get(key)
                if credential is None:
                    credential = self._credential(key)
                if credential:
                    event[key] = REDACTED
                else:
                    text = redact_text(value)
                    if known is not None:
                        text = known.sub(REDACTED, text)
                    if text is not value:
                        event[key] = text
            elif kind in _NUMBERS:  # a number is hidden under a credential's name only
                credential = names.get(key)
                if credential is None:
                    credential = self._credential(key)
                if credential:
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


class Stamp:
    """The structlog processor that times a line: ISO 8601 in UTC to the microsecond,
    `2026-11-29T04:45:44.838538Z`. The date and time of day are formatted once a second, not
    once a line, and the six digits are always there (lines sort as text)."""

    __slots__ = ("_now", "_second")

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self._now = now
        # The second and its text, as one tuple: a thread logging at once never pairs a
        # second with another second's text.
        self._second: tuple[int, str] = (-1, "")

    def __call__(self, _: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        now = self._now()
        second, text = self._second
        if int(now) != second:
            second = int(now)
            text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = (second, text)
        event["timestamp"] = f"{text}.{int((now - second) * 1_000_000):06d}Z"
        return event


class _InfoLines:
    """Writes an info line through the configured processors and logger, as `log.info` does,
    without structlog's bound-logger wrapper: its calls pass the fields as keywords three times
    over, a third of a line's cost. Used for the access line, written once per request.

    It holds structlog's own processor list and the logger its factory makes (the same file
    and lock), so the line is the one `log.info` would write; once structlog is configured
    anew (a reset, another set-up), it writes through structlog again. Processors changed in
    place (`structlog.testing.capture_logs`) are seen as they are."""

    __slots__ = ("_factory", "_logger", "_processors", "_wrapper")

    def __init__(self) -> None:
        config = structlog.get_config()
        self._processors: list[Any] = config["processors"]
        self._factory = config["logger_factory"]
        self._wrapper = config["wrapper_class"]  # its level is LEVEL.info's
        self._logger = self._factory()

    def current(self) -> bool:
        config = structlog.get_config()
        return (
            config["processors"] is self._processors
            and config["logger_factory"] is self._factory
            and config["wrapper_class"] is self._wrapper
        )

    def write(self, event: dict[str, Any]) -> None:
        logger = self._logger
        line: Any = event
        try:
            for processor in self._processors:
                line = processor(logger, "info", line)
        except structlog.DropEvent:
            return
        logger.msg(line)


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
    info = True


LEVEL = Level()
# The configured processors' own writer of info lines; None until configure_logging.
_INFO_LINES: _InfoLines | None = None


def info_line(event: dict[str, Any]) -> None:
    """`log.info(event["event"], **the rest)`, at a third less cost once configure_logging has
    run: for a line written once per request. `event` is the line's fields in order, "event"
    (its name) last; it is consumed."""
    lines = _INFO_LINES
    if lines is not None and lines.current():
        if LEVEL.info:  # the level configure_logging set, which structlog still has
            lines.write(event)
        return
    name = event.pop("event")
    structlog.get_logger("search_proxy").info(name, **event)


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
    global _REDACTOR, _INFO_LINES
    out = stream or sys.stdout
    numeric = logging.getLevelNamesMapping()[level.upper()]
    LEVEL.debug = numeric <= logging.DEBUG
    LEVEL.info = numeric <= logging.INFO
    _REDACTOR = Redactor(secrets)
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.format_exc_info,
        _REDACTOR,
        # After the redactor: the level and time are the proxy's own words.
        structlog.processors.add_log_level,
        Stamp(),
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
    _INFO_LINES = _InfoLines()
    _route_stdlib_logging(numeric)


def reset_logging() -> None:
    """Undo configure_logging: structlog's defaults, every level built, no redactor of its
    own. The standard logging module's handlers are the caller's to restore."""
    global _REDACTOR, _INFO_LINES
    structlog.reset_defaults()
    LEVEL.debug = LEVEL.info = True
    _REDACTOR = _INFO_LINES = None

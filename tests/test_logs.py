"""The process's log lines: their time, and the access line written once per request, which
takes a shorter way through the configured processors and must come out as `log.info` would."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable
from typing import Any

import structlog

from policies.core.flow import Trace
from proxy import logs
from proxy.access import access_line, route_fields
from proxy.logs import NAMES_KEPT, Redactor, Stamp, info_line
from proxy.redact import REDACTED

Configure = Callable[..., io.BytesIO]


class Request:
    method = "POST"
    path = "/tavily/search"
    query_string = "q=x&api_key=S1"


def lines(raw: io.BytesIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in raw.getvalue().splitlines()]


def stamps(*times: float) -> list[str]:
    clock = iter(times)
    stamp = Stamp(now=lambda: next(clock))
    return [stamp(None, "info", {})["timestamp"] for _ in times]


def test_a_line_is_timed_in_utc_to_the_microsecond_with_six_digits_always() -> None:
    assert stamps(0.0, 1764391544.5, 1764391544.25, 1764391545.0078125) == [
        "1970-01-01T00:00:00.000000Z",
        "2025-11-29T04:45:44.500000Z",
        "2025-11-29T04:45:44.250000Z",
        "2025-11-29T04:45:45.007812Z",  # the next second: its own time of day
    ]


def test_the_access_line_is_the_line_log_info_writes(configured_log: Configure) -> None:
    raw = configured_log("info", ("sk-config-secret-1",), worker=3)
    structlog.contextvars.bind_contextvars(session="Bearer S4-token")  # bound context: merged
    event = {
        "request_id": "sk-config-secret-1",  # a configured secret, wherever it is
        "route": "tavily",
        "api_key": "S2",  # a credential's name hides its value
        "detail": "Authorization: Bearer S3",
        "status": 200,
        "retries": ["429"],
        "cache": None,
        "event": "request",
    }
    assert logs._INFO_LINES is not None and logs._INFO_LINES.current()
    info_line(dict(event))
    fields = {name: value for name, value in event.items() if name != "event"}
    structlog.get_logger("search_proxy").info("request", **fields)
    structlog.contextvars.clear_contextvars()
    fast, slow = lines(raw)
    del fast["timestamp"], slow["timestamp"]
    assert list(fast) == list(slow) and fast == slow
    assert fast["worker"] == 3 and fast["session"] == REDACTED
    assert fast["request_id"] == fast["api_key"] == REDACTED
    assert fast["detail"] == f"Authorization: {REDACTED}" and fast["level"] == "info"
    assert not any(secret in raw.getvalue().decode() for secret in ("S2", "S3", "S4"))


def test_the_access_line_carries_the_requests_fields_redacted(configured_log: Configure) -> None:
    raw = configured_log("info")
    fields = route_fields(Trace(cache="hit"))
    access_line(Request, "rid-1", "tavily", 200, 0.0125, fields, cut=None, written=512, error=None)
    (line,) = lines(raw)
    assert line["event"] == "request" and line["request_id"] == "rid-1"
    assert line["query"] == f"q=x&api_key={REDACTED}" and line["duration_ms"] == 12.5
    assert line["cache"] == "hit" and line["bytes"] == 512 and line["level"] == "info"
    assert list(line)[-3:] == ["event", "level", "timestamp"]


def test_the_access_line_follows_structlog_when_it_is_set_up_again(
    configured_log: Configure,
) -> None:
    first = configured_log("info")
    with structlog.testing.capture_logs() as captured:  # processors changed in place
        info_line({"status": 200, "event": "request"})
    assert captured == [{"status": 200, "event": "request", "log_level": "info"}]
    assert first.getvalue() == b""
    second = configured_log("info")  # a new set-up: lines go where it says
    info_line({"status": 201, "event": "request"})
    structlog.reset_defaults()  # and where structlog's defaults say, once reset
    assert not logs._INFO_LINES.current()  # type: ignore[union-attr]
    info_line({"status": 202, "event": "request"})
    assert first.getvalue() == b""
    assert [line["status"] for line in lines(second)] == [201]


def test_console_lines_take_the_same_way(configured_log: Configure) -> None:
    raw = configured_log("info", fmt="console")
    info_line({"status": 200, "api_key": "S1", "event": "request"})
    structlog.get_logger("search_proxy").info("request", status=200, api_key="S1")
    fast, slow = (line.split(" ", 1)[1] for line in raw.getvalue().decode().splitlines())
    assert fast == slow and "status=200" in fast and f"api_key={REDACTED}" in fast
    assert "S1" not in raw.getvalue().decode()


def test_a_level_set_behind_configure_loggings_back_is_followed(configured_log: Configure) -> None:
    raw = configured_log("info")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    info_line({"status": 200, "event": "request"})
    assert raw.getvalue() == b""  # structlog's level now: error
    configured_log("warning")
    structlog.reset_defaults()  # structlog's defaults print every level again
    with structlog.testing.capture_logs() as captured:
        info_line({"status": 201, "event": "request"})
    assert captured == [{"status": 201, "event": "request", "log_level": "info"}]


def test_at_level_warning_no_access_line_is_written(configured_log: Configure) -> None:
    raw = configured_log("warning")
    info_line({"status": 200, "event": "request"})
    structlog.get_logger("search_proxy").warning("kept", status=500)
    assert [line["event"] for line in lines(raw)] == ["kept"]


def test_the_redactor_remembers_a_bounded_number_of_names() -> None:
    redactor = Redactor()
    event: dict[str, Any] = {f"field_{i}": "text" for i in range(NAMES_KEPT + 10)}
    event["x_api_key"] = "S1"  # named past the bound: judged, not remembered
    redacted = redactor(None, "info", event)
    assert len(redactor._names) == NAMES_KEPT
    assert redacted["x_api_key"] == REDACTED and redacted["field_0"] == "text"
    assert redactor(None, "info", {"x_api_key": "S2"})["x_api_key"] == REDACTED

"""Secrets never leave in clear: the naming rule, the redaction of query strings, URLs and free
text, the log processor and the bridge from the standard logging module (aiohttp, asyncio), and
what check-config prints."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable

import pytest
import structlog

from policies.core.credentials import is_credential_name
from proxy.config import ConfigError, parse_config, redacted, secret_values
from proxy.echo import EchoGuard
from proxy.guard import _problem
from proxy.logs import Redactor, redact_value
from proxy.redact import REDACTED, redact_bytes, redact_query, redact_text, redact_url

# Names from the issue and from vendors' documentation: every one is a credential by the rule.
CREDENTIAL_NAMES = [
    "Authorization",
    "Proxy-Authorization",
    "X-API-KEY",
    "x-api-key",
    "api_key",
    "apikey",
    "X-Goog-Api-Key",
    "X-Access-Token",
    "Jina-Key",
    "Ocp-Apim-Subscription-Key",
    "subscription-key",
    "access-token",
    "X-Subscription-Token",
    "Cookie",
    "Set-Cookie",
    "X-Amz-Security-Token",
    "X-Amz-Signature",
    "sig",
    "client_secret",
    "password",
    "passwd",
    "pwd",
    "X-Session-Id",
    "credentials",
    "admin_token",
]


@pytest.mark.parametrize("name", CREDENTIAL_NAMES)
def test_every_credential_name_is_recognised_whatever_its_case(name: str) -> None:
    assert is_credential_name(name)
    assert is_credential_name(name.upper())


@pytest.mark.parametrize(
    "name", ["q", "query", "Content-Type", "X-Request-Id", "Idempotency-Key", "User-Agent", "num"]
)
def test_ordinary_names_are_not_credentials(name: str) -> None:
    assert not is_credential_name(name)


# --- text -----------------------------------------------------------------------------------


def test_query_parameters_named_like_credentials_are_redacted() -> None:
    query = "q=x&subscription-key=S1&access-token=S2&x-api-key=S3&api%5Fkey=S4&key=S5&num=3"
    shown = redact_query(query)
    for secret in ("S1", "S2", "S3", "S4", "S5"):
        assert secret not in shown
    assert shown.startswith("q=x&subscription-key=<redacted>&") and shown.endswith("&num=3")
    assert redact_query(shown) == shown  # redacting twice changes nothing


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("Authorization: Bearer sk-S1", "sk-S1"),
        ('{"x-api-key": "S2", "query": "rust"}', "S2"),
        ("<CIMultiDict('X-Goog-Api-Key': 'S3', 'Host': 'a')>", "S3"),
        ("b'Ocp-Apim-Subscription-Key': b'S4'", "S4"),
        ("GET /search?q=x&access-token=S5 HTTP/1.1", "S5"),
        ("cannot connect to redis://:S6@127.0.0.1:6379/0", "S6"),
        ("sent Bearer abcdefS7 upstream", "abcdefS7"),
        ("password=S8", "S8"),
    ],
)
def test_credentials_in_free_text_are_redacted(text: str, secret: str) -> None:
    shown = redact_text(text)
    assert secret not in shown
    assert REDACTED in shown


def test_free_text_without_credentials_is_unchanged() -> None:
    for text in (
        "Error handling request from 127.0.0.1",
        "routes.tavily.headers.set.Authorization: expected a one-line string value",
        "upstream 127.0.0.1:8080 answered 503 after 12:30:45",
    ):
        assert redact_text(text) == text


def test_aiohttp_parse_errors_lose_the_bytes_they_quote() -> None:
    # aiohttp's pure-Python parser quotes the header line (or only its value) it refused.
    header = "Invalid HTTP header: b'Bearer sk-SECRET\\x01zz'"
    assert "sk-SECRET" not in redact_bytes(header)
    for message in (
        header,
        "Bad status line 'GET /v?api_key=sk-SECRET HTTP/1.1'",
        "400, message:\n  Invalid header value char:\n\n  b'Authorization: sk-SECRET\\x01'\n  ^",
    ):
        problem = _problem(None, message)
        assert "sk-SECRET" not in problem and problem
    # An apostrophe inside a word starts no quoted literal: llhttp's own words stay whole.
    message = (
        "Transfer-Encoding can't be present with Content-Length:\n\n"
        "  b'Transfer-Encoding: chunked'\n                      ^"
    )
    assert _problem(None, message) == "Transfer-Encoding can't be present with Content-Length"
    assert _problem(None, "Bad status line 'GET /v?k=sk-SECRET'") == "Bad status line"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw-1@db:6379/0", "redis://:<redacted>@db:6379/0"),
        ("rediss://default:pw-2@db:6380", "rediss://default:<redacted>@db:6380"),
        ("redis://token-3@db", "redis://<redacted>@db"),
        ("redis://db:6379/0?password=pw-4&db=1", "redis://db:6379/0?password=<redacted>&db=1"),
        ("unix:///run/redis.sock?password=pw-5", "unix:///run/redis.sock?password=<redacted>"),
        ("redis://db:6379/0", "redis://db:6379/0"),
    ],
)
def test_a_url_shows_no_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_credential_name_hides_the_whole_value_wherever_it_is_nested() -> None:
    event = {"headers": {"X-Goog-Api-Key": "S1", "Accept": "json"}, "credentials": {"t": "S2"}}
    shown = redact_value("event", event)
    assert shown == {
        "headers": {"X-Goog-Api-Key": REDACTED, "Accept": "json"},
        "credentials": REDACTED,
    }


def test_the_configs_own_secrets_are_hidden_in_any_text() -> None:
    headers = {"X-Plan": "plan-value-0001", "Authorization": "Bearer sk-abcdef123456", "X-S": "pro"}
    raw = {
        "server": {"admin_token": "op-4e9b2c7f1a8d3e6b"},
        "redis": {"url": "redis://:redis-pw-0001@db:6379/0"},
        "routes": {
            "r": {"prefix": "/r", "upstream": "https://r.example", "headers": {"set": headers}}
        },
    }
    redact = Redactor(secret_values(parse_config(raw, {})))
    event = redact(
        None,
        "error",
        {
            "event": "the vendor echoed plan-value-0001 and sk-abcdef123456 back",
            "detail": ["op-4e9b2c7f1a8d3e6b", {"why": "redis-pw-0001 refused"}],
            "plan": "a pro plan",  # a short value is no key: ordinary words stay
        },
    )
    assert event == {
        "event": "the vendor echoed <redacted> and <redacted> back",
        "detail": ["<redacted>", {"why": "<redacted> refused"}],
        "plan": "a pro plan",
    }


# --- the process's logging ------------------------------------------------------------------


@pytest.fixture
def json_log(configured_log: Callable[[str], io.BytesIO]) -> io.BytesIO:
    return configured_log("debug")


def lines(raw: io.BytesIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in raw.getvalue().splitlines()]


def test_log_lines_redact_credentials_at_every_level(json_log: io.BytesIO) -> None:
    log = structlog.get_logger("search_proxy")
    log.debug("request", query="q=x&subscription-key=S1", headers={"X-Access-Token": "S2"})
    log.error("failed", detail="Authorization: Bearer S3", jina_key="S4")
    text = json_log.getvalue().decode()
    for secret in ("S1", "S2", "S3", "S4"):
        assert secret not in text
    assert [line["level"] for line in lines(json_log)] == ["debug", "error"]


def test_aiohttp_and_asyncio_records_become_redacted_json_lines(json_log: io.BytesIO) -> None:
    try:
        raise ValueError("Invalid HTTP header: b'Bearer sk-SECRET-1\\x01'")
    except ValueError:
        logging.getLogger("aiohttp.server").exception("Error handling request from %s", "::1")
    logging.getLogger("asyncio").error("leaked %s", "X-Api-Key: SECRET-2")
    logging.getLogger("aiohttp.access").debug('"GET /v?access-token=SECRET-3 HTTP/1.1" 200')
    text = json_log.getvalue().decode()
    assert "SECRET" not in text
    server, loop, access = lines(json_log)
    assert server["logger"] == "aiohttp.server" and server["level"] == "error"
    assert server["event"] == "Error handling request from ::1"
    assert "ValueError: Invalid HTTP header" in str(server["exception"])
    assert loop["logger"] == "asyncio" and access["level"] == "debug"


# --- check-config ---------------------------------------------------------------------------


def test_check_config_shows_no_headers_set_value_nor_redis_password() -> None:
    keys = {
        "X-Goog-Api-Key": "goog-S1",
        "X-Access-Token": "access-S2",
        "Jina-Key": "jina-S3",
        "Ocp-Apim-Subscription-Key": "ocp-S4",
        "X-Plan": "plan-S5",  # any headers.set value, whatever its name
    }
    raw = {
        "redis": {"url": "redis://:pw-S6@127.0.0.1:6379/0?password=pw-S7"},
        "routes": {
            "r": {"prefix": "/r", "upstream": "https://r.example", "headers": {"set": keys}}
        },
        "profiles": {
            "acme": {
                "extends": "serpapi",
                "search_headers": {"X-Goog-Api-Key": "goog-S8", "Accept": "application/json"},
                "search_extra": {"subscription-key": "sub-S9", "engine": "bing"},
            }
        },
    }
    shown = str(redacted(parse_config(raw, {})))
    for secret in ("S1", "S2", "S3", "S4", "S5", "S6", "S7", "S8", "S9"):
        assert secret not in shown
    assert "application/json" in shown and "bing" in shown  # not credentials: shown


def test_a_config_error_never_quotes_a_secret() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"redis": {"url": "http://:pw-S1@db:6379"}, "routes": {}}, {})
    assert "pw-S1" not in str(info.value) and "redis.url" in str(info.value)
    with pytest.raises(ConfigError) as info:  # a number where the token's string belongs
        parse_config({"server": {"admin_token": 9876543210123456}, "routes": {}}, {})
    assert "9876543210123456" not in str(info.value)
    assert "server.admin_token: expected a non-empty string" in str(info.value)


STREAM_KEY = 'sk-"stream"-0123456789'  # a quote: its JSON-string form differs from it


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_a_stream_scrubbed_in_chunks_of_any_size_loses_every_held_secret(size: int) -> None:
    said = f"a: {STREAM_KEY}; b: {json.dumps(STREAM_KEY)[1:-1]}; s-end: s"
    body = f"data: {said}\n\n".encode()
    scrub = EchoGuard([STREAM_KEY]).stream("r")
    out = [scrub.feed(body[i : i + size]) for i in range(0, len(body), size)]
    out.append(scrub.end())
    assert b"".join(out) == b"data: a: <redacted>; b: <redacted>; s-end: s\n\n"


def test_a_stream_chunk_is_held_back_only_where_it_may_begin_a_secret() -> None:
    scrub = EchoGuard([STREAM_KEY]).stream("r")
    event = b"event: message\ndata: {}\n\n"
    assert scrub.feed(event) == event  # an event's end never waits for the next chunk
    assert scrub.feed(b'x sk-"str') == b"x "  # the start of the key waits ...
    assert scrub.feed(b"ange") == b'sk-"strange'  # ... and goes on once it is no key
    assert scrub.feed(b"sk") == b"" and scrub.end() == b"sk"  # the stream's end lets it go


@pytest.mark.parametrize(
    "secrets",
    [
        ["aaaabbbb", "aaaabbbbcc"],  # one key the start of another (a pool's two keys)
        ["keyAB123", "B123xyzzy9"],  # one key's end the start of another
        ["abababab12"],  # a key overlapping itself
    ],
)
def test_a_stream_cut_anywhere_goes_out_as_the_whole_answer_would(secrets: list[str]) -> None:
    guard = EchoGuard(secrets)
    body = ("x " + " ".join(secrets) + " abababab12 keyAB123xyzzy9 aaaabbbbcc y").encode()
    whole = guard.body(body, "r")
    assert not any(form in whole for form in guard.forms)
    for first in range(1, len(body)):
        for second in range(first, len(body), 3):
            scrub = guard.stream("r")
            pieces = (body[:first], body[first:second], body[second:])
            out = b"".join([*(scrub.feed(p) for p in pieces), scrub.end()])
            assert out == whole, (first, second)

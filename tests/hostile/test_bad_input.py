"""Bad input is a 400, never a 500, against a real proxy process: a control character in a
credential, JSON nested thousands deep on every endpoint; and the config values the report
found accepted (framing headers a route would set, ratios above 1, floors above any vendor's
rate) refused by check-config in one run, each line naming its YAML path."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from testkit.fakevendor import FakeVendor
from testkit.procs import ROOT
from testkit.proxyprocess import ProxyProcess
from tests.conftest import route

DEPTH = 5000
DEEP = b'{"a":' * DEPTH + b"1" + b"}" * DEPTH
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def proxy(fake: FakeVendor) -> Iterator[ProxyProcess]:
    url = fake.url  # type: ignore[attr-defined]
    config = {
        "routes": {
            "tavily": route(
                f"{url}/tavily", "/tavily", search={"vendor": "tavily"}, cache={"ttl": "1m"}
            ),
            "raw": route(url, "/raw"),
            "varied": route(f"{url}/tavily", "/varied", cache={"ttl": "1m", "vary": ["X-Tenant"]}),
            "limited": route(
                f"{url}/tavily",
                "/limited",
                rate_limit={
                    "rate": "100/s",
                    "burst": 100,
                    "key": "client",
                    "client_header": "X-Agent",
                },
            ),
        }
    }
    process = ProxyProcess(config).start()
    yield process
    process.stop()


def no_failure_logged(proxy: ProxyProcess) -> None:
    """No traceback, no 500 and no internal error in anything the proxy wrote."""
    text = "\n".join(proxy.lines)
    assert "Traceback" not in text and "RecursionError" not in text
    assert all(line["status"] < 500 for line in proxy.events("request"))


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/mcp", MCP_HEADERS),
        ("/v1/search", {}),
        ("/v1/fetch", {}),
        ("/tavily/search", {"Content-Type": "application/json"}),
        ("/raw/echo", {"Content-Type": "application/json"}),
    ],
)
async def test_json_nested_thousands_deep_is_a_400_on_every_endpoint(
    proxy: ProxyProcess, fake: FakeVendor, path: str, headers: dict[str, str]
) -> None:
    before = fake.count()
    async with aiohttp.ClientSession() as http:
        r = await http.post(proxy.url + path, data=DEEP, headers=headers)
        body = await r.json()
    assert r.status == 400
    assert r.headers["X-Proxy-Error"] == "bad_request"
    message = body["error"]["message"] if "error" in body else body["detail"]["error"]
    assert "nests deeper than 64 levels" in message
    assert fake.count() == before  # refused before any vendor call
    no_failure_logged(proxy)


async def test_a_credential_with_a_control_character_is_a_400(
    proxy: ProxyProcess, fake: FakeVendor
) -> None:
    before = fake.count()
    body = {"query": "control", "credentials": {"tavily": "tvly-abc\x01def"}}
    async with aiohttp.ClientSession() as http:
        r = await http.post(f"{proxy.url}/v1/search", json=body)
        error = (await r.json())["error"]
    assert r.status == 400 and error["type"] == "bad_request"
    assert error["message"].startswith("/v1/search: credentials.tavily is not a usable API key")
    assert "tvly-abc" not in error["message"]
    assert fake.count() == before
    no_failure_logged(proxy)


async def exchange(proxy: ProxyProcess, request: bytes) -> tuple[int, dict[str, str]]:
    """One raw request (bytes an HTTP client library would not send) and its answer's head."""
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()
    lines = head.decode("latin-1").split("\r\n")
    fields = (line.partition(":") for line in lines[1:] if line)
    return int(lines[0].split()[1]), {k.strip().lower(): v.strip() for k, _, v in fields}


def search(*headers: bytes, route: str = "tavily", query: str = "not utf-8") -> bytes:
    body = b'{"query": "%s"}' % query.encode()
    lines = [b"POST /%s/search HTTP/1.1" % route.encode(), b"Host: p"]
    lines += [b"Content-Type: application/json"]
    lines += [*headers, b"Content-Length: %d" % len(body)]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


# llhttp and aiohttp take a header's bytes that are not UTF-8 (obs-text), read with
# surrogateescape; the cache key, the per-client bucket and the admin token check took them.
NOT_UTF8 = [
    ("a credential header on a cached route", search(b"Authorization: Bearer \xff")),
    ("a cookie on a cached route", search(b"Cookie: s=\xe9")),
    ("a header the cache varies on", search(b"X-Tenant: \xff", route="varied")),
    ("the header a per-client limit reads", search(b"X-Agent: \xff", route="limited")),
    (
        "a credential header on aiohttp's path (chunked)",
        b"POST /tavily/search HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer \xff\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'11\r\n{"query": "utf8"}\r\n0\r\n\r\n',
    ),
]


@pytest.mark.parametrize("request_bytes", [r for _, r in NOT_UTF8], ids=[n for n, _ in NOT_UTF8])
async def test_a_header_value_that_is_not_utf8_is_forwarded_not_a_500(
    proxy: ProxyProcess, request_bytes: bytes
) -> None:
    status, _ = await exchange(proxy, request_bytes)
    assert status == 200
    no_failure_logged(proxy)


async def test_header_values_that_are_not_utf8_key_the_cache_by_their_bytes(
    proxy: ProxyProcess,
) -> None:
    answers = [
        (await exchange(proxy, search(b"X-Tenant: " + value, route="varied", query="k")))[1][
            "x-cache"
        ]
        for value in (b"\xff", b"\xff", b"\xfe", "\u00ff".encode(), b"\xff")
    ]
    # The same bytes share an entry; other bytes, or the UTF-8 of the character U+00FF that
    # 0xFF is in Latin-1, do not.
    assert answers == ["MISS", "HIT", "MISS", "MISS", "HIT"]


# The report's accepted values, and a few alike: each refused, naming its path.
ABSURD = {
    "headers": {
        "set": {
            "Content-Length": "5",
            "Transfer-Encoding": "chunked",
            "Host": "evil.example",
            "Connection": "keep-alive",
        },
        "remove": ["Host"],
    },
    "retry": {"budget": {"ratio": 1000, "min_per_s": 100000}},
    "hedge": {"budget": {"min_per_s": 1000000}},
}
EXPECTED = [
    "routes.a.headers.set.Content-Length: Content-Length is the proxy's own to write",
    "routes.a.retry.budget.ratio: expected a number from 0.0 to 1.0, got 1000",
    "routes.a.retry.budget.min_per_s: 100000 calls a second is more than any search vendor",
    "routes.a.hedge.budget.min_per_s: 1000000 calls a second is more than any search vendor",
]


@pytest.mark.parametrize("header", ["Transfer-Encoding", "Host", "Connection"])
def test_framing_and_hop_by_hop_headers_are_refused_in_headers_set(
    tmp_path: Path, header: str
) -> None:
    done = check_config(tmp_path, {"headers": {"set": {header: ABSURD["headers"]["set"][header]}}})
    assert done.returncode == 2
    assert f"routes.a.headers.set.{header}: {header} is the proxy's own to write" in done.stderr


def test_the_reports_absurd_values_are_refused_in_one_run(tmp_path: Path) -> None:
    done = check_config(tmp_path, ABSURD)
    assert done.returncode == 2
    for line in EXPECTED:
        assert line in done.stderr, done.stderr
    assert done.stdout == ""


def test_a_route_may_not_remove_what_the_proxy_writes(tmp_path: Path) -> None:
    done = check_config(tmp_path, {"headers": {"remove": ["X-Debug", "Content-Length"]}})
    assert done.returncode == 2
    assert "routes.a.headers.remove[1]: Content-Length is the proxy's own" in done.stderr


def check_config(
    tmp_path: Path, body: dict[str, Any], server: dict[str, Any] | None = None
) -> subprocess.CompletedProcess[str]:
    """`search-proxy check-config` on one route `a` searching Tavily, with `body` added (and
    a `server` section)."""
    a = {
        "prefix": "/a",
        "upstream": "http://127.0.0.1:9",
        "search": {"vendor": "tavily"},
        "fallback": {"providers": ["b"]},
        **body,
    }
    b = {"prefix": "/b", "upstream": "http://127.0.0.1:9", "search": {"vendor": "exa"}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"routes": {"a": a, "b": b}, "server": server or {}}))
    argv = [sys.executable, "-m", "proxy", "check-config", str(path)]  # this tree's proxy
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=30)

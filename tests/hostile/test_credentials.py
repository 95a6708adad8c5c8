"""Keys never leak and the cache never crosses credentials, against a real proxy process logging
at debug: every line it writes (stdout and stderr), its answers, check-config's output and the
admin listener's replies are searched for each secret, and none is found."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from typing import Any

import aiohttp
import pytest
import yaml

from testkit.fakevendor import FakeVendor
from testkit.procs import ROOT, free_port
from testkit.proxyprocess import ProxyProcess
from tests.conftest import route

ADMIN_TOKEN = "op-S3CR3T-4e9b2c7f1a8d3e6b"
# Keys the operator configures, in headers the old fixed list did not know.
SET_KEYS = {
    "X-Goog-Api-Key": "set-SECRET-goog",
    "X-Access-Token": "set-SECRET-access",
    "Jina-Key": "set-SECRET-jina",
    "Ocp-Apim-Subscription-Key": "set-SECRET-ocp",
}
PROFILE_KEY = "profile-SECRET-header"
REDIS_SECRETS = ("redis-SECRET-userinfo", "redis-SECRET-param")
# Keys agents send.
QUERY_KEYS = {
    "subscription-key": "qs-SECRET-1",
    "access-token": "qs-SECRET-2",
    "x-api-key": "qs-SECRET-3",
}
AGENT_KEYS = ("hdr-SECRET-bearer", "cookie-SECRET", "body-SECRET", "cred-SECRET")
MALFORMED_KEYS = (
    "bad-SECRET-ctl",
    "bad-SECRET-fold",
    "bad-SECRET-colon",
    "bad-SECRET-line",
    "bad-SECRET-target",
    "bad-SECRET-connect",
    "bad-SECRET-chunk",
)
SECRETS = (
    ADMIN_TOKEN,
    *SET_KEYS.values(),
    PROFILE_KEY,
    *REDIS_SECRETS,
    *QUERY_KEYS.values(),
    *AGENT_KEYS,
    *MALFORMED_KEYS,
)
# Request heads aiohttp refuses, each quoting the line it could not parse in its error (the
# pure-Python parser quotes it whole): a control character in the Authorization value, an
# obsolete line fold, a header without its colon, a control character in the request line;
MALFORMED = [
    b"POST /v/search HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer bad-SECRET-ctl\x01x\r\n\r\n",
    b"POST /v/search HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer\r\n bad-SECRET-fold\r\n\r\n",
    b"POST /v/search HTTP/1.1\r\nHost: a\r\nAuthorization Bearer bad-SECRET-colon\r\n\r\n",
    b"GET /v/search?api_key=bad-SECRET-line\x01 HTTP/1.1\r\nHost: a\r\n\r\n",
    # Refused with the agent's bytes as the whole message, unquoted: an absolute-form target
    # with a port out of range, a CONNECT authority, a chunk-size line (the pure-Python parser).
    b"GET http://h:99999999/v/bad-SECRET-target HTTP/1.1\r\nHost: a\r\n\r\n",
    b"CONNECT bad-SECRET-connect:xyz HTTP/1.1\r\nHost: a\r\n\r\n",
    b"POST /v/search HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"bad-SECRET-chunk\r\nxx\r\n0\r\n\r\n",
]


def config(vendor_url: str) -> dict[str, Any]:
    """Debug logging, an admin token, a Redis URL with passwords (nothing listens there: its
    errors are logged too), headers.set keys, and a custom profile sending its key in its own
    header, with a cache."""
    redis = f"redis://:{REDIS_SECRETS[0]}@127.0.0.1:{free_port()}/0?password={REDIS_SECRETS[1]}"
    return {
        "log": {"level": "debug"},
        "server": {"admin_token": ADMIN_TOKEN},
        "redis": {"url": redis, "timeout": "50ms"},
        "routes": {
            "v": route(f"{vendor_url}/tavily", "/v", headers={"set": SET_KEYS}),
            "g": route(
                f"{vendor_url}/tavily",
                "/g",
                search={"vendor": "goog", "on_empty": "pass"},
                cache={"ttl": "1m"},
            ),
        },
        "profiles": {"goog": {"extends": "tavily", "search_headers": {"X-Goog-Key": PROFILE_KEY}}},
    }


def raw_exchange(port: int, payload: bytes) -> bytes:
    """Send `payload` on a fresh connection; everything the proxy answers before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(payload)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def absent(text: str) -> list[str]:
    """The secrets found in `text` (none, when nothing leaked)."""
    return [secret for secret in SECRETS if secret in text]


@pytest.mark.parametrize("parser", ["C", "pure-Python"])
async def test_no_key_reaches_a_log_line_an_answer_or_an_admin_reply(
    vendor: FakeVendor, parser: str
) -> None:
    env = {"AIOHTTP_NO_EXTENSIONS": "1"} if parser == "pure-Python" else {}
    proxy = ProxyProcess(config(vendor.url), env=env)
    await asyncio.to_thread(proxy.start)
    answers: list[str] = []
    try:
        async with aiohttp.ClientSession() as http:
            r = await http.post(
                f"{proxy.url}/v/search",
                params={"q": "x", **QUERY_KEYS},
                json={"query": "leak test", "api_key": "body-SECRET"},
                headers={"Authorization": "Bearer hdr-SECRET-bearer", "Cookie": "s=cookie-SECRET"},
            )
            answers.append(await r.text())
            assert r.status == 200
            assert vendor.last.headers["X-Goog-Api-Key"] == "set-SECRET-goog"  # sent intact
            r = await http.post(
                f"{proxy.url}/v1/search",
                json={
                    "query": "leak test",
                    "providers": ["g"],
                    "credentials": {"g": "cred-SECRET"},
                },
            )
            answers.append(await r.text())
            assert r.status == 200
            for payload in MALFORMED:
                answer = await asyncio.to_thread(raw_exchange, proxy.port, payload)
                answers.append(answer.decode("latin-1"))
                assert answer.startswith(b"HTTP/1.1 400 "), answer[:80]
            auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            for method, path in (("GET", "/admin/breakers"), ("DELETE", "/admin/cache/g")):
                r = await http.request(method, proxy.admin_url + path, headers=auth)
                answers.append(await r.text())
                assert r.status == 200, answers[-1]
            r = await http.get(
                proxy.admin_url + "/admin/breakers",
                headers={"Authorization": "Bearer hdr-SECRET-bearer"},
            )
            answers.append(await r.text())
            assert r.status == 401
    finally:
        assert await asyncio.to_thread(proxy.stop) == 0
    lines = "\n".join(proxy.lines)
    assert absent(lines) == [], lines
    assert absent("\n".join(answers)) == []
    # Every level was on, and the lines that would have shown the keys were written.
    calls = [e for e in proxy.events("upstream_call") if e.get("route") == "v"]
    assert calls and calls[0]["level"] == "debug" and calls[0]["result"] == 200
    accessed = [e for e in proxy.events("request") if e.get("route") == "v"]
    assert "subscription-key=<redacted>" in accessed[0]["query"]
    assert len([e for e in proxy.events("request") if e.get("status") == 400]) == len(MALFORMED)


def test_check_config_prints_no_key(tmp_path: Any) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(config("http://127.0.0.1:1")))
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", str(f)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert absent(result.stdout + result.stderr) == []
    shown = yaml.safe_load(result.stdout)
    assert shown["routes"]["v"]["headers"]["set"] == dict.fromkeys(SET_KEYS, "<redacted>")
    assert shown["redis"]["url"].startswith("redis://:<redacted>@127.0.0.1:")
    assert shown["redis"]["url"].endswith("/0?password=<redacted>")
    # A bad Redis URL is reported without its password.
    bad = config("http://127.0.0.1:1")
    bad["redis"]["url"] = f"http://:{REDIS_SECRETS[0]}@127.0.0.1:6379"
    f.write_text(yaml.safe_dump(bad))
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", str(f)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "redis.url" in result.stderr
    assert absent(result.stdout + result.stderr) == []


async def test_a_custom_profiles_key_in_its_own_header_never_shares_a_cache_entry(
    vendor: FakeVendor,
) -> None:
    proxy = ProxyProcess(config(vendor.url))
    await asyncio.to_thread(proxy.start)
    try:
        async with aiohttp.ClientSession() as http:

            async def ask(**headers: str) -> str:
                r = await http.post(
                    f"{proxy.url}/g/search", json={"query": "same"}, headers=headers
                )
                assert r.status == 200
                return r.headers["X-Cache"]

            assert await ask(**{"X-Goog-Api-Key": "KEY-A"}) == "MISS"
            assert await ask(**{"X-Goog-Api-Key": "KEY-B"}) == "MISS"  # KEY-A's answer: never
            assert await ask(**{"X-Goog-Api-Key": "KEY-A"}) == "HIT"
            assert await ask(**{"X-Goog-Api-Key": "KEY-B"}) == "HIT"
            assert await ask(Cookie="session=A") == "MISS"
            assert await ask(Cookie="session=B") == "MISS"
            assert await ask(Cookie="session=A") == "HIT"
        assert vendor.count("/tavily") == 4
    finally:
        assert await asyncio.to_thread(proxy.stop) == 0

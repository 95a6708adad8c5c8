"""The admin listener against the pages an operator's browser opens, on a real proxy process
without a token: a cross-site form cannot reset a breaker, a rebound name cannot purge a cache,
another port of 127.0.0.1 is another site; and a guessable token stops the proxy at start-up."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from testkit.fakevendor import FakeVendor
from testkit.procs import ROOT
from testkit.proxyprocess import ProxyProcess
from tests.conftest import route

# The report's tokens, all accepted before (16+ visible characters).
WEAK = [
    "password12345678",
    "aaaaaaaaaaaaaaaaaaaaaaaa",
    "REPLACE_ME_REPLACE_ME",
    "local-admin-token",
]


@pytest.fixture(scope="module")
def proxy(fake: FakeVendor) -> Iterator[ProxyProcess]:
    breaker = {"fail_max": 1, "reset_timeout": "1h"}
    config = {
        "routes": {
            "v": route(
                f"{fake.url}/tavily",  # type: ignore[attr-defined]
                "/v",
                breaker=breaker,
                cache={"ttl": "1h"},
            )
        }
    }
    process = ProxyProcess(config).start()
    yield process
    process.stop()


async def admin(proxy: ProxyProcess, method: str, path: str, **headers: str) -> tuple[int, Any]:
    """The admin listener's status and JSON answer to a call with these headers (Host, Origin
    and Content-Type as a page's browser would send them)."""
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, proxy.admin_url + path, headers=headers) as r,
    ):
        return r.status, await r.json()


async def breaker_state(proxy: ProxyProcess) -> str:
    return str((await admin(proxy, "GET", "/admin/breakers"))[1]["breakers"]["v"]["state"])


async def test_a_cross_site_form_cannot_reset_a_breaker(
    proxy: ProxyProcess, fake: FakeVendor
) -> None:
    fake.down(path_prefix="/tavily")
    try:
        async with aiohttp.ClientSession() as http:
            await http.post(f"{proxy.url}/v/search", json={"query": "trip it"})
    finally:
        fake.up()
    assert await breaker_state(proxy) == "open"
    host = f"127.0.0.1:{proxy.admin_port}"
    form = {"Content-Type": "text/plain"}
    # The report's: a text/plain POST from a page elsewhere, and from another port here.
    for origin in ("http://evil.example", f"http://127.0.0.1:{proxy.port}", "null"):
        status, body = await admin(
            proxy, "POST", "/admin/breakers/v/reset", Host=host, Origin=origin, **form
        )
        assert status == 403 and body["error"]["type"] == "forbidden", origin
    # Loopback, no Origin, but a simple form's content type: still refused.
    status, body = await admin(proxy, "POST", "/admin/breakers/v/reset", **form)
    assert status == 403 and "X-Requested-By" in body["error"]["message"]
    assert await breaker_state(proxy) == "open"
    # The operator's own call (curl, or the listener's own page).
    status, body = await admin(
        proxy, "POST", "/admin/breakers/v/reset", **{"X-Requested-By": "operator"}
    )
    assert status == 200 and body["state"] == "closed"


async def test_a_rebound_name_cannot_purge_a_cache(proxy: ProxyProcess) -> None:
    json_body = {"Content-Type": "application/json"}
    rebound = f"attacker.example:{proxy.admin_port}"
    status, body = await admin(proxy, "DELETE", "/admin/cache/v", Host=rebound, **json_body)
    assert status == 403 and body["error"]["type"] == "forbidden"
    status, _ = await admin(proxy, "DELETE", "/admin/cache/v", **json_body)
    assert status == 200


def test_a_guessable_admin_token_stops_the_proxy_before_it_listens(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"routes": {"v": route("http://127.0.0.1:9", "/v")}}))

    def start(token: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "proxy", "--config", str(config), "--port", "0"]
        env = {"PATH": "/usr/bin:/bin", "SEARCH_PROXY_ADMIN_TOKEN": token}
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)

    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(start, WEAK))
    for token, result in zip(WEAK, done, strict=True):
        assert result.returncode == 2, (token, result.stderr)
        assert "SEARCH_PROXY_ADMIN_TOKEN:" in result.stderr
        assert "generate one with `openssl rand -hex 32`" in result.stderr
        assert token not in result.stderr + result.stdout
        assert "listening" not in result.stdout

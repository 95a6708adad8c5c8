"""The proxy as users run it: a separate process, its exit codes, its log lines, SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import aiohttp

from tests.conftest import route
from tests.fakevendor import Fault
from tests.proxyprocess import ROOT, ProxyProcess
from tests.redisserver import free_port


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args], cwd=ROOT, capture_output=True, text=True, timeout=30
    )


def test_bad_config_exits_2_naming_the_path_before_listening(tmp_path):
    port = free_port()
    f = tmp_path / "bad.yaml"
    f.write_text(
        f"server: {{port: {port}}}\nroutes:\n  tavily:\n    prefix: /tavily\n"
        "    upstream: https://api.tavily.com\n    timeouts: {per_try: ten}\n"
    )
    result = run_cli("--config", str(f))
    assert result.returncode == 2
    assert 'routes.tavily.timeouts.per_try: expected a duration like 10s, got "ten"' in (
        result.stderr
    )
    assert "listening" not in result.stdout


def test_missing_config_file_exits_2(tmp_path):
    result = run_cli("--config", str(tmp_path / "absent.yaml"))
    assert result.returncode == 2
    assert "cannot read config" in result.stderr


def test_check_config_prints_effective_config_with_secrets_redacted(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "routes:\n  tavily:\n    prefix: /tavily\n    upstream: https://api.tavily.com\n"
        '    headers: {set: {Authorization: "Bearer sk-very-secret"}}\n'
    )
    result = run_cli("check-config", str(f))
    assert result.returncode == 0, result.stderr
    assert "sk-very-secret" not in result.stdout
    assert "Authorization: <redacted>" in result.stdout
    assert "per_try: 10.0" in result.stdout
    bad = run_cli("check-config", str(tmp_path / "nope.yaml"))
    assert bad.returncode == 2


async def test_credentials_are_redacted_in_log_lines(vendor):
    config = {"routes": {"v": route(vendor.url, "/v")}}
    proxy = ProxyProcess(config)
    await asyncio.to_thread(proxy.start)
    try:
        async with aiohttp.ClientSession() as http:
            r = await http.post(
                f"{proxy.url}/v/echo?q=weather&api_key=query-secret-1",
                json={"query": "weather", "api_key": "body-secret-2"},
                headers={
                    "Authorization": "Bearer header-secret-3",
                    "X-API-KEY": "header-secret-4",
                },
            )
            assert r.status == 200
        lines = await asyncio.to_thread(proxy.wait_for_event, "request")
    finally:
        assert await asyncio.to_thread(proxy.stop) == 0
    assert vendor.last.headers["Authorization"] == "Bearer header-secret-3"  # forwarded intact
    line = lines[0]
    assert line["route"] == "v" and line["status"] == 200 and line["attempts"] == 1
    assert line["query"] == "q=weather&api_key=<redacted>"
    everything = "\n".join(proxy.lines)
    for secret in ("query-secret-1", "body-secret-2", "header-secret-3", "header-secret-4"):
        assert secret not in everything


async def test_sigterm_drains_in_flight_requests_then_exits_0(vendor):
    config = {
        "server": {"shutdown_grace": "5s"},
        "routes": {"v": route(vendor.url + "/tavily", "/v")},
    }
    vendor.script(Fault.hang(0.3))
    proxy = ProxyProcess(config)
    await asyncio.to_thread(proxy.start)
    async with aiohttp.ClientSession() as http:
        slow = asyncio.create_task(http.post(f"{proxy.url}/v/search", json={"query": "slow one"}))
        await vendor.wait_for_requests(1)
        proxy.proc.send_signal(signal.SIGTERM)
        r = await slow
        assert r.status == 200
        assert (await r.json())["results"]
        code = await asyncio.to_thread(proxy.proc.wait, 10)
        assert code == 0
        try:
            await http.get(f"{proxy.url}/healthz")
            raise AssertionError("still accepting connections after shutdown")
        except aiohttp.ClientConnectionError:
            pass
    assert proxy.events("stopped")

"""The proxy as users run it: a separate process, its exit codes, its log lines, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp
import pytest

from testkit.fakevendor import Fault
from testkit.procs import ROOT, free_port
from testkit.proxyprocess import ProxyProcess
from tests.conftest import route


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


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_sigterm_drains_in_flight_requests_then_exits_0(vendor, loop):
    """On each event loop `server.event_loop` can name (the listening line says which runs)."""
    config = {
        "server": {"shutdown_grace": "5s", "event_loop": loop},
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
    assert await asyncio.to_thread(proxy.stop) == 0  # exited already: this reads its last lines
    assert proxy.events("stopped")
    (listening,) = proxy.events("listening")
    assert listening["event_loop"] == loop
    assert listening["redis"] == "in-process state" and "redis_parser" not in listening


def test_check_config_help_prints_its_usage_and_exits_0():
    for flag in ("--help", "-h"):
        result = run_cli("check-config", flag)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: search-proxy check-config [-h] FILE")
        assert "cannot read config" not in result.stdout + result.stderr
    top = run_cli("--help")
    assert top.returncode == 0
    assert "check-config" in top.stdout and "--port PORT" in top.stdout


def test_every_config_mistake_is_reported_before_listening(tmp_path):
    port = free_port()
    f = tmp_path / "bad.yaml"
    f.write_text(
        f"server: {{port: {port}}}\nroutes:\n"
        "  tavily:\n    prefix: /tavily\n    upstream: https://api.tavily.com\n"
        "    timeouts: {per_try: ten}\n    retry: {attempts: 0}\n"
        "  brave:\n    prefix: /brave\n    upstream: ftp://brave\n"
    )
    expected = [
        'routes.tavily.timeouts.per_try: expected a duration like 10s, got "ten"',
        "routes.tavily.retry.attempts: expected a whole number from 1 to 10, got 0",
        "routes.brave.upstream: expected an http(s) URL like https://api.tavily.com, got "
        "'ftp://brave'",
    ]
    for args in (("check-config", str(f)), ("--config", str(f))):
        result = run_cli(*args)
        assert result.returncode == 2, args
        assert result.stderr.splitlines() == [f"search-proxy: config error: {e}" for e in expected]
        assert result.stdout == ""  # no effective config printed, no "listening" event


_MAKE_STATE = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")


def test_make_run_passes_port_admin_port_and_host_only_when_given():
    def dry_run(*args: str, **env: str) -> str:
        # A top-level make even when this suite runs under `make test` (no inherited state).
        clean = {k: v for k, v in os.environ.items() if k not in _MAKE_STATE}
        out = subprocess.run(
            ["make", "--no-print-directory", "-n", "run", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            env={**clean, **env},
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()[-1]

    serve = ".venv/bin/search-proxy --config"
    assert dry_run() == f"{serve} config.yaml"
    assert dry_run(PORT="9000", HOST="0.0.0.0") == f"{serve} config.yaml"  # environment ignored
    assert dry_run("PORT=9000") == f"{serve} config.yaml --port 9000"
    assert dry_run("CONFIG=o.yaml", "HOST=0.0.0.0", "PORT=9000") == (
        f"{serve} o.yaml --host 0.0.0.0 --port 9000"
    )
    assert dry_run("PORT=9000", "ADMIN_PORT=9001") == (
        f"{serve} config.yaml --port 9000 --admin-port 9001"
    )
    assert dry_run(ADMIN_PORT="9001") == f"{serve} config.yaml"  # environment ignored


def test_uvloop_named_but_not_installed_is_a_config_error(monkeypatch):
    from proxy import loops
    from proxy.config import ConfigError, parse_config

    monkeypatch.setattr(loops, "uvloop_installed", lambda: False)
    raw = {"server": {"event_loop": "uvloop"}, "routes": {"v": route("http://127.0.0.1:1", "/v")}}
    with pytest.raises(ConfigError) as info:
        parse_config(raw, {})
    assert str(info.value).startswith("server.event_loop: uvloop is not installed: pip install")
    assert loops.chosen("auto") == "asyncio"  # auto falls back to asyncio's own loop


async def test_the_first_mcp_call_leaves_the_loop_serving_while_the_mcp_package_loads(vendor):
    """The engine is built on the first /mcp request; its package (~0.6 s of imports) loads off
    the loop: other agents' requests meanwhile wait a GIL switch, not the whole import."""
    config = {
        "routes": {"tavily": route(f"{vendor.url}/tavily", "/tavily", search={"vendor": "tavily"})}
    }
    proxy = ProxyProcess(config)
    await asyncio.to_thread(proxy.start, 20.0)
    ping = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    accept = {"Accept": "application/json, text/event-stream"}
    try:
        async with aiohttp.ClientSession() as http:
            waits: list[float] = []
            calling = asyncio.Event()

            async def others() -> None:
                loop = asyncio.get_running_loop()
                while calling.is_set():
                    asked = loop.time()
                    async with http.get(f"{proxy.url}/healthz") as r:
                        assert r.status == 200
                    waits.append(loop.time() - asked)

            calling.set()
            beat = asyncio.create_task(others())
            started = asyncio.get_running_loop().time()
            async with http.post(f"{proxy.url}/mcp", json=ping, headers=accept) as r:
                assert r.status == 200
                tools = (await r.json())["result"]["tools"]
            took = asyncio.get_running_loop().time() - started
            calling.clear()
            await beat
    finally:
        proxy.stop()
    assert "web_search" in {t["name"] for t in tools}
    # Measured: 316-389 answered, the longest wait 17 ms, during a first call of 606-815 ms;
    # 6-7 answered, the longest wait the whole import (517-635 ms), when it loaded on the loop.
    assert len(waits) >= 10 and max(waits) < took / 2, (len(waits), max(waits), took)


def mapped_files(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as maps:
        return maps.read()


async def test_redis_py_loads_only_when_redis_is_configured(vendor, redis_server):
    """redis-py and what it imports cost a process ~7 MiB: a proxy with in-process state (the
    shipped config, `make run`) never loads it, even serving a route with every shared policy;
    one with Redis does, and its C parser (hiredis, a shared object mapped into the process:
    what is seen from outside) with it."""
    policies = {
        "cache": {"ttl": "1m"},
        "breaker": {"fail_max": 3, "reset_timeout": "10s"},
        "rate_limit": {"rate": "100/s", "burst": 10},
    }
    routes = {"tavily": route(f"{vendor.url}/tavily", "/tavily", **policies)}
    seen = {}
    for name, config in (
        ("in-process", {"routes": routes}),
        ("redis", {"routes": routes, "redis": {"url": redis_server.url}}),
    ):
        proxy = ProxyProcess(config)
        await asyncio.to_thread(proxy.start, 20.0)
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(2):  # a miss and a hit
                    async with http.post(f"{proxy.url}/tavily/search", json={"query": "q"}) as r:
                        assert r.status == 200
            assert proxy.proc is not None
            seen[name] = "hiredis" in mapped_files(proxy.proc.pid)
        finally:
            proxy.stop()
    shipped = ProxyProcess(None, config_path=str(ROOT / "config.yaml"))
    await asyncio.to_thread(shipped.start, 20.0)
    try:
        assert shipped.proc is not None
        seen["shipped"] = "hiredis" in mapped_files(shipped.proc.pid)
    finally:
        shipped.stop()
    assert seen == {"in-process": False, "redis": True, "shipped": False}

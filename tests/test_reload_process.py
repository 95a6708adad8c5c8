"""Reloading a running proxy process while agents use it: SIGHUP, POST /admin/reload and a
Kubernetes-style ConfigMap symlink swap, 20 times in 10 s under 10 concurrent agents, without
one failed request; an invalid config changes nothing and the process stays up."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from proxy.reload import config_hash
from testkit.fakevendor import Fault
from testkit.proxyprocess import ProxyProcess
from testkit.waiting import eventually
from tests.conftest import route

AGENTS = 10
RUN_S = 10.0
RELOADS = 20


class ConfigMap:
    """A ConfigMap as kubelet mounts it: config.yaml -> ..data/config.yaml, ..data -> ..vN;
    each `publish` writes a new ..vN and swaps ..data to it atomically."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.versions = 0
        self.path = root / "config.yaml"

    def publish(self, raw: dict[str, Any]) -> str:
        """Swap in `raw`; the hash of the file the proxy will read."""
        self.versions += 1
        version = f"..v{self.versions}"
        (self.root / version).mkdir()
        text = yaml.safe_dump(raw).encode()
        (self.root / version / "config.yaml").write_bytes(text)
        os.symlink(version, self.root / "..data.tmp")
        os.replace(self.root / "..data.tmp", self.root / "..data")
        if not self.path.is_symlink():
            os.symlink("..data/config.yaml", self.path)
        return config_hash(text)


def config(vendor: Any, step: int) -> dict[str, Any]:
    """Step `step`'s config: every step changes the agents' route (its retry section) and
    search_api; from step 10 on a route `added` is there. Route `flaky` never changes."""
    routes = {
        "tavily": route(
            vendor.url + "/tavily",
            "/tavily",
            search={"vendor": "tavily"},
            retry={"attempts": 2 + step % 2, "on": ["5xx"]},
            cache={"ttl": "1m"},
            rate_limit={"rate": "5000/s", "burst": 500},
            breaker={"fail_max": 50, "reset_timeout": "30s"},
        ),
        "flaky": route(
            vendor.url + "/echo", "/flaky", breaker={"fail_max": 1, "reset_timeout": "60s"}
        ),
    }
    if step >= 10:
        routes["added"] = route(vendor.url + "/echo", "/added")
    return {"search_api": {"max_results": 1 + step}, "routes": routes}  # each step its own


async def agent(session: aiohttp.ClientSession, url: str, n: int, until: float, seen: list[Any]):
    i = 0
    while time.monotonic() < until:
        i += 1
        try:
            async with session.post(
                f"{url}/tavily/search", json={"query": f"agent {n} query {i % 40}"}
            ) as r:
                await r.read()
                seen.append(r.status)
        except aiohttp.ClientError as exc:
            seen.append(repr(exc))


async def applied(proxy: ProxyProcess, digest: str, within: float = 5.0) -> dict[str, Any]:
    """The log line of the reload that applied the config with hash `digest`."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for line in proxy.events("config_reload"):
            if line["hash"] == digest and line["result"] == "applied":
                return line
        await asyncio.sleep(0.02)
    raise AssertionError(f"config {digest} was not applied:\n" + "\n".join(proxy.lines[-20:]))


async def reload_twenty_times(
    proxy: ProxyProcess,
    mount: ConfigMap,
    vendor: Any,
    session: aiohttp.ClientSession,
    started: float,
    lines: list[dict[str, Any]],
) -> None:
    """Publish a new config every 0.42 s and have it reloaded by SIGHUP, POST /admin/reload or
    (every fifth) the watch alone; each reload's log line goes to `lines`."""
    for step in range(1, RELOADS + 1):
        await asyncio.sleep(max(0.0, started + step * 0.42 - time.monotonic()))
        digest = mount.publish(config(vendor, step))
        if step % 5 == 2:
            trigger = "watch"  # the swap alone: the proxy notices it by itself
        elif step % 2:
            trigger = "signal"
            os.kill(proxy.child.pid, signal.SIGHUP)  # type: ignore[union-attr]
        else:
            trigger = "admin"
            reload = f"{proxy.admin_url}/admin/reload"
            async with session.post(reload, headers={"X-Requested-By": "test"}) as r:
                assert r.status == 200 and (await r.json())["hash"] == digest
        line = await applied(proxy, digest)
        assert line["trigger"] == trigger, line
        lines.append(line)


async def test_twenty_reloads_under_ten_agents_fail_no_request(vendor: Any, tmp_path: Path) -> None:
    mount = ConfigMap(tmp_path)
    mount.publish(config(vendor, 0))
    vendor.latency(0.01)  # requests are in flight across every swap
    proxy = ProxyProcess(None, config_path=str(mount.path)).start()
    try:
        async with aiohttp.ClientSession() as session:
            vendor.script(Fault.status(503), path_prefix="/echo")
            async with session.get(f"{proxy.url}/flaky/trip") as r:
                assert r.status == 503
            tripped = time.monotonic()
            started = time.monotonic()
            statuses: list[Any] = []
            agents = [
                asyncio.create_task(agent(session, proxy.url, n, started + RUN_S, statuses))
                for n in range(AGENTS)
            ]
            lines = []
            try:
                await reload_twenty_times(proxy, mount, vendor, session, started, lines)
                await asyncio.gather(*agents)
            finally:
                for task in agents:
                    task.cancel()
            elapsed = time.monotonic() - started
            print(f"{len(statuses)} requests in {elapsed:.1f} s, {RELOADS} reloads")

            failed = [s for s in statuses if s != 200]
            assert not failed, f"{len(failed)} of {len(statuses)} requests failed: {failed[:5]}"
            assert len(statuses) > 200 and elapsed < RUN_S + 5  # 11-15k on an idle machine
            assert [line["result"] for line in lines] == ["applied"] * RELOADS
            assert {line["trigger"] for line in lines} == {"signal", "admin", "watch"}
            assert lines[9]["routes"]["added"] == ["added"]
            assert all(line["kept"]["flaky"] == ["breaker"] for line in lines)
            async with session.get(f"{proxy.url}/added/hello") as r:
                assert r.status == 200
            async with session.get(f"{proxy.admin_url}/admin/status") as r:
                status = await r.json()
            (flaky,) = [r for r in status["routes"] if r["name"] == "flaky"]
            assert flaky["breaker"]["state"] == "open"
            # Open since before the first reload: the same breaker, not a new one.
            assert flaky["breaker"]["for_s"] >= time.monotonic() - tripped - 1
            async with session.get(f"{proxy.url}/metrics") as r:
                text = await r.text()
            assert f'search_proxy_config_reloads_total{{result="applied"}} {RELOADS}.0' in text
            assert f'search_proxy_config_info{{hash="{lines[-1]["hash"]}"}} 1.0' in text
        assert proxy.child is not None and proxy.child.alive()
    finally:
        assert proxy.stop() == 0


async def test_an_invalid_config_on_sighup_changes_nothing(vendor: Any, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    raw = config(vendor, 0)
    path.write_text(yaml.safe_dump(raw))
    proxy = ProxyProcess(None, config_path=str(path)).start()
    try:
        raw["routes"]["tavily"]["rate_limit"]["rate"] = "lots"
        raw["routes"]["added"] = route(vendor.url + "/echo", "/added")
        path.write_text(yaml.safe_dump(raw))
        os.kill(proxy.child.pid, signal.SIGHUP)  # type: ignore[union-attr]
        await eventually(lambda: bool(proxy.events("config_reload")), within=5)
        (line,) = proxy.events("config_reload")
        assert line["result"] == "failed" and line["level"] == "error"
        assert line["errors"] and line["errors"][0].startswith("routes.tavily.rate_limit.rate: ")
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{proxy.url}/tavily/search", json={"query": "q"}) as r:
                assert r.status == 200  # the old config serves on
            async with session.get(f"{proxy.url}/added/x") as r:
                assert r.status == 404  # nothing of the new one was applied
        assert proxy.child is not None and proxy.child.alive()
    finally:
        assert proxy.stop() == 0

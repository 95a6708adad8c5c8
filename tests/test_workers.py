"""`server.workers: 2` as users run it: a supervisor and two worker processes on one port, with a
real redis-server; a burst meets one shared limit, a killed worker comes back, SIGTERM drains
every worker, SIGHUP and POST /admin/reload reload every worker, /metrics adds them up."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from proxy.supervisor import Plan, Supervisor
from testkit.fakevendor import Fault
from testkit.procs import ROOT, free_port
from testkit.proxyprocess import ProxyProcess
from testkit.redisserver import RedisServer
from testkit.waiting import eventually
from tests.conftest import route

# Each request on a connection of its own: SO_REUSEPORT spreads connections, not requests, so
# many connections land on both workers (all of 40 on one: 2 in 2^40).
SPREAD = 40

CHANGE = {"X-Requested-By": "test"}  # what a call that changes something needs without a token


def fleet_config(vendor_url: str, redis: RedisServer, **routes: Any) -> dict[str, Any]:
    return {
        "server": {"workers": 2, "shutdown_grace": "5s", "watch_config": False},
        "redis": {"url": redis.url},
        "routes": {"v": route(vendor_url, "/v"), **routes},
    }


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        yield s


async def post_many(http: aiohttp.ClientSession, url: str, n: int = SPREAD) -> list[int]:
    """POST `n` searches at once, each on a new connection; their statuses."""

    async def one(i: int) -> int:
        async with http.post(url, json={"query": f"q{i}"}) as r:
            await r.read()
            return r.status

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def served_by(proxy: ProxyProcess, route_name: str = "v") -> Counter[int]:
    """Request log lines of a route, by the worker that wrote them."""
    return Counter(e["worker"] for e in proxy.events("request") if e.get("route") == route_name)


async def served(proxy: ProxyProcess, route_name: str, n: int = SPREAD) -> Counter[int]:
    """`served_by` once all `n` lines are in. A worker writes a request's line after its answer,
    and this process reads the lines in a thread: the agent can hold every answer before the
    last lines are read (a worker just restarted answers last, so its lines all come late)."""
    await eventually(lambda: sum(served_by(proxy, route_name).values()) >= n, within=5.0)
    return served_by(proxy, route_name)


async def metric(http: aiohttp.ClientSession, proxy: ProxyProcess, line_start: str) -> float:
    """The value of the first /metrics line starting with `line_start`."""
    async with http.get(f"{proxy.url}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {line_start!r} in /metrics")


async def started(config: dict[str, Any]) -> ProxyProcess:
    proxy = ProxyProcess(config)
    await asyncio.to_thread(proxy.start, 20.0)
    return proxy


async def started_from(path: Path, config: dict[str, Any]) -> ProxyProcess:
    """A fleet on `config` written to `path`, which SIGHUP and POST /admin/reload read again."""
    await asyncio.to_thread(path.write_text, yaml.safe_dump(config))
    proxy = ProxyProcess(None, config_path=str(path))
    await asyncio.to_thread(proxy.start, 20.0)
    return proxy


async def stopped(proxy: ProxyProcess) -> int | None:
    return await asyncio.to_thread(proxy.stop)


async def test_a_burst_through_two_workers_meets_one_shared_limit_exactly(
    vendor, redis_server, http
):
    limit = 15
    config = fleet_config(vendor.url, redis_server)
    config["routes"]["v"]["rate_limit"] = {"rate": "1/h", "burst": limit, "max_wait": 0}
    proxy = await started(config)
    try:
        statuses = await post_many(http, f"{proxy.url}/v/search", 3 * limit)
        await asyncio.to_thread(proxy.wait_for_event, "request")
    finally:
        assert await stopped(proxy) == 0
    assert Counter(statuses) == {200: limit, 429: 2 * limit}
    assert vendor.count() == limit
    workers = served_by(proxy)
    assert set(workers) == {0, 1}, workers  # both answered: the limit held across them
    assert sum(workers.values()) == 3 * limit


async def test_a_killed_worker_is_restarted_and_no_count_is_lost(vendor, redis_server, http):
    proxy = await started(fleet_config(vendor.url, redis_server))
    try:
        assert await post_many(http, f"{proxy.url}/v/search", 10) == [200] * 10
        ok = 'search_proxy_requests_total{route="v",status_class="2xx"}'
        assert await metric(http, proxy, ok) == 10  # a scrape: every worker's snapshot taken
        (listening,) = proxy.events("listening")
        assert listening["workers"] == 2
        os.kill(listening["pids"][1], signal.SIGKILL)
        (exited,) = await asyncio.to_thread(proxy.wait_for_event, "worker_exited")
        assert exited["worker"] == 1 and exited["exit"] == "killed by SIGKILL"
        # The dead worker's socket is gone: every new connection lands on the live one.
        assert await post_many(http, f"{proxy.url}/v/search", 20) == [200] * 20
        (back,) = await asyncio.to_thread(proxy.wait_for_event, "worker_restarted", 10.0)
        assert back["worker"] == 1 and back["pid"] != listening["pids"][1]
        assert await post_many(http, f"{proxy.url}/v/search") == [200] * SPREAD
        # The killed worker's counts live on in its slot: the fleet's total never went back.
        assert await metric(http, proxy, ok) == 10 + 20 + SPREAD
        assert await metric(http, proxy, "search_proxy_worker_restarts_total") == 1
        assert await metric(http, proxy, "search_proxy_workers ") == 2
        assert await metric(http, proxy, "search_proxy_redis_up ") == 1
        await served(proxy, "v", 10 + 20 + SPREAD)
        lines = proxy.events("request")
        after = [e["worker"] for e in lines if e["timestamp"] > back["timestamp"]]
        assert set(after) == {0, 1}  # the restarted worker serves again

        # Dying again soon after its start is a crash loop: the next start waits, and longer
        # each time.
        os.kill(back["pid"], signal.SIGKILL)
        await eventually(lambda: len(proxy.events("worker_exited")) == 2, within=5.0)
        again = proxy.events("worker_exited")[1]
        assert (again["quick_deaths"], again["restart_in_s"]) == (2, 0.5)
        await eventually(lambda: len(proxy.events("worker_restarted")) == 2, within=10.0)
    finally:
        assert await stopped(proxy) == 0
    assert vendor.count() == 10 + 20 + SPREAD


async def test_sigterm_drains_every_worker_and_the_supervisor_exits_0(vendor, redis_server, http):
    vendor.set_default(Fault.hang(0.5))
    proxy = await started(fleet_config(vendor.url, redis_server))
    assert proxy.proc is not None
    slow = asyncio.create_task(post_many(http, f"{proxy.url}/v/search"))
    await vendor.wait_for_requests(SPREAD, within=5.0)
    proxy.proc.send_signal(signal.SIGTERM)
    assert await slow == [200] * SPREAD  # in flight on both workers, none cut
    assert await asyncio.to_thread(proxy.proc.wait, 15) == 0
    with pytest.raises(aiohttp.ClientConnectionError):
        await http.get(f"{proxy.url}/healthz")
    await asyncio.to_thread(proxy.stop)  # exited already: this reads its last lines
    assert sorted(e["worker"] for e in proxy.events("stopped") if "worker" in e) == [0, 1]
    assert [e["failed"] for e in proxy.events("stopped") if e.get("supervisor")] == [[]]
    assert set(served_by(proxy)) == {0, 1}


async def test_sighup_reload_and_admin_calls_reach_every_worker(
    vendor, redis_server, http, tmp_path
):
    cached = {"cache": {"ttl": "1m"}, "breaker": {"fail_max": 5, "reset_timeout": "30s"}}
    config = fleet_config(vendor.url, redis_server, c=route(vendor.url, "/c", **cached))
    path = tmp_path / "c.yaml"
    proxy = await started_from(path, config)
    assert proxy.proc is not None
    try:
        config["routes"]["w2"] = route(vendor.url, "/w2")
        path.write_text(yaml.safe_dump(config))
        proxy.proc.send_signal(signal.SIGHUP)
        await wait_reloads(proxy, "signal")
        assert await post_many(http, f"{proxy.url}/w2/search") == [200] * SPREAD
        assert set(await served(proxy, "w2")) == {0, 1}

        config["routes"]["w3"] = route(vendor.url, "/w3")
        path.write_text(yaml.safe_dump(config))
        async with http.post(f"{proxy.admin_url}/admin/reload", headers=CHANGE) as r:
            assert r.status == 200
            answer = await r.json()
        assert answer["result"] == "applied" and answer["routes"]["added"] == ["w3"]
        assert [(w["worker"], w["result"]) for w in answer["workers"]] == [
            (0, "applied"),
            (1, "applied"),
        ]
        await wait_reloads(proxy, "admin")
        # A worker restarted now starts on what the fleet reloaded to, not what it started on;
        # worker 0 brings the admin listener back with it.
        (listening,) = proxy.events("listening")
        os.kill(listening["pids"][0], signal.SIGKILL)
        await asyncio.to_thread(proxy.wait_for_event, "worker_restarted", 10.0)
        assert await post_many(http, f"{proxy.url}/w3/search") == [200] * SPREAD
        assert set(await served(proxy, "w3")) == {0, 1}

        # Admin calls on a worker's own state are made on every worker, answered for all.
        assert await post_many(http, f"{proxy.url}/c/search") == [200] * SPREAD
        async with http.delete(f"{proxy.admin_url}/admin/cache/c", headers=CHANGE) as r:
            assert r.status == 200
            purged = await r.json()
        assert [w["worker"] for w in purged["workers"]] == [0, 1]
        assert purged["local"] == sum(w["local"] for w in purged["workers"]) == SPREAD
        async with http.post(f"{proxy.admin_url}/admin/breakers/c/reset", headers=CHANGE) as r:
            assert (await r.json())["workers"] == [
                {"worker": 0, "state": "closed"},
                {"worker": 1, "state": "closed"},
            ]
        async with http.delete(f"{proxy.admin_url}/admin/cache/v", headers=CHANGE) as r:
            assert r.status == 404  # no cache: refused once, not passed on
        async with http.get(f"{proxy.admin_url}/admin/status") as r:
            assert (await r.json())["worker"] == {"index": 0, "workers": 2}
    finally:
        assert await stopped(proxy) == 0


def dbsize(redis: RedisServer) -> int:
    with socket.create_connection(("127.0.0.1", redis.port), timeout=1) as s:
        s.sendall(b"DBSIZE\r\n")
        return int(s.recv(32).strip(b":\r\n"))


def supervised(proxy: ProxyProcess) -> list[int]:
    """The supervisor's worker processes, as the kernel lists them (Linux)."""
    assert proxy.proc is not None
    pid = proxy.proc.pid
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def test_a_restarted_worker_keeps_the_restart_only_settings_the_fleet_serves(
    vendor, redis_server, killable_redis, http, tmp_path
):
    config = fleet_config(vendor.url, redis_server, c=route(vendor.url, "/c", cache={"ttl": "1m"}))
    path = tmp_path / "c.yaml"
    proxy = await started_from(path, config)
    assert proxy.proc is not None
    try:
        # A reload that moves Redis applies its routes and leaves Redis for a restart ...
        config["redis"] = {"url": killable_redis.url}
        config["routes"]["w2"] = route(vendor.url, "/w2")
        path.write_text(yaml.safe_dump(config))
        proxy.proc.send_signal(signal.SIGHUP)
        await wait_reloads(proxy, "signal")
        assert {tuple(e["restart_required"]) for e in proxy.events("config_reload")} == {
            ("redis.url",)
        }
        # ... which a worker the supervisor restarts is not: it serves what its siblings do.
        (listening,) = proxy.events("listening")
        os.kill(listening["pids"][1], signal.SIGKILL)
        await asyncio.to_thread(proxy.wait_for_event, "worker_restarted", 10.0)
        assert await post_many(http, f"{proxy.url}/w2/search") == [200] * SPREAD
        assert await post_many(http, f"{proxy.url}/c/search") == [200] * SPREAD
        assert set(await served(proxy, "c")) == {0, 1}
        assert dbsize(killable_redis) == 0  # one Redis for the whole fleet: the first
        assert dbsize(redis_server) >= SPREAD  # every search's cache entry
    finally:
        assert await stopped(proxy) == 0


async def test_a_sighup_while_a_worker_starts_reaches_it_once_it_serves(
    vendor, redis_server, http, tmp_path
):
    config = fleet_config(vendor.url, redis_server)
    path = tmp_path / "c.yaml"
    proxy = await started_from(path, config)
    assert proxy.proc is not None
    try:
        (listening,) = proxy.events("listening")
        os.kill(listening["pids"][1], signal.SIGKILL)
        # The new worker is still importing when it is seen (a start takes most of a second):
        # it may read the config before its sibling applies the new one.
        await eventually(lambda: len(set(supervised(proxy)) - set(listening["pids"])) == 1)
        config["routes"]["w2"] = route(vendor.url, "/w2")
        path.write_text(yaml.safe_dump(config))
        proxy.proc.send_signal(signal.SIGHUP)
        await asyncio.to_thread(proxy.wait_for_event, "worker_restarted", 10.0)
        await eventually(
            lambda: {e["worker"] for e in proxy.events("config_reload")} == {0, 1}, within=10.0
        )
        # `unchanged` when the new worker read the config its sibling had applied already.
        results = {e["worker"]: (e["trigger"], e["result"]) for e in proxy.events("config_reload")}
        assert results[0] == ("signal", "applied")
        assert results[1] in {("signal", "applied"), ("signal", "unchanged")}
        assert await post_many(http, f"{proxy.url}/w2/search") == [200] * SPREAD
        assert set(await served(proxy, "w2")) == {0, 1}
    finally:
        assert await stopped(proxy) == 0


def dead_without_yielding(pid: int) -> None:
    """Until process `pid` is a zombie or reaped by asyncio's watcher, blocking the event loop
    so that no callback of it runs meanwhile."""
    stat = Path(f"/proc/{pid}/stat")
    while True:
        try:
            if stat.read_text().split(") ")[1][0] == "Z":
                return
        except OSError:  # reaped already
            return
        time.sleep(0.001)


async def test_a_sighup_to_a_worker_dead_before_the_supervisor_noticed_is_owed(tmp_path):
    plan = Plan(str(tmp_path / "c.yaml"), "127.0.0.1", 0, "127.0.0.1", 0, 1, str(tmp_path))
    supervisor = Supervisor(plan)
    worker = supervisor.workers[0]
    # A serving worker that ignores SIGHUP (as a worker's handler takes it), killed just
    # before the SIGHUP reaches the supervisor: dead, though the loop has not run the callback
    # that sets its exit status.
    worker.proc = await ignoring_sighup()
    worker.started, worker.serving = time.monotonic(), True
    worker.proc.kill()
    dead_without_yielding(worker.proc.pid)
    assert worker.proc.returncode is None
    supervisor._signal(signal.SIGHUP)
    await supervisor._exited(worker, await worker.proc.wait())
    assert worker.owes_reload  # its restart gets it once it serves
    # One alive when the SIGHUP comes gets it, and owes nothing when it dies later: its
    # restart starts on the fleet's config, not on a file the operator has since edited.
    worker.owes_reload = False
    worker.proc = await ignoring_sighup()
    worker.started, worker.serving = time.monotonic(), True
    supervisor._signal(signal.SIGHUP)
    assert worker.proc.returncode is None and not worker.owes_reload
    worker.proc.kill()
    assert await worker.proc.wait() == -signal.SIGKILL  # SIGHUP ignored: killed by SIGKILL
    await supervisor._exited(worker, -signal.SIGKILL)
    assert not worker.owes_reload


async def ignoring_sighup() -> asyncio.subprocess.Process:
    """A child that ignores SIGHUP (under nohup), once it does: nohup has set it and exec'd
    its command."""
    quiet = asyncio.subprocess.DEVNULL  # nohup writes nohup.out when stdout is a terminal
    proc = await asyncio.create_subprocess_exec(
        "nohup", "sleep", "30", stdin=quiet, stdout=quiet, stderr=quiet
    )
    await eventually(lambda: sighup_ignored(proc.pid))
    return proc


def sighup_ignored(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    lines = dict(line.split(":", 1) for line in status.splitlines())
    return lines["Name"].strip() == "sleep" and int(lines["SigIgn"], 16) & 1 == 1


async def wait_reloads(proxy: ProxyProcess, trigger: str) -> None:
    """Until both workers logged an applied reload by `trigger`."""

    def both() -> bool:
        lines = proxy.events("config_reload")
        return {e["worker"] for e in lines if e["trigger"] == trigger} == {0, 1}

    await asyncio.to_thread(proxy.wait_for_event, "config_reload")
    await eventually(both, within=5.0)
    assert all(e["result"] == "applied" for e in proxy.events("config_reload"))


def run_cli(config: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [sys.executable, "-m", "proxy", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_workers_without_redis_exit_2_naming_server_workers(tmp_path):
    port = free_port()
    config = {
        "server": {"workers": 2, "port": port},
        "routes": {"v": route("http://127.0.0.1:9", "/v")},
    }
    result = run_cli(config, tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "search-proxy: config error: server.workers: 2 workers without redis would each keep "
        "rate limits, breakers, the cache and client quotas to themselves, so a route limit of N "
        "would let 2 x N through: configure redis"
    )
    assert "listening" not in result.stdout


def test_a_port_in_use_stops_the_supervisor_with_exit_1(tmp_path, redis_server):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = {
            "server": {"workers": 2, "port": port, "admin_port": free_port()},
            "redis": {"url": redis_server.url},
            "routes": {"v": route("http://127.0.0.1:9", "/v")},
        }
        result = run_cli(config, tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        f"search-proxy: cannot listen on 127.0.0.1:{port}: Address already in use; choose "
        "another port with --port or server.port (make run PORT=...)\n"
    )
    assert '"listening"' not in result.stdout

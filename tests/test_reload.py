"""Reloading the config of a running proxy (POST /admin/reload, and the file watch), through a
real proxy app on loopback in front of the fake vendor: what is kept, what starts afresh, what
a bad config leaves alone, and what needs a restart."""

from __future__ import annotations

import asyncio
import gc
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml

from policies.cache import MemoryStore
from policies.core.clock import ManualClock
from policies.core.kept import Kept
from policies.ratelimit import RateLimit
from proxy.app import STATE, build_admin_app, build_app
from proxy.config import load_config, parse_config, read_config_file
from proxy.logs import Redactor
from proxy.reload import RELOADER, changes, config_hash, effective
from testkit.fakevendor import Fault
from tests.conftest import route

BREAKER = {"fail_max": 1, "reset_timeout": "30s"}


def document(vendor: Any, **routes: dict[str, Any]) -> dict[str, Any]:
    """A config with route `tavily` (a breaker, a cache and a limiter) and `routes`."""
    tavily = route(
        vendor.url + "/tavily",
        "/tavily",
        search={"vendor": "tavily"},
        breaker=BREAKER,
        cache={"ttl": "10m"},
        rate_limit={"rate": "1/m", "burst": 3, "max_wait": "0s"},
    )
    return {"routes": {"tavily": tavily, **routes}}


class Proxy:
    """A proxy app served from a config file, its admin listener, and the file to rewrite."""

    def __init__(self, path: Path, client: Any, admin: Any) -> None:
        self.path, self.client, self.admin = path, client, admin

    @property
    def state(self) -> Any:
        return self.client.app[STATE]

    def write(self, raw: dict[str, Any] | str) -> None:
        text = raw if isinstance(raw, str) else yaml.safe_dump(raw)
        self.path.write_text(text)

    async def reload(self, status: int = 200) -> dict[str, Any]:
        r = await self.admin.post("/admin/reload", headers={"X-Requested-By": "test"})
        assert r.status == status, await r.text()
        body: dict[str, Any] = await r.json()
        return body

    async def search(self, prefix: str = "/tavily", query: str = "reload") -> int:
        r = await self.client.post(f"{prefix}/search", json={"query": query})
        await r.read()
        return r.status

    async def metrics(self) -> str:
        return await (await self.client.get("/metrics")).text()


@pytest.fixture
def serve(aiohttp_client: Any, tmp_path: Path) -> Any:
    async def start(raw: dict[str, Any], clock: Any = None) -> Proxy:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(raw))
        data = read_config_file(path)
        config = load_config(path, env={}, data=data)
        kwargs = {"clock": clock} if clock is not None else {}
        app = build_app(config, config_path=str(path), config_hash=config_hash(data), **kwargs)
        client = await aiohttp_client(app)
        return Proxy(path, client, await aiohttp_client(build_admin_app(app)))

    return start


async def test_an_open_breaker_stays_open_and_an_added_route_answers(
    vendor: Any, serve: Any
) -> None:
    proxy = await serve(document(vendor))
    vendor.script(Fault.status(503))
    assert await proxy.search() == 503
    breaker = proxy.state.routes["tavily"].breaker
    assert breaker.state == "open"
    echo = {"prefix": "/echo", "upstream": vendor.url + "/echo"}
    proxy.write(document(vendor, echo=echo))
    report = await proxy.reload()
    assert report["result"] == "applied" and report["trigger"] == "admin"
    assert report["routes"] == {"added": ["echo"], "removed": [], "changed": {}}
    assert set(report["kept"]["tavily"]) == {"breaker", "cache store", "rate limit buckets"}
    assert proxy.state.routes["tavily"].breaker is breaker and breaker.state == "open"
    assert await proxy.search() == 503  # still failing fast
    r = await proxy.client.get("/echo/anything")
    assert r.status == 200 and (await r.json())["path"] == "/echo/anything"
    assert 'search_proxy_requests_total{route="echo",status_class="2xx"} 1.0' in (
        await proxy.metrics()
    )


async def test_a_changed_breaker_section_starts_afresh_and_the_old_one_stops(
    vendor: Any, serve: Any
) -> None:
    raw = document(vendor)
    raw["routes"]["tavily"]["breaker"] = {**BREAKER, "probe": {"every": "1s"}}
    proxy = await serve(raw)
    vendor.script(Fault.status(503))
    assert await proxy.search() == 503
    old = proxy.state.routes["tavily"].breaker
    assert old.state == "open" and old._tasks  # its active probe runs
    raw["routes"]["tavily"]["breaker"]["fail_max"] = 2
    proxy.write(raw)
    report = await proxy.reload()
    assert report["routes"]["changed"] == {"tavily": ["breaker"]}
    assert "breaker" not in report["kept"]["tavily"]
    new = proxy.state.routes["tavily"].breaker
    assert new is not old and new.state == "closed" and new.config.fail_max == 2
    assert not old._tasks and not old._running  # released: its probe task is gone
    assert 'search_proxy_breaker_state{route="tavily"} 0.0' in await proxy.metrics()
    assert await proxy.search() == 200


async def test_a_route_replaced_by_reloads_is_let_go(vendor: Any, serve: Any) -> None:
    """A long-lived pod reloads often: each generation's replaced routes must become garbage,
    not stay reachable from the next generation's kept parts (a breaker's probe sender holds
    its generation). No request runs meanwhile: asyncio keeps a request's context, and so its
    breaker, in its cancelled timers until they are due (a bounded while, not this leak)."""
    raw = document(vendor)
    proxy = await serve(raw)
    first = weakref.ref(proxy.state.routes["tavily"])
    for fail_max in (2, 3, 4):  # each a new breaker, so a new route
        replaced = weakref.ref(proxy.state.routes["tavily"].breaker)
        raw["routes"]["tavily"]["breaker"] = {**BREAKER, "fail_max": fail_max}
        proxy.write(raw)
        assert (await proxy.reload())["routes"]["changed"] == {"tavily": ["breaker"]}
        gc.collect()
        assert replaced() is None  # not held by the table the new build reused parts from
    assert first() is None  # nor by the app's start-up


async def test_a_breaker_kept_by_reloads_lets_its_first_generation_go(
    vendor: Any, serve: Any
) -> None:
    """A breaker with a probe sends through its route's own upstream. Kept by every reload,
    it must not keep the generation it was built in (its routes, their cache stores)."""
    raw = document(vendor)
    raw["routes"]["tavily"]["breaker"] = {**BREAKER, "probe": {"every": "1s"}}
    proxy = await serve(raw)
    breaker = proxy.state.routes["tavily"].breaker
    first = weakref.ref(proxy.state.routes["tavily"])
    first_store = weakref.ref(proxy.state.routes["tavily"].cache.store)
    for ttl in ("11m", "12m"):  # a new cache store each time; the breaker stays
        raw["routes"]["tavily"]["cache"] = {"ttl": ttl}
        proxy.write(raw)
        report = await proxy.reload()
        assert report["routes"]["changed"] == {"tavily": ["cache"]}
        assert "breaker" in report["kept"]["tavily"]
    assert proxy.state.routes["tavily"].breaker is breaker
    gc.collect()
    assert first() is None and first_store() is None


async def test_cache_entries_and_buckets_live_on_until_their_section_changes(
    vendor: Any, serve: Any
) -> None:
    raw = document(vendor)
    proxy = await serve(raw)
    assert await proxy.search(query="kept") == 200
    assert await proxy.search(query="other") == 200
    limiter = next(p for p in proxy.state.routes["tavily"].policies if isinstance(p, RateLimit))
    assert limiter.tokens() == pytest.approx(1, abs=0.01)  # 2 of the burst of 3 spent
    raw["routes"]["tavily"]["timeouts"]["connect"] = "2s"  # the route changes, not these
    proxy.write(raw)
    report = await proxy.reload()
    assert report["routes"]["changed"] == {"tavily": ["timeouts"]}
    assert "cache store" in report["kept"]["tavily"]
    calls = vendor.count()
    r = await proxy.client.post("/tavily/search", json={"query": "kept"})
    assert r.status == 200 and r.headers["X-Cache"] == "HIT" and vendor.count() == calls
    limiter = next(p for p in proxy.state.routes["tavily"].policies if isinstance(p, RateLimit))
    assert limiter.tokens() == pytest.approx(1, abs=0.01)  # the spent tokens stay spent
    raw["routes"]["tavily"]["cache"] = {"ttl": "5m"}
    raw["routes"]["tavily"]["rate_limit"]["burst"] = 4
    proxy.write(raw)
    report = await proxy.reload()
    assert report["kept"]["tavily"] == ["breaker"]
    store = proxy.state.routes["tavily"].cache.store
    assert isinstance(store, MemoryStore) and len(store) == 0
    limiter = next(p for p in proxy.state.routes["tavily"].policies if isinstance(p, RateLimit))
    assert limiter.tokens() == 4


async def test_a_config_that_does_not_validate_changes_nothing(vendor: Any, serve: Any) -> None:
    proxy = await serve(document(vendor))
    before = proxy.state.generation
    hash_before = proxy.state.config_hash
    bad = document(vendor)
    bad["routes"]["tavily"]["timeouts"]["per_try"] = "ten"
    bad["routes"]["tavily"]["retry"] = {"attempts": 99}
    bad["server"] = {"admin_token": "change-me"}  # start-up's check, listed with the rest
    proxy.write(bad)
    with structlog.testing.capture_logs() as logs:
        report = await proxy.reload(422)
    assert report["result"] == "failed"
    assert sorted(e.split(":")[0] for e in report["errors"]) == [
        "routes.tavily.retry.attempts",
        "routes.tavily.timeouts.per_try",
        "server.admin_token",
    ]
    assert proxy.state.generation is before and proxy.state.config_hash == hash_before
    assert await proxy.search() == 200  # the old config serves on
    (line,) = [e for e in logs if e["event"] == "config_reload"]
    assert line["log_level"] == "error" and line["errors"] == report["errors"]
    text = await proxy.metrics()
    assert 'search_proxy_config_reloads_total{result="failed"} 1.0' in text
    assert f'search_proxy_config_info{{hash="{hash_before}"}} 1.0' in text
    proxy.write("routes: [")  # not even YAML
    report = await proxy.reload(422)
    assert "is not valid YAML" in report["errors"][0]
    proxy.path.unlink()
    report = await proxy.reload(422)
    assert "cannot read config" in report["errors"][0]
    assert await proxy.search() == 200


async def test_restart_only_settings_are_named_and_left_as_they_serve(
    vendor: Any, serve: Any
) -> None:
    raw = document(vendor)
    proxy = await serve(raw)
    raw["server"] = {"port": 9999, "max_body_bytes": "2MiB", "shutdown_grace": "5s"}
    raw["log"] = {"level": "warning"}
    raw["search_api"] = {"max_results": 3}
    proxy.write(raw)
    with structlog.testing.capture_logs() as logs:
        report = await proxy.reload()
    assert report["result"] == "applied"
    assert report["restart_required"] == ["log.level", "server.max_body_bytes", "server.port"]
    assert (
        "server.shutdown_grace" in report["settings"]
        and "search_api.max_results" in report["settings"]
    )
    config = proxy.state.config
    assert config.server.port == 8080 and config.server.max_body_bytes == 1024 * 1024
    assert config.log.level == "info"
    assert config.server.shutdown_grace == 5 and config.search_api.max_results == 3
    (line,) = [e for e in logs if e["event"] == "config_reload"]
    assert line["log_level"] == "warning" and line["restart_required"] == report["restart_required"]


async def test_a_removed_route_is_released_with_its_series(vendor: Any, serve: Any) -> None:
    other = route(vendor.url + "/tavily", "/other", breaker=BREAKER, cache={"ttl": "1m"})
    proxy = await serve(document(vendor, other=other))
    assert await proxy.search("/other") == 200
    breaker = proxy.state.routes["other"].breaker
    assert 'search_proxy_breaker_state{route="other"}' in await proxy.metrics()
    proxy.write(document(vendor))
    report = await proxy.reload()
    assert report["routes"]["removed"] == ["other"]
    assert not breaker._running
    assert await proxy.search("/other") == 404
    text = await proxy.metrics()
    assert 'route="other"' not in text
    assert 'search_proxy_cache_total{result="hit",route="tavily"} 0.0' in text


async def test_a_route_removed_then_added_again_counts_into_its_exported_series(
    vendor: Any, serve: Any
) -> None:
    other = route(vendor.url + "/tavily", "/other", cache={"ttl": "1m"})
    hits = 'search_proxy_cache_total{result="hit",route="other"}'
    proxy = await serve(document(vendor, other=other))
    assert [await proxy.search("/other", "same") for _ in range(2)] == [200, 200]
    assert f"{hits} 1.0" in await proxy.metrics()
    proxy.write(document(vendor))
    assert (await proxy.reload())["routes"]["removed"] == ["other"]
    assert hits not in await proxy.metrics()
    proxy.write(document(vendor, other=other))
    assert (await proxy.reload())["routes"]["added"] == ["other"]
    assert f"{hits} 0.0" in await proxy.metrics()  # a new series, from 0
    assert [await proxy.search("/other", "again") for _ in range(2)] == [200, 200]
    assert f"{hits} 1.0" in await proxy.metrics()  # counted where it is exported


async def test_a_request_in_flight_finishes_on_the_route_it_started_on(
    vendor: Any, serve: Any
) -> None:
    proxy = await serve(document(vendor))
    vendor.script(Fault.hang(0.3))  # answers after 0.3 s
    slow = asyncio.create_task(proxy.search(query="in flight"))
    await wait_for(lambda: vendor.count() == 1)  # it has reached the vendor
    exa = route(vendor.url + "/exa", "/exa", search={"vendor": "exa"})
    proxy.write({"routes": {"exa": exa}})  # tavily is removed while its request runs
    assert (await proxy.reload())["routes"]["removed"] == ["tavily"]
    assert not slow.done()
    assert await slow == 200
    assert await proxy.search() == 404


async def test_an_unchanged_file_is_not_rebuilt(vendor: Any, serve: Any) -> None:
    proxy = await serve(document(vendor))
    before = proxy.state.generation
    report = await proxy.reload()
    assert report["result"] == "unchanged" and proxy.state.generation is before
    assert 'search_proxy_config_reloads_total{result="unchanged"} 1.0' in await proxy.metrics()


async def test_the_watch_follows_a_configmap_symlink_swap(vendor: Any, serve: Any) -> None:
    proxy = await serve(document(vendor))
    # Kubernetes' layout: config.yaml -> ..data/config.yaml, ..data -> ..<timestamp>.
    mount = proxy.path.parent / "mount"
    versions = (("..v1", document(vendor)), ("..v2", document(vendor, echo=echo(vendor))))
    for version, raw in versions:
        (mount / version).mkdir(parents=True)
        (mount / version / "config.yaml").write_text(yaml.safe_dump(raw))
    os.symlink("..v1", mount / "..data")
    os.symlink("..data/config.yaml", mount / "config.yaml")
    proxy.state.config_path = str(mount / "config.yaml")
    reloader = proxy.client.app[RELOADER]
    await proxy.reload()  # serving ..v1 now; the watch has seen it
    assert not await reloader.poll() and not await reloader.poll()
    os.symlink("..v2", mount / "..data.tmp")
    os.replace(mount / "..data.tmp", mount / "..data")  # the atomic swap kubelet does
    assert await reloader.poll()
    report = await reloader.reload("watch")
    assert report.result == "applied" and report.changes.added == ["echo"]
    assert not await reloader.poll()
    (mount / "..v2" / "config.yaml").write_text("routes: [")  # a broken edit is tried once
    assert await reloader.poll()
    assert (await reloader.reload("watch")).result == "failed"
    assert not await reloader.poll()
    assert proxy.state.config.routes.keys() == {"tavily", "echo"}


def echo(vendor: Any) -> dict[str, Any]:
    return {"prefix": "/echo", "upstream": vendor.url + "/echo"}


async def test_the_watch_is_off_with_watch_config_false(vendor: Any, serve: Any) -> None:
    raw = document(vendor)
    raw["server"] = {"watch_config": False}
    proxy = await serve(raw)
    assert not proxy.state.config.server.watch_config
    raw["server"]["watch_config"] = True  # a reload (admin, SIGHUP) turns it back on
    proxy.write(raw)
    assert (await proxy.reload())["settings"] == ["server.watch_config"]
    assert proxy.state.config.server.watch_config


async def test_a_breaker_kept_by_a_reload_probes_with_the_headers_configured_now(
    vendor: Any, serve: Any
) -> None:
    raw = document(vendor)
    raw["routes"]["tavily"]["breaker"] = {**BREAKER, "probe": {"every": "1s"}}
    raw["routes"]["tavily"]["headers"] = {"set": {"Authorization": "Bearer old-key-0123456789"}}
    clock = ManualClock()
    proxy = await serve(raw, clock=clock)
    vendor.script(Fault.status(503))
    assert await proxy.search() == 503
    breaker = proxy.state.routes["tavily"].breaker
    raw["routes"]["tavily"]["headers"]["set"]["Authorization"] = "Bearer new-key-0123456789"
    proxy.write(raw)
    assert (await proxy.reload())["routes"]["changed"] == {"tavily": ["headers"]}
    assert proxy.state.routes["tavily"].breaker is breaker
    calls = vendor.count()
    clock.advance(1.0)  # the probe's next turn
    await wait_for(lambda: vendor.count() > calls)
    assert vendor.last.headers["Authorization"] == "Bearer new-key-0123456789"


async def wait_for(check: Any) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


# ---------------------------------------------------------------------------------------------
# What a new config changes, and what a running process keeps (pure functions)


def test_changes_name_routes_sections_and_settings() -> None:
    base = {
        "routes": {
            "a": {"prefix": "/a", "upstream": "http://a.example", "cache": {"ttl": "1m"}},
            "b": {"prefix": "/b", "upstream": "http://b.example"},
        }
    }
    new = {
        "server": {"port": 9000, "shutdown_grace": "3s"},
        "redis": {"url": "redis://127.0.0.1:6379/0"},
        "routes": {
            "a": {"prefix": "/a", "upstream": "http://a.example", "cache": {"ttl": "2m"}},
            "c": {"prefix": "/c", "upstream": "http://c.example"},
        },
    }
    found = changes(parse_config(base, {}), parse_config(new, {}))
    assert (found.added, found.removed, found.changed) == (["c"], ["b"], {"a": ["cache"]})
    assert found.settings == ["redis", "server.port", "server.shutdown_grace"]
    assert found.restart_required == ["redis", "server.port"]


def test_the_effective_config_keeps_what_needs_a_restart() -> None:
    old = parse_config({"routes": {"a": {"prefix": "/a", "upstream": "http://a.example"}}}, {})
    new = parse_config(
        {
            "server": {
                "host": "0.0.0.0",
                "admin_token": "op-7d2a9f4c1e8b3a6d50",
                "shutdown_grace": "1s",
            },
            "log": {"format": "console"},
            "routes": {"a": {"prefix": "/a", "upstream": "http://b.example"}},
        },
        {},
    )
    config = effective(old, new)
    assert config.server.host == "127.0.0.1" and config.log.format == "json"
    assert (
        config.server.admin_token == "op-7d2a9f4c1e8b3a6d50" and config.server.shutdown_grace == 1
    )
    assert config.routes["a"].upstream == "http://b.example"


def test_the_mcp_server_kept_where_it_is_must_fit_the_new_routes() -> None:
    searching = {"prefix": "/t", "upstream": "http://t.example", "search": {"vendor": "tavily"}}
    old = parse_config({"routes": {"t": searching}}, {})
    routes = {"t": searching, "m": {**searching, "prefix": "/mcp"}}
    new = parse_config({"mcp_server": {"path": "/tools"}, "routes": routes}, {})
    with pytest.raises(Exception, match=r"mcp_server.path: '/mcp' collides .* restart only"):
        effective(old, new)


def test_config_hash_is_the_files_sha256_prefix() -> None:
    assert config_hash(b"") == "e3b0c44298fc"  # sha256sum < /dev/null | cut -c1-12
    assert config_hash(b"routes: {}\n") != config_hash(b"routes: {} \n")


def test_a_part_is_kept_only_while_its_inputs_compare_equal() -> None:
    first = Kept()
    breaker = first.take("a", "breaker", ("cfg", 1), object)
    store = first.take("a", "store", "cfg", object)
    gone = first.take("b", "store", "cfg", object)
    second = Kept(first)
    assert second.take("a", "breaker", ("cfg", 1), object) is breaker
    assert second.take("a", "store", "changed", object) is not store
    assert second.take("c", "store", "cfg", object) is not gone  # another route's is not shared
    assert second.reused == {"a": ["breaker"]}
    assert Kept(second).take("a", "breaker", ("cfg", 1), object) is breaker  # and on again


def test_the_log_redactor_learns_a_reloaded_configs_secrets_and_keeps_the_old_ones() -> None:
    redactor = Redactor(["old-secret-0123"])
    redactor.learn(["new-secret-4567"])
    line = redactor(None, "info", {"event": "x", "note": "old-secret-0123 / new-secret-4567"})
    assert line["note"] == "<redacted> / <redacted>"

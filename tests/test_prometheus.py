"""The Grafana dashboard against a real Prometheus (Debian's `prometheus`, scraping every second)
and two freshly started proxy processes, one with Redis and one without: right after start-up,
before any request, every dashboard expression returns a series (panels read 0, not "No data"),
and the route variable offers /v1/search and /mcp."""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from testkit.procs import Child, free_port
from testkit.proxyprocess import ProxyProcess
from testkit.redisserver import RedisServer
from testkit.waiting import eventually
from tests.test_deploy import dashboard, dashboard_exprs, need

RATE_WINDOW = "5s"  # what $__rate_interval becomes: 5 scrapes at 1 s


def every_policy(upstream: str) -> dict[str, Any]:
    """A config in which some route has each policy, so each panel has something to show."""

    def route(name: str, **sections: Any) -> dict[str, Any]:
        return {"prefix": f"/{name}", "upstream": f"{upstream}/{name}", **sections}

    return {
        "routes": {
            "tavily": route(
                "tavily",
                search={"vendor": "tavily"},  # recovery: on_empty simplify by default
                retry={"attempts": 3, "on": ["429", "5xx", "timeout"]},
                rate_limit={"rate": "10/s", "burst": 10},
                breaker={"fail_max": 3, "reset_timeout": "30s", "probe": {"every": "1s"}},
                cache={"ttl": "1m"},
                hedge={"after": "1s"},
            ),
            "brave": route(
                "brave",
                search={"vendor": "brave"},
                fallback={"providers": ["tavily"]},
                breaker={"fail_max": 3, "reset_timeout": "30s"},
            ),
            "echo": route("echo"),
        }
    }


class Prometheus:
    """A prometheus server of the test's own, scraping `targets` every second."""

    def __init__(self, targets: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="search-proxy-prometheus-"))
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": "search-proxy", "static_configs": [{"targets": targets}]}
            ],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Prometheus:
        binary = need("prometheus", "prometheus")
        argv = [binary, f"--config.file={self.dir / 'prometheus.yml'}"]
        argv += [f"--storage.tsdb.path={self.dir / 'data'}"]
        argv += [f"--web.listen-address=127.0.0.1:{self.port}"]
        self.child = Child("prometheus", argv)
        self.child.wait_http(f"{self.url}/-/ready", within=20)
        return self

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


async def query(session: aiohttp.ClientSession, prom: Prometheus, expr: str) -> list[Any]:
    url = f"{prom.url}/api/v1/query?query={urllib.parse.quote(expr)}"
    async with session.get(url) as r:
        body = await r.json()
    assert body["status"] == "success", f"{expr}: {body}"
    result: list[Any] = body["data"]["result"]
    return result


def as_prometheus_runs_it(expr: str) -> str:
    """Grafana's variables as the dashboard's defaults expand them ($route: All)."""
    expr = expr.replace("$__rate_interval", RATE_WINDOW)
    return re.sub(r"\$\{?route\}?", ".*", expr)


async def test_every_dashboard_expression_has_a_series_right_after_start_up(
    redis_server: RedisServer,
) -> None:
    need("prometheus", "prometheus")
    with_redis = {**every_policy("http://127.0.0.1:9"), "redis": {"url": redis_server.url}}
    proxies = [ProxyProcess(every_policy("http://127.0.0.1:9")), ProxyProcess(with_redis)]
    prom = None
    try:
        await asyncio.gather(*(asyncio.to_thread(proxy.start) for proxy in proxies))
        plain, shared = (f"127.0.0.1:{p.port}" for p in proxies)
        prom = Prometheus([plain, shared]).start()
        async with aiohttp.ClientSession() as session:
            # Both scraped often enough for rate() over RATE_WINDOW: two samples each.
            scraped = f"count(count_over_time(up{{job='search-proxy'}}[{RATE_WINDOW}]) >= 2)"

            async def both_scraped_twice() -> bool:
                found = await query(session, prom, scraped)
                return bool(found) and found[0]["value"][1] == "2"

            await eventually(both_scraped_twice, within=15, interval=0.1)
            empty = []
            for where, expr in dashboard_exprs():
                if where.startswith("variable"):
                    continue
                if not await query(session, prom, as_prometheus_runs_it(expr)):
                    empty.append(f"{where}: {expr}")
            assert not empty, "no series right after start-up:\n" + "\n".join(empty)

            # The route variable offers every route and the endpoints that are not routes.
            variable = next(v for v in dashboard()["templating"]["list"] if v["name"] == "route")
            match = re.fullmatch(r"label_values\((\w+), route\)", variable["query"]["query"])
            assert match is not None
            url = f"{prom.url}/api/v1/label/route/values?match[]={match.group(1)}"
            async with session.get(url) as r:
                routes = set((await r.json())["data"])
            assert routes == {"tavily", "brave", "echo", "/v1/search", "/v1/fetch", "/mcp"}

            # Redis as the Redis panel reads it: up where configured, "not configured" (-1)
            # where not, never a 0 that would read as an outage.
            (panel,) = [p for p in dashboard()["panels"] if p["title"] == "Redis"]
            expr = panel["targets"][0]["expr"].replace("min(", "min by (instance) (")
            found = {
                r["metric"]["instance"]: r["value"][1] for r in await query(session, prom, expr)
            }
            assert found == {plain: "-1", shared: "1"}
    finally:
        if prom is not None:
            prom.stop()
        for proxy in proxies:
            proxy.stop()

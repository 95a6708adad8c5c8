"""/v1/fetch against the extract vendor called directly, the page cache's hits, and what the
direct fetcher costs in memory.

One proxy process with one route (`tavily`, retry {attempts: 1}, no route cache) in front of the
fake vendor (latency 0); `fetch_api: {providers: [tavily]}` with the page cache on. The load
client runs in this process, pinned to the non-proxy CPU.

- miss: SEQ_CALLS requests of two new URLs each, one at a time, interleaved call by call with
  the same body POSTed to the fake's /tavily/extract directly; p50 / p99 each and the
  difference. Target: /v1/fetch's added p50 within ADDED_P50_TARGET_MS (the engine, the route's
  chain, the page cache's lookups and stores, the answer's rendering).
- cache-hit: the same URLs again, SEQ_CALLS requests: p50 / p99, the hit ratio from the proxy's
  search_proxy_cache_total{route="/v1/fetch"} and the vendor calls made meanwhile. Targets:
  every page from the cache, no vendor call.
- idle-rss: the same proxy idle, with fetch_api.direct off and on (trafilatura and lxml are
  imported only when it is on): resident memory of each, for context.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from bench.procs import (
    Pinning,
    client_pinned,
    fake_vendor,
    get_json,
    get_text,
    metric_sum,
    proxy,
    rss_mb,
)
from bench.report import Figure, Scenario, at_least, at_most, percentile
from testkit.procs import Child, StartError

TIMEOUTS = {"connect": "1s", "per_try": "2s", "total": "10s"}
SEQ_CALLS = 300
ADDED_P50_TARGET_MS = 3.0


def _urls(i: int) -> list[str]:
    return [f"https://example.com/bench/{i}/a", f"https://docs.example.org/bench/{i}?b=1"]


def _proxy(
    pinning: Pinning, vendor_url: str, *, direct: bool
) -> contextlib.AbstractContextManager[tuple[str, Child]]:
    """The proxy with a Tavily route, and /v1/fetch over it (and the direct fetcher)."""
    routes = {
        "tavily": {
            "prefix": "/tavily",
            "upstream": f"{vendor_url}/tavily",
            "timeouts": TIMEOUTS,
            "retry": {"attempts": 1},
            "search": {"vendor": "tavily"},
        }
    }
    providers = ["tavily", "direct"] if direct else ["tavily"]
    return proxy(pinning, routes, fetch_api={"providers": providers, "direct": {"enabled": direct}})


async def _measure(px_url: str, vendor_url: str) -> dict[str, list[tuple[float, bool]]]:
    """Each way's (seconds, answered) samples: direct extract, /v1/fetch misses, then hits."""
    out: dict[str, list[tuple[float, bool]]] = {"direct": [], "miss": [], "hit": []}
    async with aiohttp.ClientSession() as http:

        async def direct(urls: list[str]) -> bool:
            body = {"urls": urls, "format": "markdown", "extract_depth": "basic"}
            async with http.post(f"{vendor_url}/tavily/extract", json=body) as r:
                answer = orjson.loads(await r.read())
            return r.status == 200 and len(answer["results"]) == len(urls)

        async def fetch(urls: list[str]) -> bool:
            async with http.post(f"{px_url}/v1/fetch", json={"urls": urls}) as r:
                answer = orjson.loads(await r.read())
            return r.status == 200 and len(answer["results"]) == len(urls)

        async def timed(way: str, call: Callable[[list[str]], Any], urls: list[str]) -> None:
            started = time.perf_counter()
            try:
                ok = await call(urls)
            except Exception:
                ok = False
            out[way].append((time.perf_counter() - started, ok))

        await direct(_urls(-1))  # warm: connections
        await fetch(_urls(-2))
        for i in range(SEQ_CALLS):
            pair = [("direct", direct), ("miss", fetch)]
            for way, call in pair if i % 2 else pair[::-1]:  # no way always first
                await timed(way, call, _urls(i) if way == "miss" else _urls(-i - 10))
        for i in range(SEQ_CALLS):
            await timed("hit", fetch, _urls(i))
    return out


def _stats(samples: list[tuple[float, bool]]) -> tuple[float, float, int]:
    times = [s for s, _ in samples]
    return percentile(times, 50), percentile(times, 99), sum(ok for _, ok in samples)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    try:
        with client_pinned(pinning), fake_vendor(pinning) as vendor_url:
            with _proxy(pinning, vendor_url, direct=False) as (px_url, child):
                idle_off = rss_mb(child)
                before = int(get_json(f"{vendor_url}/__fake__/stats")["total"])
                samples = asyncio.run(_measure(px_url, vendor_url))
                after = int(get_json(f"{vendor_url}/__fake__/stats")["total"])
                metrics = get_text(f"{px_url}/metrics")
            with _proxy(pinning, vendor_url, direct=True) as (_, child):
                idle_on = rss_mb(child)
    except StartError as exc:
        emit(Scenario("fetch/*", error=f"{type(exc).__name__}: {exc}"))
        return
    direct_calls = 2 + 2 * SEQ_CALLS  # two warm-ups, then one direct and one miss each
    emit(_miss_scenario(samples))
    emit(_hit_scenario(samples["hit"], metrics, after - before - direct_calls))
    s = Scenario("fetch/idle-rss-direct-off-vs-on")
    s.figures = [
        Figure("off", f"{idle_off:.1f} MB"),
        Figure("on", f"{idle_on:.1f} MB"),
        Figure("added", f"{idle_on - idle_off:+.1f} MB"),
    ]
    s.details = ["fetch_api.direct imports trafilatura (and lxml) only when enabled"]
    emit(s)


def _miss_scenario(samples: dict[str, list[tuple[float, bool]]]) -> Scenario:
    d50, d99, d_ok = _stats(samples["direct"])
    f50, f99, f_ok = _stats(samples["miss"])
    s = Scenario("fetch/v1-fetch-vs-tavily-extract-direct")
    s.figures = [
        Figure("p50/p99 direct", f"{_ms(d50)}/{_ms(d99)}"),
        Figure("p50/p99 /v1/fetch", f"{_ms(f50)}/{_ms(f99)}"),
        at_most("added p50", (f50 - d50) * 1000, ADDED_P50_TARGET_MS, "{:.2f} ms"),
        Figure("added p99", f"{(f99 - d99) * 1000:+.2f} ms"),
        Figure(
            "answered",
            f"{d_ok + f_ok}/{2 * SEQ_CALLS}",
            "all",
            d_ok + f_ok == 2 * SEQ_CALLS,
        ),
    ]
    s.details = [
        f"{SEQ_CALLS} requests of 2 new URLs each way, one at a time, interleaved; fake vendor "
        "latency 0, route tavily {retry: {attempts: 1}}, page cache on (every URL a miss)"
    ]
    return s


def _hit_scenario(samples: list[tuple[float, bool]], metrics: str, vendor_calls: int) -> Scenario:
    p50, p99, ok = _stats(samples)
    hits = metric_sum(metrics, "search_proxy_cache_total", route="/v1/fetch", result="hit") or 0
    ratio = hits / (2 * SEQ_CALLS)
    s = Scenario("fetch/cache-hit")
    s.figures = [
        Figure("p50/p99", f"{_ms(p50)}/{_ms(p99)}"),
        at_least("hit ratio", ratio * 100, 100.0, "{:.1f}%"),
        at_most("vendor calls", vendor_calls, 0, "{:.0f}"),
        Figure("answered", f"{ok}/{SEQ_CALLS}", "all", ok == SEQ_CALLS),
    ]
    s.details = [f"the {SEQ_CALLS} requests of the miss scenario again: 2 pages each"]
    return s

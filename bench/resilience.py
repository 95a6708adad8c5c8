"""Resilience when the vendor is down: stale answers, failing fast, and what the cache saves.

Every scenario uses one route (no `search` section, so answers are cached by the generic rule:
a 2xx whose JSON parses):

    cache: {ttl: 1s, stale_ttl: 1h}            # a short ttl, so it lapses with a short real wait
    breaker: {fail_max: 5, reset_timeout: 30s}
    retry: {attempts: 2, backoff: {initial: 10ms, max: 50ms}}

- stale: the vendor is healthy while 100 queries warm the cache, then goes down (503 to every
  call) and the fresh ttl lapses; the 100 queries are asked again, 5 times each: 100% answered
  stale, vendor calls during the outage <= 5% of requests;
- cold: the vendor is down from the start and every query is new: 503s with p50 <= 5 ms once
  the breaker is open, vendor calls <= 5% of requests;
- hit-vs-miss: throughput of the cache-hit path (one query repeated) >= 2x the miss path
  (every query new) through the same proxy, in the same run, with `wrk`.

The fake vendor has no runtime control to go down, so the stale scenario stops it and starts it
again with `--down` on the same port, which the proxy's route already points at.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.client import LoadResult, Outcome, run_load
from bench.core import _WRK_SCRIPT, WrkRun, _wrk
from bench.procs import (
    Pinning,
    bench_upstream,
    fake_vendor,
    get_json,
    get_text,
    metric_sum,
    proxy,
)
from bench.report import Figure, Scenario, at_least, at_most, median, percentile, spread
from testkit.procs import StartError, free_port

ROUTE = "res"
CACHE = {"ttl": "1s", "stale_ttl": "1h"}
BREAKER = {"fail_max": 5, "reset_timeout": "30s"}
RETRY = {"attempts": 2, "backoff": {"initial": "10ms", "max": "50ms"}}
TIMEOUTS = {"connect": "1s", "per_try": "2s", "total": "10s"}
TTL_S = 1.0
FAIL_MAX = 5
ATTEMPTS = 2

WARM_QUERIES = 100
OUTAGE_PASSES = 5  # the warmed queries are asked this many times each during the outage
CONCURRENCY = 10
COLD_REQUESTS = 500
CALLS_TARGET = 0.05  # vendor calls during an outage, as a share of requests
FAIL_FAST_P50_MS = 5.0

HIT_MISS_TARGET = 2.0
RUN_SECONDS = 3
WARMUP_SECONDS = 1
REPEATS = 3
WRK_CONNECTIONS = 32

KEEP = ("X-Cache", "Cache-Status", "X-Circuit")


def _route(upstream: str) -> dict[str, Any]:
    return {
        "prefix": f"/{ROUTE}",
        "upstream": upstream,
        "timeouts": TIMEOUTS,
        "retry": RETRY,
        "breaker": BREAKER,
        "cache": CACHE,
    }


def _body(tag: str) -> Callable[[int], dict[str, Any]]:
    def body(i: int) -> dict[str, Any]:
        return {"query": f"resilience {tag} query {i}", "max_results": 3}

    return body


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _latency_line(load: LoadResult) -> str:
    return (
        f"{load.n} requests at concurrency {CONCURRENCY} in {load.wall_seconds:.2f} s "
        f"({load.n / load.wall_seconds:.0f} req/s); latency p50 {_ms(load.latency(50))} "
        f"p99 {_ms(load.latency(99))} max {_ms(load.latency(100))}"
    )


def _metric(metrics: str, name: str, **labels: str) -> float:
    return metric_sum(metrics, name, route=ROUTE, **labels) or 0.0


def _breaker_line(metrics: str) -> str:
    opened = _metric(metrics, "search_proxy_breaker_transitions_total", to="open")
    state = {0: "closed", 1: "half-open", 2: "open"}.get(
        int(_metric(metrics, "search_proxy_breaker_state")), "?"
    )
    attempts = {
        o: _metric(metrics, "search_proxy_upstream_attempts_total", outcome=o)
        for o in ("ok", "5xx", "reset", "connect_error")
    }
    shown = ", ".join(f"{o} {v:.0f}" for o, v in attempts.items() if v)
    retries = _metric(metrics, "search_proxy_retries_total")
    refused = _metric(metrics, "search_proxy_retry_budget_exhausted_total")
    return (
        f"proxy /metrics: breaker opened {opened:.0f} time(s), now {state}; "
        f"upstream attempts by outcome: {shown or 'none'}; retries {retries:.0f}, refused by "
        f"the retry budget {refused:.0f}"
    )


def _fixed_cost_line(calls: int, requests: int) -> str:
    ceiling = ATTEMPTS * (FAIL_MAX + CONCURRENCY)
    return (
        "the breaker's cost is fixed, not per request: each request in flight before it "
        f"opened made up to {ATTEMPTS} calls (fail_max {FAIL_MAX} at concurrency "
        f"{CONCURRENCY}: at most {ATTEMPTS} x ({FAIL_MAX} + {CONCURRENCY}) = {ceiling} calls, "
        f"fewer when the retry budget refuses retries); {calls} calls are "
        f"{calls / requests:.1%} of these {requests} requests; the share falls as the outage "
        "goes on"
    )


# --------------------------------------------------------------------------------- stale


def stale_after_warming(pinning: Pinning) -> Scenario:
    name = "resilience/down-after-warming"
    port = free_port()
    with contextlib.ExitStack() as outer:
        healthy = contextlib.ExitStack()
        outer.callback(healthy.close)
        vendor_url = healthy.enter_context(fake_vendor(pinning, port=port))
        px_url, _ = outer.enter_context(proxy(pinning, {ROUTE: _route(f"{vendor_url}/tavily")}))
        url = f"{px_url}/{ROUTE}/search"

        warm = asyncio.run(
            run_load(url, WARM_QUERIES, CONCURRENCY, _body("stale"), keep_headers=KEEP)
        )
        warmed_at = time.monotonic()
        warm_calls = int(get_json(f"{vendor_url}/__fake__/stats")["total"])
        stored = sum(1 for o in warm.outcomes if o.status == 200 and o.headers.get("X-Cache"))
        if warm.ok != WARM_QUERIES:
            return Scenario(name, error=f"warming failed: {warm.statuses()}")

        healthy.close()  # the vendor goes down: same port, every call answered 503
        down_url = outer.enter_context(fake_vendor(pinning, "--down", port=port))
        lapse = TTL_S + 0.2 - (time.monotonic() - warmed_at)
        if lapse > 0:
            time.sleep(lapse)
        waited = time.monotonic() - warmed_at

        # One pass over the warmed queries at a time, to see when the vendor calls happen.
        load = LoadResult()
        per_pass: list[int] = []
        for _ in range(OUTAGE_PASSES):
            one = asyncio.run(
                run_load(url, WARM_QUERIES, CONCURRENCY, _body("stale"), keep_headers=KEEP)
            )
            load.outcomes += one.outcomes
            load.wall_seconds += one.wall_seconds
            per_pass.append(int(get_json(f"{down_url}/__fake__/stats")["total"]) - sum(per_pass))
        calls = sum(per_pass)
        metrics = get_text(f"{px_url}/metrics")

    stale = [o for o in load.outcomes if o.status == 200 and o.headers.get("X-Cache") == "STALE"]
    queries_always_stale = {
        q
        for q in range(WARM_QUERIES)
        if all(
            o.status == 200 and o.headers.get("X-Cache") == "STALE"
            for o in load.outcomes
            if o.index == q
        )
    }
    share = len(stale) / load.n
    s = Scenario(name)
    s.figures = [
        Figure(
            "answered stale",
            f"{share:.1%} ({len(stale)}/{load.n})",
            "100%",
            len(stale) == load.n,
        ),
        at_most(
            "vendor calls during the outage", calls / load.n * 100, CALLS_TARGET * 100, "{:.1f}%"
        ),
        Figure("stale p50", _ms(percentile([o.seconds for o in stale], 50))),
    ]
    x_cache = sorted({o.headers.get("X-Cache", "none") for o in load.outcomes})
    s.details = [
        f"warming: {WARM_QUERIES} queries, {warm.ok} answered 200 ({stored} with X-Cache), "
        f"{warm_calls} vendor calls; then the vendor restarted with --down (503 to every call) "
        f"and {waited:.1f} s passed since warming ended (ttl {TTL_S:.0f} s)",
        f"outage: the {WARM_QUERIES} warmed queries asked {OUTAGE_PASSES} times each, "
        + _latency_line(load),
        f"agent saw: {load.statuses()}; X-Cache values: {', '.join(x_cache)}; "
        f"queries answered stale every time: {len(queries_always_stale)}/{WARM_QUERIES}; "
        f"vendor calls during the outage {calls}, by pass: {', '.join(map(str, per_pass))}",
        _fixed_cost_line(calls, load.n)
        + f"; over one pass ({WARM_QUERIES} requests) <= 5% could not be met: opening the "
        f"breaker alone takes {FAIL_MAX} failed requests",
        _breaker_line(metrics)
        + f"; cache stale {_metric(metrics, 'search_proxy_cache_total', result='stale'):.0f}",
    ]
    failure = load.sample_failure()
    if failure:
        s.details.append(f"a failed answer: {failure}")
    kinds = Counter(o.headers.get("Cache-Status", "none") for o in stale)
    for text, count in kinds.most_common(3):
        s.details.append(f"Cache-Status x {count}: {text}")
    return s


# --------------------------------------------------------------------------------- cold


def _is_open(o: Outcome) -> bool:
    return o.headers.get("X-Circuit") == "open"


def cold_cache_down(pinning: Pinning) -> Scenario:
    name = "resilience/down-cold-cache"
    with fake_vendor(pinning, "--down") as vendor_url:
        stats = f"{vendor_url}/__fake__/stats"
        with proxy(pinning, {ROUTE: _route(f"{vendor_url}/tavily")}) as (px_url, _):
            url = f"{px_url}/{ROUTE}/search"
            load = asyncio.run(
                run_load(url, COLD_REQUESTS, CONCURRENCY, _body("cold"), keep_headers=KEEP)
            )
            calls = int(get_json(stats)["total"])
            # The same fail-fast path with one agent at a time: latency without queueing.
            single = asyncio.run(run_load(url, 200, 1, _body("cold-c1"), keep_headers=KEEP))
            single_calls = int(get_json(stats)["total"]) - calls
            metrics = get_text(f"{px_url}/metrics")
    open_ = [o for o in load.outcomes if _is_open(o)]
    before = [o for o in load.outcomes if not _is_open(o)]
    answered_503 = sum(1 for o in load.outcomes if o.status == 503)
    p50 = percentile([o.seconds for o in open_], 50)
    single_open = sum(1 for o in single.outcomes if _is_open(o))
    s = Scenario(name)
    s.figures = [
        Figure("answered 503", f"{answered_503}/{load.n}"),
        at_most("p50 once open", p50 * 1000, FAIL_FAST_P50_MS, "{:.2f} ms"),
        at_most("vendor calls", calls / load.n * 100, CALLS_TARGET * 100, "{:.1f}%"),
    ]
    s.details = [
        "every query new (nothing to answer stale); " + _latency_line(load),
        f"agent saw: {load.statuses()}; {len(open_)} answered by the open breaker "
        f"(X-Circuit: open), p50 {_ms(p50)} p99 {_ms(percentile([o.seconds for o in open_], 99))}"
        f"; {len(before)} answered before it opened (the vendor's 503 after retries), p50 "
        f"{_ms(percentile([o.seconds for o in before], 50))}; vendor calls {calls}",
        _fixed_cost_line(calls, load.n),
        f"the same open breaker, one request at a time ({single.n} requests): p50 "
        f"{_ms(single.latency(50))} p99 {_ms(single.latency(99))}; {single_open} answered "
        f"circuit open; vendor calls {single_calls}",
        _breaker_line(metrics),
    ]
    return s


# ------------------------------------------------------------------------- hit vs miss

# Every request a new query: a miss that calls the vendor and stores the answer.
_MISS_LUA = """
local n = 0
request = function()
  n = n + 1
  return wrk.format(nil, nil, nil, string.format(
    '{"query": "resilience miss %(tag)s query %%d", "max_results": 3}', n))
end
"""


def _scripts(tmp: Path, tag: str) -> tuple[Path, Path]:
    """The hit script (one body, repeated) and a miss script whose queries are all new."""
    body_path = tmp / "hit.json"
    body_path.write_text(json.dumps({"query": "resilience hit query", "max_results": 3}))
    hit = tmp / "hit.lua"
    hit.write_text(_WRK_SCRIPT % {"body_path": body_path})
    miss = tmp / f"miss-{tag}.lua"
    miss.write_text(_WRK_SCRIPT % {"body_path": body_path} + _MISS_LUA % {"tag": tag})
    return hit, miss


def hit_vs_miss(pinning: Pinning) -> Scenario:
    name = "resilience/hit-vs-miss-throughput"
    if shutil.which("wrk") is None:
        return _hit_vs_miss_in_process(pinning, name)
    runs: dict[str, list[WrkRun]] = {"hit": [], "miss": []}
    counted: dict[str, list[tuple[float, ...]]] = {"hit": [], "miss": []}
    with tempfile.TemporaryDirectory(prefix="bench-res-") as tmpdir:
        tmp = Path(tmpdir)
        with bench_upstream(pinning) as (up_url, up_child):
            with proxy(pinning, {ROUTE: _route(up_url)}) as (px_url, px_child):
                url = f"{px_url}/{ROUTE}/search"
                watch = {"proxy": px_child, "upstream": up_child}

                def cache_counts() -> tuple[float, float, float]:
                    m = get_text(f"{px_url}/metrics")
                    return (
                        _metric(m, "search_proxy_cache_total", result="hit"),
                        _metric(m, "search_proxy_cache_total", result="miss"),
                        _metric(m, "search_proxy_coalesced_total"),
                    )

                hit_script, miss_script = _scripts(tmp, "warmup")
                _wrk(pinning, hit_script, url, WRK_CONNECTIONS, WARMUP_SECONDS, watch)
                _wrk(pinning, miss_script, url, WRK_CONNECTIONS, WARMUP_SECONDS, watch)
                for r in range(REPEATS):  # alternate, so drift hits both alike
                    for kind in ("hit", "miss"):
                        hit_script, miss_script = _scripts(tmp, f"run{r}")
                        script = hit_script if kind == "hit" else miss_script
                        before = cache_counts()
                        run = _wrk(pinning, script, url, WRK_CONNECTIONS, RUN_SECONDS, watch)
                        after = cache_counts()
                        runs[kind].append(run)
                        delta = tuple(b - a for a, b in zip(before, after, strict=True))
                        counted[kind].append(delta)
    hit_rps = median([r.rps for r in runs["hit"]])
    miss_rps = median([r.rps for r in runs["miss"]])
    ratio = hit_rps / miss_rps
    s = Scenario(name)
    s.figures = [
        Figure("hit", f"{hit_rps:,.0f} req/s"),
        Figure("miss", f"{miss_rps:,.0f} req/s"),
        at_least("hit/miss", ratio, HIT_MISS_TARGET, "{:.2f}x"),
    ]

    def counts(kind: str) -> str:
        hits, misses, coalesced = (sum(c[i] for c in counted[kind]) for i in range(3))
        total = sum(r.requests for r in runs[kind])
        return (
            f"{kind} runs: {total} requests, cache hit {hits:.0f} miss {misses:.0f} "
            f"(coalesced {coalesced:.0f})"
        )

    def cpu(kind: str) -> str:
        proxy_cpu = median([r.cpu.get("proxy", 0.0) for r in runs[kind]]) * 100
        up_cpu = median([r.cpu.get("upstream", 0.0) for r in runs[kind]]) * 100
        wrk_cpu = median([r.cpu.get("wrk", 0.0) for r in runs[kind]]) * 100
        return f"{kind}: proxy {proxy_cpu:.0f}%, upstream {up_cpu:.0f}% + wrk {wrk_cpu:.0f}%"

    s.details = [
        f"wrk -t1 -c{WRK_CONNECTIONS} -d{RUN_SECONDS}s against one proxy; upstream: "
        "bench.upstream (the fastest we have, so the miss path is bound by the proxy); "
        f"{REPEATS} runs each, alternating; medians of runs",
        "hit  req/s: " + spread([r.rps for r in runs["hit"]], "{:,.0f}"),
        "miss req/s: " + spread([r.rps for r in runs["miss"]], "{:,.0f}"),
        "p50/p99 hit "
        f"{median([r.p50_ms for r in runs['hit']]):.2f}/"
        f"{median([r.p99_ms for r in runs['hit']]):.2f} ms, miss "
        f"{median([r.p50_ms for r in runs['miss']]):.2f}/"
        f"{median([r.p99_ms for r in runs['miss']]):.2f} ms",
        counts("hit") + "; " + counts("miss") + " (the ttl is 1 s: the hit query is "
        "fetched again about once a second, the other connections' requests meanwhile wait for "
        "that call and count as misses, coalesced)",
        "CPU use, % of one core: " + cpu("hit") + "; " + cpu("miss"),
    ]
    errors = {k: sum(r.errors for r in v) for k, v in runs.items()}
    if any(errors.values()):
        s.details.append(f"WARNING: failed requests (socket errors or non-2xx): {errors}")
    return s


def _hit_vs_miss_in_process(pinning: Pinning, name: str) -> Scenario:
    """Without wrk: the in-process client, which is slower than the proxy (a smaller ratio)."""
    with bench_upstream(pinning) as (up_url, _):
        with proxy(pinning, {ROUTE: _route(up_url)}) as (px_url, _):
            url = f"{px_url}/{ROUTE}/search"
            hits = asyncio.run(run_load(url, 3000, 32, lambda i: {"query": "resilience hit"}))
            misses = asyncio.run(run_load(url, 3000, 32, _body("miss-in-process")))
    hit_rps = hits.n / hits.wall_seconds
    miss_rps = misses.n / misses.wall_seconds
    s = Scenario(name)
    s.figures = [
        Figure("hit", f"{hit_rps:,.0f} req/s"),
        Figure("miss", f"{miss_rps:,.0f} req/s"),
        at_least("hit/miss", hit_rps / miss_rps, HIT_MISS_TARGET, "{:.2f}x"),
    ]
    s.details = [
        "wrk is not installed: the in-process aiohttp client (3000 requests at concurrency "
        "32) was used; it is slower than the proxy, so this ratio understates the cache"
    ]
    return s


SCENARIOS: tuple[Callable[[Pinning], Scenario], ...] = (
    stale_after_warming,
    cold_cache_down,
    hit_vs_miss,
)


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    """Run each scenario with its own processes; one failing does not stop the next."""
    for scenario in SCENARIOS:
        try:
            emit(scenario(pinning))
        except StartError as exc:
            emit(Scenario(scenario.__name__, error=f"{type(exc).__name__}: {exc}"))

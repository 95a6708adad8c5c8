"""Hedged attempts: the tail latency an agent sees, and what it costs in vendor calls, with and
without `hedge: {after: auto}`, each run with its own fake vendor and proxy process.

Every route has the retries of `make bench` group retries and a Tavily search profile:

    retry: {attempts: 3, on: [429, 5xx, timeout, connect_error, reset],
            backoff: {initial: 50ms, max: 1s}}
    timeouts: {per_try: 1s, total: 10s}     (10%-hang)
              {per_try: 10s, total: 30s}    (lognormal: a healthy vendor is never timed out)

- 10%-hang: 10% of vendor calls hang 20 s, the rest answer at once; REQUESTS searches at
  concurrency HANG_CONCURRENCY, without hedging, then with HANG_HEDGE. Targets (hedged): p99
  <= 500 ms, 100% success, <= 1.15 vendor calls per request. The same load with the hedge's
  default settings follows for context: their budget (5% of requests) is sized for a healthy
  vendor's tail, so it binds by design when 10% of calls hang;
- lognormal: a healthy vendor whose latency is lognormal, median 300 ms, sigma 0.7 (p99 about
  5x the median, the spread search vendors show); REQUESTS searches at concurrency
  LOGNORMAL_CONCURRENCY, without hedging, then with the defaults (`hedge: {}`: after auto, the
  95th percentile, one extra, budget 5% of requests, at least 1/s). Targets: extra vendor calls
  <= 5% of requests, p99 lower than without hedging.

Vendor calls are counted by the fake vendor (`/__fake__/stats`); hedges by the proxy's
`search_proxy_hedges_total`. The load client runs in this process, on the non-proxy CPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.client import LoadResult, run_load
from bench.procs import Pinning, client_pinned, fake_vendor, get_json, get_text, metric_sum, proxy
from bench.report import Figure, Scenario, at_most, below
from testkit.procs import StartError

ROUTE = "vendor"
REQUESTS = 1000
HANG_CONCURRENCY = 20
LOGNORMAL_CONCURRENCY = 50
RETRY = {
    "attempts": 3,
    "on": [429, "5xx", "timeout", "connect_error", "reset"],
    "backoff": {"initial": "50ms", "max": "1s"},
}
HANG_TIMEOUTS = {"connect": "1s", "per_try": "1s", "total": "10s"}
LOGNORMAL_TIMEOUTS = {"connect": "1s", "per_try": "10s", "total": "30s"}
HANG_VENDOR = ["--hang-ratio", "0.1", "--hang-seconds", "20"]
LOGNORMAL_VENDOR = ["--latency", "0.3", "--latency-sigma", "0.7"]
# For a vendor whose trouble is calls that never answer: hedge only what is slower than 99% of
# the calls that do answer, twice if need be (1% of the time the hedge hangs too), and allow
# hedges for the share of calls that hang (10%) and some.
HANG_HEDGE: dict[str, Any] = {
    "after": "auto",
    "percentile": 0.99,
    "max_extra": 2,
    "budget": {"ratio": 0.2, "min_per_s": 1},
}
DEFAULT_HEDGE: dict[str, Any] = {}  # after auto, percentile 0.95, max_extra 1, budget 5% (>= 1/s)
HEDGE_RESULTS = ("won", "lost", "cancelled", "refused")


@dataclass
class Run:
    label: str
    hedge: dict[str, Any] | None
    load: LoadResult
    vendor_calls: int
    metrics: str

    @property
    def calls_per_request(self) -> float:
        return self.vendor_calls / self.load.n

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(self.metrics, name, route=ROUTE, **labels) or 0.0

    def summary(self) -> str:
        load = self.load
        hedges = ", ".join(
            f"{r} {self.metric('search_proxy_hedges_total', result=r):.0f}" for r in HEDGE_RESULTS
        )
        return (
            f"{self.label}: p50 {load.latency(50) * 1000:.0f} ms, p99 "
            f"{load.latency(99) * 1000:.0f} ms, max {load.latency(100) * 1000:.0f} ms; success "
            f"{load.success_ratio:.1%} ({load.ok}/{load.n}); vendor calls {self.vendor_calls} "
            f"({self.calls_per_request:.3f}/request); retries "
            f"{self.metric('search_proxy_retries_total'):.0f}; hedges: {hedges}"
        )


def _search_body(i: int) -> dict[str, Any]:
    return {"query": f"bench hedge query {i}", "max_results": 3}


def _measure(
    pinning: Pinning,
    label: str,
    vendor_args: list[str],
    timeouts: dict[str, str],
    concurrency: int,
    hedge: dict[str, Any] | None,
) -> Run:
    """One fake vendor, one proxy, REQUESTS searches; the counts each side kept."""
    with fake_vendor(pinning, *vendor_args) as vendor_url:
        route: dict[str, Any] = {
            "prefix": f"/{ROUTE}",
            "upstream": f"{vendor_url}/tavily",
            "timeouts": timeouts,
            "retry": RETRY,
            "search": {"vendor": "tavily", "loop_guard": "0s"},
        }
        if hedge is not None:
            route["hedge"] = hedge
        with proxy(pinning, {ROUTE: route}) as (proxy_url, _):
            url = f"{proxy_url}/{ROUTE}/search"
            load = asyncio.run(run_load(url, REQUESTS, concurrency, _search_body))
            metrics = get_text(f"{proxy_url}/metrics")
        calls = int(get_json(f"{vendor_url}/__fake__/stats")["total"])
    return Run(label, hedge, load, calls, metrics)


def _success(load: LoadResult) -> Figure:
    text = f"{load.success_ratio:.1%} ({load.ok}/{load.n})"
    if load.ok < load.n and text.startswith("100.0%"):  # never show a miss as the target
        text = f"{load.success_ratio:.2%} ({load.ok}/{load.n})"
    return Figure("success", text, "100%", load.ok == load.n)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def hanging(pinning: Pinning) -> list[Scenario]:
    """10% of calls hang: without hedging, with HANG_HEDGE (targets), with the defaults."""
    name = "hedge/10%-hang"

    def run(label: str, hedge: dict[str, Any] | None) -> Run:
        return _measure(pinning, label, HANG_VENDOR, HANG_TIMEOUTS, HANG_CONCURRENCY, hedge)

    try:
        off = run("no hedge", None)
        auto = run("hedge after auto", HANG_HEDGE)
        default = run("hedge with defaults", DEFAULT_HEDGE)
    except StartError as exc:
        return [Scenario(f"{name}/*", error=f"{type(exc).__name__}: {exc}")]
    s = Scenario(name)
    s.figures = [
        Figure("p99 without hedging", _ms(off.load.latency(99))),
        Figure("hedged: p50", _ms(auto.load.latency(50))),
        at_most("p99", auto.load.latency(99) * 1000, 500, "{:.0f} ms"),
        _success(auto.load),
        at_most("vendor calls/request", auto.calls_per_request, 1.15, "{:.3f}"),
    ]
    s.details = [
        f"{REQUESTS} requests at concurrency {HANG_CONCURRENCY}; 10% of vendor calls hang 20 s, "
        f"the others answer at once; timeouts {HANG_TIMEOUTS}",
        off.summary(),
        f"{auto.summary()}",
        f"    hedge: {HANG_HEDGE}",
        "expected with 10% independent hangs: about 0.1 + 0.1 x 0.1 = 0.11 hedges per request "
        "(the hang itself, and the hedge hanging too), plus the 1% of answering calls slower "
        "than their 99th percentile",
    ]
    context = Scenario(f"{name}-default-hedge")
    context.figures = [
        Figure("p99", _ms(default.load.latency(99))),
        Figure("success", f"{default.load.success_ratio:.1%}"),
        Figure("vendor calls/request", f"{default.calls_per_request:.3f}"),
    ]
    context.details = [
        "context only: `hedge: {}` (after auto at the 95th percentile, one extra, budget 5% of "
        "requests, at least 1/s), sized for a healthy vendor's tail; 10% of calls hanging need "
        "about twice that budget, so half the hangs wait out per_try as without hedging",
        default.summary(),
    ]
    return [s, context]


def lognormal(pinning: Pinning) -> list[Scenario]:
    """A healthy, long-tailed vendor: without hedging, then with the defaults."""
    name = "hedge/lognormal-300ms"

    def run(label: str, hedge: dict[str, Any] | None) -> Run:
        return _measure(
            pinning, label, LOGNORMAL_VENDOR, LOGNORMAL_TIMEOUTS, LOGNORMAL_CONCURRENCY, hedge
        )

    try:
        off = run("no hedge", None)
        auto = run("hedge: {} (defaults)", DEFAULT_HEDGE)
    except StartError as exc:
        return [Scenario(f"{name}/*", error=f"{type(exc).__name__}: {exc}")]
    extra = (auto.vendor_calls - off.vendor_calls) / REQUESTS
    off_p99, auto_p99 = off.load.latency(99), auto.load.latency(99)
    s = Scenario(name)
    s.figures = [
        Figure("p99 without hedging", _ms(off_p99)),
        below("hedged p99", auto_p99 * 1000, off_p99 * 1000, "{:.0f} ms"),
        at_most("extra vendor calls", extra * 100, 5.0, "{:.1f}%"),
        Figure("success", f"{auto.load.success_ratio:.1%}"),
    ]
    s.details = [
        f"{REQUESTS} requests at concurrency {LOGNORMAL_CONCURRENCY}; vendor latency lognormal, "
        "median 300 ms, sigma 0.7 (p99 about 1.5 s); nothing fails",
        off.summary(),
        auto.summary(),
        "refused: hedges the budget stopped. A new proxy's first samples are the fastest "
        f"answers of its first {LOGNORMAL_CONCURRENCY} concurrent calls, so `after: auto` starts "
        "low and hedges eagerly until the window has seen the tail; the budget holds the extra "
        "calls to its ratio meanwhile",
        f"p50 {_ms(off.load.latency(50))} -> {_ms(auto.load.latency(50))}, p90 "
        f"{_ms(off.load.latency(90))} -> {_ms(auto.load.latency(90))}, p99 {_ms(off_p99)} -> "
        f"{_ms(auto_p99)}",
    ]
    return [s]


SCENARIOS: tuple[Callable[[Pinning], list[Scenario]], ...] = (hanging, lognormal)


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    """Run each scenario with its own fake vendors and proxies."""
    with client_pinned(pinning):
        for scenario in SCENARIOS:
            for result in scenario(pinning):
                emit(result)

"""`make bench ablation`: what each policy costs a cache miss on the real request path, found by
taking it out of the every-policy route and measuring again: in CPU per request at c=32 (the
miss throughput target) and in added p50 at c=1 (the miss latency target).

`core/chain` times each policy's own code without sockets; this group measures what the proxy
gives up with the policy in place, sockets, the event loop's scheduling, the collector and the
memory it keeps included: the every-policy route of bench/core.py (`full_routes`), then that
route without each policy's section in turn, then with none, all on the miss path (a new query
in every request) at c=32, the proxy pinned to its own CPU. The proxy runs at 100% of that CPU,
so a variant's microseconds per request are its CPU time per miss, and a section's cost is the
every-policy route's time less the time without it, taken within each round (`per_round`). Then
the same variants one request at a time (c=1): a section's cost is the p50 it adds, beside the
proxy's CPU time per request, which says whether that latency is work or waiting. Both are often
more than `core/chain` times for the same policy: there its code runs in a tight loop, warm in
the CPU's caches; here each request runs between the kernel's and the event loop's work.

`search` goes out with `fallback`, which needs it. Costs need not add up to the whole: a policy
out changes what the ones left do (without the cache, nothing is stored; without the search
section, no answer is assessed)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.core import CONNECTIONS, FULL, _check_answers, _write_script, _wrk, full_routes
from bench.procs import Pinning, bare_forwarder, bench_upstream, proxy
from bench.report import Figure, Scenario, in_turn, median, per_round, spread

ROUNDS = 6
SECONDS = 2
C1_ROUNDS = 8
C1_SECONDS = 1
# The sections each variant takes out of the every-policy route.
DROPS: dict[str, tuple[str, ...]] = {
    "headers": ("headers",),
    "retry": ("retry",),
    "rate_limit": ("rate_limit",),
    "breaker": ("breaker",),
    "cache": ("cache",),
    "hedge": ("hedge",),
    "fallback": ("fallback",),
    "search + fallback": ("search", "fallback"),
}


def variants(upstream: str) -> dict[str, dict[str, Any]]:
    """Every variant's routes: the every-policy route whole ("every policy"), without each of
    DROPS in turn, and with none of them ("no policy")."""
    full = full_routes(upstream)
    every = full[FULL]
    assert isinstance(every, dict)
    out: dict[str, dict[str, Any]] = {"every policy": full}

    def without(sections: tuple[str, ...]) -> dict[str, Any]:
        return {**full, FULL: {k: v for k, v in every.items() if k not in sections}}

    for name, sections in DROPS.items():
        out[f"without {name}"] = without(sections)
    out["no policy"] = without(tuple(s for drop in DROPS.values() for s in drop))
    return out


def costs(us: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each section's cost per miss, round by round: the every-policy route's microseconds per
    request (or p50) less those of the variant without it."""
    full = us["every policy"]
    return {name: _less(full, us[f"without {name}"]) for name in DROPS}


def _less(values: list[float], against: list[float]) -> list[float]:
    """`values` less `against`, round by round."""
    return per_round(values, against, lambda a, b: a - b)


def _by_cost(what: str, values: dict[str, list[float]]) -> list[str]:
    """The lines giving each section's `what`, the largest first."""
    by_section = costs(values)
    return [
        f"each section's {what} (every policy less the route without it, per round):",
        *(
            f"  {name:<18} {spread(xs, '{:+.0f}')} us"
            for name, xs in sorted(by_section.items(), key=lambda kv: -median(kv[1]))
        ),
    ]


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    with (
        tempfile.TemporaryDirectory(prefix="bench-ablation-") as tmpdir,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmpdir)
        up_url, _ = stack.enter_context(bench_upstream(pinning))
        fw_url, fw_child = stack.enter_context(bare_forwarder(pinning, up_url))
        urls = {"bare forwarder": f"{fw_url}/search"}
        children = {"bare forwarder": fw_child}
        for name, routes in variants(up_url).items():
            url, children[name] = stack.enter_context(proxy(pinning, routes))
            urls[name] = f"{url}/{FULL}/search"
        for url in urls.values():
            _check_answers(url)
            _wrk(pinning, _write_script(tmp, unique=True), url, CONNECTIONS, 1, {})
        rps: dict[str, list[float]] = {name: [] for name in urls}
        for r in range(ROUNDS):
            for name, url in in_turn(list(urls.items()), r):
                # A new run id each time: no run meets another's cache entries.
                script = _write_script(tmp, unique=True)
                rps[name].append(_wrk(pinning, script, url, CONNECTIONS, SECONDS, {}).rps)
        p50: dict[str, list[float]] = {name: [] for name in urls}
        cpu: dict[str, list[float]] = {name: [] for name in urls}
        for r in range(C1_ROUNDS):
            for name, url in in_turn(list(urls.items()), r):
                script = _write_script(tmp, unique=True)
                watch = {"proxy": children[name]}
                one = _wrk(pinning, script, url, 1, C1_SECONDS, watch)
                p50[name].append(one.p50_ms * 1000)
                cpu[name].append(one.cpu["proxy"] * one.wall * 1e6 / max(one.requests, 1))
    emit(throughput_scenario(rps))
    emit(latency_scenario(p50, cpu))


def throughput_scenario(rps: dict[str, list[float]]) -> Scenario:
    us = {name: [1e6 / x for x in xs] for name, xs in rps.items()}
    bare = us["bare forwarder"]
    details = [
        f"wrk -t1 -c{CONNECTIONS} -d{SECONDS}s, a new query in every request, {ROUNDS} rounds; "
        "us per request of the proxy's CPU (pinned, at 100%), the median of rounds",
        *(
            f"{name:<26} {spread(xs, '{:.0f}')} us, {median(rps[name]):,.0f} req/s"
            for name, xs in us.items()
        ),
        *_by_cost("cost per miss", us),
    ]
    added = _less(us["every policy"], bare)
    return Scenario(
        "ablation/miss-c32",
        figures=[
            Figure("every policy, miss", f"{median(us['every policy']):.0f} us/request"),
            Figure("over the bare forwarder", f"+{median(added):.0f} us"),
            Figure("no policy", f"{median(us['no policy']):.0f} us/request"),
        ],
        details=details,
    )


def latency_scenario(p50: dict[str, list[float]], cpu: dict[str, list[float]]) -> Scenario:
    bare = p50["bare forwarder"]
    details = [
        f"wrk -t1 -c1 -d{C1_SECONDS}s, a new query in every request, {C1_ROUNDS} rounds; p50 "
        "and the proxy's CPU time per request, the median of rounds",
        *(
            f"{name:<26} p50 {spread(xs, '{:.0f}')} us, CPU {median(cpu[name]):.0f} us/request"
            for name, xs in p50.items()
        ),
        *_by_cost("added p50", p50),
    ]
    added = _less(p50["every policy"], bare)
    cpu_added = _less(cpu["every policy"], cpu["bare forwarder"])
    return Scenario(
        "ablation/miss-c1",
        figures=[
            Figure("every policy, miss, added p50", f"+{median(added):.0f} us"),
            Figure("its added CPU", f"+{median(cpu_added):.0f} us/request"),
            Figure("no policy, added p50", f"{median(_less(p50['no policy'], bare)):+.0f} us"),
        ],
        details=details,
    )

"""`make bench ablation`: what each policy costs a cache miss on the real request path, found by
taking it out of the every-policy route and measuring again.

`core/chain` times each policy's own code without sockets; this group measures what the proxy
gives up with the policy in place, sockets, the event loop's scheduling, the collector and the
memory it keeps included: the every-policy route of bench/core.py (`full_routes`), then that
route without each policy's section in turn, then with none, all on the miss path (a new query
in every request) at c=32, the proxy pinned to its own CPU. The proxy runs at 100% of that CPU,
so a variant's microseconds per request are its CPU time per miss, and a section's cost is the
every-policy route's time less the time without it, taken within each round (`per_round`).

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
    request less those of the variant without it."""
    full = us["every policy"]
    return {name: per_round(full, us[f"without {name}"], lambda a, b: a - b) for name in DROPS}


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    with (
        tempfile.TemporaryDirectory(prefix="bench-ablation-") as tmpdir,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmpdir)
        up_url, _ = stack.enter_context(bench_upstream(pinning))
        fw_url, _ = stack.enter_context(bare_forwarder(pinning, up_url))
        urls = {"bare forwarder": f"{fw_url}/search"}
        for name, routes in variants(up_url).items():
            url, _ = stack.enter_context(proxy(pinning, routes))
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
    us = {name: [1e6 / x for x in xs] for name, xs in rps.items()}
    bare = us["bare forwarder"]
    by_section = costs(us)
    details = [
        f"wrk -t1 -c{CONNECTIONS} -d{SECONDS}s, a new query in every request, {ROUNDS} rounds; "
        "us per request of the proxy's CPU (pinned, at 100%), the median of rounds",
        *(
            f"{name:<26} {spread(xs, '{:.0f}')} us, {median(rps[name]):,.0f} req/s"
            for name, xs in us.items()
        ),
        "each section's cost per miss (every policy less the route without it, per round):",
        *(
            f"  {name:<18} {spread(xs, '{:+.0f}')} us"
            for name, xs in sorted(by_section.items(), key=lambda kv: -median(kv[1]))
        ),
    ]
    added = per_round(us["every policy"], bare, lambda a, b: a - b)
    emit(
        Scenario(
            "ablation/miss-c32",
            figures=[
                Figure("every policy, miss", f"{median(us['every policy']):.0f} us/request"),
                Figure("over the bare forwarder", f"+{median(added):.0f} us"),
                Figure("no policy", f"{median(us['no policy']):.0f} us/request"),
            ],
            details=details,
        )
    )

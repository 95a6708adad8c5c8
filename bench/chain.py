"""`make bench core`'s chain figures: what each policy of the every-policy route costs a request
on its own, with no sockets, so a policy that grows is seen by name rather than as a few percent
off the miss ratio.

The route is bench/core.py's `full_routes`, parsed and built as the proxy builds it, over an
upstream that answers at once with bench/upstream.py's answer. It runs in a fresh interpreter
(`python -m bench.chain`) pinned to the proxy's CPU, on the proxy's event loop, one request at a
time: wall time is then the chain's CPU time. A policy's own time is the time inside its
`handle` less the time inside the part of the chain it calls on. A miss goes through every
policy; a hit ends at the cache, so the policies after it take nothing from a hit.

The totals come from the chain as the proxy composes it; the per-policy figures from the same
chain with a timer around each policy, whose own cost (well under a microsecond a level) lands
on the policy outside it.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from bench.core import FULL, REQUEST_BODY, full_routes
from bench.procs import Pinning
from bench.report import Figure, Scenario
from bench.upstream import BODY
from policies.core.clock import SYSTEM_CLOCK
from policies.core.flow import CallBudget, Flow, Handler, Policy, Reply, compose
from proxy.config import parse_config
from proxy.headers import request_headers
from proxy.loops import chosen, loop_factory
from proxy.metrics import Metrics
from proxy.outbound import VendorPool
from proxy.pipeline import Deps, Route, build_route

REQUESTS = 4000  # per round and path
ROUNDS = 5
WARMUP = 2000
AGENT_HEADERS = CIMultiDictProxy(
    CIMultiDict([("Content-Type", "application/json"), ("User-Agent", "bench")])
)


class _Timed:
    """A policy with a stopwatch: the seconds spent inside its `handle`, callees included."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.inside = 0.0

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        started = time.perf_counter()
        try:
            return await self.policy.handle(flow, call_next)
        finally:
            self.inside += time.perf_counter() - started


@dataclass
class _Bench:
    route: Route

    def flow(self, body: bytes) -> Flow:
        now = SYSTEM_CLOCK.now()
        headers = request_headers(
            AGENT_HEADERS,
            set_headers=self.route.set_headers,
            remove=self.route.remove_headers,
            client_ip="127.0.0.1",
            proto="http",
            request_id="bench",
        )
        return Flow.new(
            route=FULL,
            method="POST",
            path="/search",
            query_string="",
            headers=headers,
            body=body,
            request_id="bench",
            client="127.0.0.1",
            deadline=now + 30.0,
            started=now,
            calls=CallBudget(10),
        )


async def _upstream(flow: Flow) -> Reply:
    flow.trace.attempts += 1
    return Reply(200, CIMultiDict([("Content-Type", "application/json")]), BODY)


def own_seconds(inside: Sequence[float]) -> list[float]:
    """Each policy's own time, from the time inside each (callees included), outermost first:
    its time less the next one's (the last one's callee is the upstream, counted apart)."""
    return [t - below for t, below in zip(inside, [*inside[1:], 0.0], strict=True)]


def _bodies(tag: str, n: int) -> list[bytes]:
    """`n` distinct search bodies (each a miss the first time it is sent)."""
    body = REQUEST_BODY.encode()
    return [body.replace(b"latest results", f"{tag} {i}".encode(), 1) for i in range(n)]


async def _per_request(bench: _Bench, handler: Handler, bodies: Sequence[bytes]) -> float:
    started = time.perf_counter()
    for body in bodies:
        await handler(bench.flow(body))
    return (time.perf_counter() - started) / len(bodies)


def every_policy_route() -> Route:
    """bench/core.py's every-policy route, built as the proxy builds it (with its fallback)."""
    cfg = parse_config({"routes": full_routes("http://127.0.0.1:9")}, {})
    deps = Deps(cfg, VendorPool(256, 64, 15.0), SYSTEM_CLOCK, Metrics(), None)
    for name, route_cfg in cfg.routes.items():
        deps.routes[name] = build_route(route_cfg, deps)
    return deps.routes[FULL]


async def measure(
    requests: int = REQUESTS, rounds: int = ROUNDS, warmup: int = WARMUP
) -> dict[str, Any]:
    """The chain's cost per miss and per hit, and each policy's own share of each (µs)."""
    route = every_policy_route()
    bench = _Bench(route)
    plain = compose(route.policies, _upstream)
    timed = [_Timed(p) for p in route.policies]
    watched = compose(timed, _upstream)

    hit = REQUEST_BODY.encode()
    await plain(bench.flow(hit))  # stored: every later request with this body is a hit
    await _per_request(bench, plain, _bodies("warm", warmup))
    await _per_request(bench, watched, _bodies("warm-timed", warmup))

    totals: dict[str, list[float]] = {"miss": [], "hit": []}
    own: dict[str, dict[str, list[float]]] = {"miss": {}, "hit": {}}
    for r in range(rounds):
        # An agent asking again sends equal bytes in a new object (whose hash is not known yet).
        again = [bytes(bytearray(hit)) for _ in range(requests)]
        for path, bodies in (("miss", _bodies(f"miss {r}", requests)), ("hit", again)):
            totals[path].append(await _per_request(bench, plain, bodies))
            for t in timed:
                t.inside = 0.0
            extra = bodies if path == "hit" else _bodies(f"timed {r}", requests)
            await _per_request(bench, watched, extra)
            for t, seconds in zip(timed, own_seconds([t.inside for t in timed]), strict=True):
                own[path].setdefault(type(t.policy).__name__, []).append(seconds / requests)
    return {
        "loop": chosen("auto"),
        "requests": requests,
        "rounds": rounds,
        "total_us": {p: min(v) * 1e6 for p, v in totals.items()},
        "own_us": {
            p: {name: statistics.median(v) * 1e6 for name, v in by_policy.items()}
            for p, by_policy in own.items()
        },
    }


def run(pinning: Pinning) -> Scenario:
    """Measure in a fresh interpreter on the proxy's CPU; the figures as a scenario."""
    argv = [*pinning.prefix(pinning.proxy_cpu), sys.executable, "-m", "bench.chain"]
    s = Scenario("core/chain")
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        s.error = "bench.chain took over 300 s"
        return s
    if out.returncode != 0:
        s.error = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
        return s
    found = json.loads(out.stdout.strip().splitlines()[-1])
    total, own = found["total_us"], found["own_us"]
    s.figures = [
        Figure("every policy, miss", f"{total['miss']:.1f} us"),
        Figure("hit", f"{total['hit']:.1f} us"),
    ]
    s.details = [
        f"the every-policy route's chain over an upstream answering at once, no sockets, "
        f"{found['loop']}, one request at a time on the proxy's CPU; totals: the fastest of "
        f"{found['rounds']} rounds of {found['requests']:,} requests; each policy's own time "
        "(median of rounds) in chain order, miss / hit:",
        *(
            f"  {name:<16} {us:6.1f} / {_reached(own['hit'].get(name, 0.0))} us"
            for name, us in own["miss"].items()
        ),
    ]
    return s


def _reached(us: float) -> str:
    return f"{us:5.1f}" if us else "    -"  # after the cache: a hit never gets there


def main() -> None:
    factory: Callable[[], asyncio.AbstractEventLoop] | None = loop_factory("auto")
    with asyncio.Runner(loop_factory=factory) as runner:
        print(json.dumps(runner.run(measure())))


if __name__ == "__main__":
    main()

"""Recovery after outages: what agents get once the vendor is healthy again, and what the
breaker costs the vendor while it stays down.

Each scenario runs three proxies side by side, one route each, differing only in the breaker:

    today:    breaker {fail_max: 5, reset_timeout: 5s}
    adaptive: breaker {fail_max: 5, open_initial: 500ms, open_multiplier: 2, reset_timeout: 30s,
                       max_wait: 1500ms, slow_start: 2s,
                       probe: {every: 1s, method: POST, path: /search, body: <a search>}}
    no-wait:  adaptive without max_wait (refused at once while open, as today)

and otherwise (all alike) `retry: {attempts: 2, backoff 10-50 ms}`, `cache: {ttl: 10m}`,
`search: {vendor: tavily}`. Each proxy has a fake vendor of its own (served from a thread of
this process, so its faults switch at exact times); all of them switch together. Agents call
each proxy open-loop at RATE calls/s (a call every 25 ms whatever the answers), every query new,
so the cache cannot answer and only the breaker decides what agents get.

- flapping: LEAD_IN s healthy, then CYCLES x [6 s down (503 to every call), 6 s healthy, 6 s
  of a 429 storm (429 with Retry-After: 1), 6 s healthy]. Figure: answered % (200 with results)
  of the calls sent during the healthy windows that follow an outage. Target (adaptive): >= 99%.
- hard outage: LEAD_IN s healthy, then 60 s down. Figure: the fake vendor's search calls during
  the outage sent for agents (the adaptive config's active probes are counted apart: in
  production they go to a free endpoint of the operator's choosing). Target (adaptive): no more
  than today's, measured in the same run.

The adaptive probe is a search with a fixed query (the fake has no free endpoint): it fails
exactly when searches fail, as a vendor's health or usage endpoint is expected to.

Reading no-wait's figure: its probes run a second apart from the trip, which comes ~0.1 s into
each outage, so with outages of exactly 6 s one probe lands just after the vendor recovers.
Any other phase refuses up to `every` (1 s, 40 calls) per window: with 6.5 s outages it
answered about 93% while adaptive stayed at 100% (its waits outlast the probe interval).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.procs import Pinning, client_pinned, get_text, metric_sum, proxy
from bench.report import Figure, Scenario, at_least, at_most, percentile
from testkit.fakevendor import FakeVendor, Fault, ThreadedFakeVendor
from testkit.procs import StartError

ROUTE = "tavily"
RATE = 40  # agent calls per second, per proxy
LEAD_IN_S = 2.0
OUTAGE_S = 6.0
HEALTHY_S = 6.0
CYCLES = 2
HARD_OUTAGE_S = 60.0
REQUEST_TIMEOUT_S = 20.0
ANSWERED_TARGET = 99.0
PROBE_QUERY = "recovery probe"

RETRY = {"attempts": 2, "backoff": {"initial": "10ms", "max": "50ms"}}
TIMEOUTS = {"connect": "1s", "per_try": "2s", "total": "10s"}
TODAY = {"fail_max": 5, "reset_timeout": "5s"}
ADAPTIVE = {
    "fail_max": 5,
    "open_initial": "500ms",
    "open_multiplier": 2,
    "reset_timeout": "30s",
    "max_wait": "1500ms",
    "slow_start": "2s",
    "probe": {
        "every": "1s",
        "method": "POST",
        "path": "/search",
        "body": json.dumps({"query": PROBE_QUERY, "max_results": 1}),
        "expect": [200],
    },
}
# The same without waiting: what max_wait adds, and what it costs while the vendor stays down.
NO_WAIT = {k: v for k, v in ADAPTIVE.items() if k != "max_wait"}
CONFIGS: dict[str, dict[str, Any]] = {"today": TODAY, "adaptive": ADAPTIVE, "no-wait": NO_WAIT}

KEEP = ("X-Circuit", "X-Cache")


def _route(upstream: str, breaker: dict[str, Any]) -> dict[str, Any]:
    return {
        "prefix": f"/{ROUTE}",
        "upstream": upstream,
        "timeouts": TIMEOUTS,
        "retry": RETRY,
        "breaker": breaker,
        "cache": {"ttl": "10m", "stale_ttl": "1h"},
        "search": {"vendor": "tavily"},
    }


# ------------------------------------------------------------------------------- phases


@dataclass(frozen=True)
class Phase:
    kind: str  # healthy, down, 429
    start: float  # seconds from the run's start
    end: float
    after_outage: bool = False  # a healthy window that follows an outage: what is measured


def _phases(plan: list[tuple[str, float]]) -> list[Phase]:
    phases, t, previous = [], 0.0, ""
    for kind, seconds in plan:
        after = kind == "healthy" and previous in ("down", "429")
        phases.append(Phase(kind, t, t + seconds, after))
        t += seconds
        previous = kind
    return phases


def _switch(vendor: FakeVendor, kind: str) -> None:
    if kind == "down":
        vendor.down(503)
    elif kind == "429":
        vendor.up().set_default(Fault.status(429, retry_after=1))
    else:
        vendor.up().set_default(Fault.ok())


# ------------------------------------------------------------------------------- agents


@dataclass
class Call:
    sent: float  # seconds from the run's start
    status: int  # 0: no HTTP answer
    seconds: float
    results: int = 0
    circuit: bool = False  # answered by the breaker (X-Circuit: open)

    @property
    def answered(self) -> bool:
        return self.status == 200 and self.results > 0


@dataclass
class Run:
    """One proxy's side of a scenario."""

    label: str
    url: str
    vendor: FakeVendor
    calls: list[Call] = field(default_factory=list)
    metrics: str = ""


def results_in(body: bytes) -> int:
    """How many results a Tavily-shaped answer body lists (0 for anything else)."""
    try:
        data = json.loads(body)
    except ValueError:
        return 0
    results = data.get("results") if isinstance(data, dict) else None
    return len(results) if isinstance(results, list) else 0


async def _call(session: aiohttp.ClientSession, run: Run, i: int, sent: float) -> None:
    started = time.perf_counter()
    body = {"query": f"recovery {run.label} query {i}", "max_results": 3}
    try:
        async with session.post(f"{run.url}/{ROUTE}/search", json=body) as resp:
            data = await resp.read()
            call = Call(sent, resp.status, 0.0, results_in(data), "X-Circuit" in resp.headers)
    except (aiohttp.ClientError, TimeoutError):
        call = Call(sent, 0, 0.0)
    call.seconds = time.perf_counter() - started
    run.calls.append(call)


async def _drive(runs: list[Run], phases: list[Phase]) -> float:
    """Switch the vendors through `phases` while agents call every proxy at RATE; returns the
    run's start on the monotonic clock (the fake vendors stamp requests with it)."""
    sessions = [
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        )
        for _ in runs
    ]
    start = time.monotonic()
    end = phases[-1].end
    tasks: list[asyncio.Task[None]] = []

    async def switcher() -> None:
        for phase in phases:
            await asyncio.sleep(max(0.0, start + phase.start - time.monotonic()))
            for run in runs:
                _switch(run.vendor, phase.kind)

    try:
        switching = asyncio.create_task(switcher())
        for i in range(int(end * RATE)):
            sent = i / RATE
            await asyncio.sleep(max(0.0, start + sent - time.monotonic()))
            for run, session in zip(runs, sessions, strict=True):
                tasks.append(asyncio.create_task(_call(session, run, i, sent)))
        await switching
        await asyncio.gather(*tasks)
    finally:
        for session in sessions:
            await session.close()
    return start


@contextlib.contextmanager
def _side_by_side(pinning: Pinning) -> Iterator[list[Run]]:
    """A fake vendor and a proxy for each config."""
    with contextlib.ExitStack() as stack:
        runs = []
        for label, breaker in CONFIGS.items():
            vendor = FakeVendor(record=True)
            served = stack.enter_context(ThreadedFakeVendor(vendor).start())
            url, _ = stack.enter_context(
                proxy(pinning, {ROUTE: _route(f"{served.url}/tavily", breaker)})
            )
            runs.append(Run(label, url, vendor))
        yield runs


def _is_probe(body: bytes) -> bool:
    return PROBE_QUERY.encode() in body


def _vendor_calls(run: Run, start: float, phase: Phase) -> tuple[int, int]:
    """(agent-driven calls, probe calls) the fake vendor received during `phase`."""
    lo, hi = start + phase.start, start + phase.end
    inside = [r for r in run.vendor.requests if lo <= r.at < hi]
    probes = sum(1 for r in inside if _is_probe(r.body))
    return len(inside) - probes, probes


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _metric(metrics: str, name: str, **labels: str) -> float:
    return metric_sum(metrics, name, route=ROUTE, **labels) or 0.0


def _breaker_line(run: Run) -> str:
    m = run.metrics
    opened = _metric(m, "search_proxy_breaker_transitions_total", to="open")
    closed = _metric(m, "search_proxy_breaker_transitions_total", to="closed")
    line = f"{run.label}: breaker opened {opened:.0f} and closed {closed:.0f} time(s)"
    open_s = metric_sum(m, "search_proxy_breaker_open_seconds_total", route=ROUTE)
    if open_s is not None:
        line += f", open {open_s:.1f} s in all"
    probes = {
        r: _metric(m, "search_proxy_breaker_probes_total", result=r) for r in ("ok", "failed")
    }
    if any(probes.values()):
        line += f"; active probes ok {probes['ok']:.0f}, failed {probes['failed']:.0f}"
    return line


# ------------------------------------------------------------------------------- scenarios


def flapping(pinning: Pinning) -> Scenario:
    name = "recovery/flapping-vendor"
    cycle = [("down", OUTAGE_S), ("healthy", HEALTHY_S), ("429", OUTAGE_S), ("healthy", HEALTHY_S)]
    phases = _phases([("healthy", LEAD_IN_S), *cycle * CYCLES])
    with _side_by_side(pinning) as runs:
        start = asyncio.run(_drive(runs, phases))
        for run in runs:
            run.metrics = get_text(f"{run.url}/metrics")
    s = Scenario(name)
    measured = [p for p in phases if p.after_outage]
    for run in runs:
        calls = [c for c in run.calls if any(p.start <= c.sent < p.end for p in measured)]
        answered = sum(1 for c in calls if c.answered)
        share = answered / len(calls) * 100 if calls else 0.0
        label = f"{run.label}: answered while healthy"
        if run.label == "adaptive":
            s.figures.append(at_least(label, share, ANSWERED_TARGET, "{:.1f}%"))
        else:
            s.figures.append(Figure(label, f"{share:.1f}%"))
        per_window = []
        for p in measured:
            inside = [c for c in calls if p.start <= c.sent < p.end]
            ok = sum(1 for c in inside if c.answered)
            per_window.append(f"{ok}/{len(inside)}")
        statuses = Counter(c.status for c in calls)
        refused = sum(1 for c in calls if c.circuit)
        shown = ", ".join(f"{k or 'no answer'} x {v}" for k, v in sorted(statuses.items()))
        s.details.append(
            f"{run.label}: {answered}/{len(calls)} calls answered in the healthy windows after "
            f"an outage (by window: {', '.join(per_window)}); agents saw {shown}; "
            f"{refused} answered by the breaker; latency p50 "
            f"{_ms(percentile([c.seconds for c in calls], 50))} p99 "
            f"{_ms(percentile([c.seconds for c in calls], 99))}"
        )
        agent = probe = 0
        for p in phases:
            if p.kind != "healthy":
                a, b = _vendor_calls(run, start, p)
                agent, probe = agent + a, probe + b
        s.details.append(
            f"{run.label}: vendor calls during the {2 * CYCLES} outages: {agent} for agents"
            + (f", {probe} active probes" if probe else "")
            + "; "
            + _breaker_line(run)
        )
    s.details.insert(
        0,
        f"{RATE} calls/s per proxy, every query new; {LEAD_IN_S:.0f} s healthy, then {CYCLES} x "
        f"[{OUTAGE_S:.0f} s down (503), {HEALTHY_S:.0f} s healthy, {OUTAGE_S:.0f} s 429 storm, "
        f"{HEALTHY_S:.0f} s healthy]; measured: calls sent in the {len(measured)} healthy "
        "windows after an outage",
    )
    return s


def hard_outage(pinning: Pinning) -> Scenario:
    name = "recovery/hard-outage"
    phases = _phases([("healthy", LEAD_IN_S), ("down", HARD_OUTAGE_S)])
    outage = phases[-1]
    with _side_by_side(pinning) as runs:
        start = asyncio.run(_drive(runs, phases))
        for run in runs:
            run.vendor.up()
            run.metrics = get_text(f"{run.url}/metrics")
    s = Scenario(name)
    counted = {run.label: _vendor_calls(run, start, outage) for run in runs}
    today = counted["today"][0] if "today" in counted else None
    for run in runs:
        agent, probes = counted[run.label]
        label = f"{run.label}: vendor calls"
        if run.label == "adaptive" and today is not None:
            s.figures.append(at_most(label, agent, today, "{:.0f}"))
        else:
            s.figures.append(Figure(label, f"{agent}"))
        calls = [c for c in run.calls if outage.start <= c.sent < outage.end]
        refused = [c for c in calls if c.circuit]
        s.details.append(
            f"{run.label}: {agent} vendor calls for agents"
            + (f" and {probes} active probes" if probes else "")
            + f" during the {HARD_OUTAGE_S:.0f} s outage ({len(calls)} agent calls, "
            f"{sum(1 for c in calls if c.answered)} answered); {len(refused)} answered by the "
            f"breaker, latency p50 {_ms(percentile([c.seconds for c in refused], 50))} "
            f"p99 {_ms(percentile([c.seconds for c in refused], 99))}; " + _breaker_line(run)
        )
    s.details.insert(
        0,
        f"{RATE} calls/s per proxy, every query new; {LEAD_IN_S:.0f} s healthy, then the vendor "
        f"answers 503 to every call for {HARD_OUTAGE_S:.0f} s; target: no more vendor calls for "
        "agents than today's config in the same run",
    )
    return s


SCENARIOS: tuple[Callable[[Pinning], Scenario], ...] = (flapping, hard_outage)


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    """Each scenario with its own proxies and fake vendors; one failing does not stop the next."""
    with client_pinned(pinning):
        for scenario in SCENARIOS:
            try:
                emit(scenario(pinning))
            except StartError as exc:
                emit(Scenario(f"recovery/{scenario.__name__}", error=f"{exc}"))

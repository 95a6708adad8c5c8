"""The chaos minute: ten agents searching for a minute while the primary vendor walks through its
ways of failing, and the 429 storm an agent's turn must not wait out.

The proxies run the shipped config.yaml's tavily, exa and brave routes as shipped (keys from the
bench, upstreams at in-process fake vendors), but for Tavily's rate limit: the config's own
production-key line (rate 500/m, burst 500) instead of the dev-key one (50/m), which ten agents
outgrow in seconds. Every fake vendor answers after 50-150 ms.

- minute: two proxies side by side, the shipped config (tavily falls back to exa, then brave)
  and the same without `fallback`, each with fake vendors of its own that switch together. Ten
  agents per proxy, each a loop: search, think 0.5-1.5 s, search again; REPEAT of their queries
  were asked before in the run (agents researching one topic overlap; the cache answers those),
  the others are new. The primary walks through healthy / down (503) / a 429 storm
  (Retry-After: 2) / 20% of calls hanging / 20% malformed bodies / 30% 503s, 6 s each, with 5 s
  healthy between; exa and brave answer 503 to FALLBACK_FAIL of calls throughout. Per state:
  answered % (200 with results), p99, and vendor calls (searches, every vendor) per answer.
  Targets, with fallback: every fault state >= 99% answered, p99 <= 1 s, <= 1.0 calls per
  answer; without: >= 99% answered in the healthy windows after a fault.
- 429 storm: one proxy with fallback, the primary answering 429 with Retry-After: 2 to every
  search; 30 searches from ten agents at once (three each, in turn). Target: p99 <= 500 ms.
- hard outage: the shipped config without fallback and the same with the breaker as before
  this change (`probe: false`, `max_wait: 0s`), 60 s of 503s at 10 calls/s each: search calls the
  vendor got for agents (the vendor probe's usage calls, which cost no credits, counted apart).
  Target: no more than before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.client import result_count
from bench.procs import Pinning, client_pinned, get_text, metric_sum, proxy
from bench.report import Figure, Scenario, at_least, at_most, percentile
from proxy.config.loading import read_document
from testkit.fakevendor import FakeVendor, Fault, ThreadedFakeVendor
from testkit.procs import StartError

SHIPPED = Path(__file__).resolve().parent.parent / "config.yaml"
VENDORS = ("tavily", "exa", "brave")
AGENTS = 10
THINK_S = (0.5, 1.5)
REPEAT = 0.4
FALLBACK_FAIL = 0.1
LATENCY_S = (0.1, 0.05)  # fake vendors: 100 ms +- 50 ms
REQUEST_TIMEOUT_S = 15.0
HEALTHY_S, FAULT_S = 5.0, 6.0
FAULTS = ("down", "429 storm", "20% hangs", "20% malformed", "30% 503")
ANSWERED_TARGET = 99.0
P99_TARGET_S = 1.0
CALLS_TARGET = 1.0
STORM_REQUESTS = 30
STORM_P99_TARGET_S = 0.5
HARD_OUTAGE_S = 60.0
HARD_RATE = 10  # calls per second per proxy, every query new
SEED = 24


# ------------------------------------------------------------------------------- config


def shipped_routes(urls: dict[str, str], *, fallback: bool = True) -> dict[str, Any]:
    """config.yaml's tavily, exa and brave routes, their keys set, upstreams at `urls`."""
    shipped = read_document(SHIPPED)["routes"]  # the proxy's own reading: `on:` stays a key
    routes: dict[str, Any] = {}
    for name in VENDORS:
        body = json.loads(json.dumps(shipped[name]))
        body["upstream"] = f"{urls[name]}/{name}"
        headers = body.get("headers", {}).get("set", {})
        for header, value in headers.items():  # "${TAVILY_API_KEY:-}" -> a bench key
            headers[header] = value.split("${")[0] + f"bench-{name}-key"
        routes[name] = body
    # The config's own line for production keys: ten agents outgrow a dev key in seconds.
    routes["tavily"]["rate_limit"].update(rate="500/m", burst=500)
    if not fallback:  # and the hedge goes to Tavily itself, as it must without one
        del routes["tavily"]["fallback"], routes["tavily"]["hedge"]["to"]
    return routes


@dataclass
class Side:
    """One proxy and the fake vendors behind it."""

    label: str
    url: str
    vendors: dict[str, FakeVendor]
    calls: list[Call] = field(default_factory=list)
    metrics: str = ""

    @property
    def primary(self) -> FakeVendor:
        return self.vendors["tavily"]


def _fakes(stack: contextlib.ExitStack) -> tuple[dict[str, FakeVendor], dict[str, str]]:
    vendors, urls = {}, {}
    for i, name in enumerate(VENDORS):
        fake = FakeVendor(seed=SEED + i).latency(*LATENCY_S)
        if name != "tavily":
            fake.fail_ratio(FALLBACK_FAIL, 503)
        served = stack.enter_context(ThreadedFakeVendor(fake).start())
        vendors[name], urls[name] = fake, served.url
    return vendors, urls


@contextlib.contextmanager
def _sides(
    pinning: Pinning, configs: dict[str, Callable[[dict[str, str]], dict[str, Any]]]
) -> Iterator[list[Side]]:
    with contextlib.ExitStack() as stack:
        sides = []
        for label, routes in configs.items():
            vendors, urls = _fakes(stack)
            url, _ = stack.enter_context(proxy(pinning, routes(urls)))
            sides.append(Side(label, url, vendors))
        yield sides


# ------------------------------------------------------------------------------- phases


@dataclass(frozen=True)
class Phase:
    kind: str
    start: float
    end: float
    after_fault: bool = False


def _phases() -> list[Phase]:
    phases, t = [Phase("healthy", 0.0, HEALTHY_S)], HEALTHY_S
    for fault in FAULTS:
        phases.append(Phase(fault, t, t + FAULT_S))
        phases.append(Phase("healthy", t + FAULT_S, t + FAULT_S + HEALTHY_S, True))
        t += FAULT_S + HEALTHY_S
    return phases


def switch_fault(vendor: FakeVendor, fault: str | None, retry_after: float = 2.0) -> None:
    """The primary's fault for a window, one of FAULTS (None: healthy); a 429 storm's answers
    say Retry-After: `retry_after`."""
    vendor.up().set_default(Fault.ok()).hang_ratio(0).malformed_ratio(0).fail_ratio(0)
    if fault == "down":
        vendor.down(503)
    elif fault == "429 storm":
        vendor.set_default(Fault.status(429, retry_after=retry_after))
    elif fault == "20% hangs":
        vendor.hang_ratio(0.2, 20.0)
    elif fault == "20% malformed":
        vendor.malformed_ratio(0.2)
    elif fault == "30% 503":
        vendor.fail_ratio(0.3, 503)


# ------------------------------------------------------------------------------- agents


@dataclass
class Call:
    sent: float  # seconds from the run's start
    status: int = 0  # 0: no HTTP answer (timeout, connection error)
    seconds: float = 0.0
    results: int = 0
    provider: str = ""
    new: bool = True  # a query not asked before in the run

    @property
    def answered(self) -> bool:
        return self.status == 200 and self.results > 0


async def _search(
    session: aiohttp.ClientSession, side: Side, query: str, start: float, new: bool
) -> Call:
    call = Call(time.monotonic() - start, new=new)
    began = time.perf_counter()
    try:
        body = {"query": query, "max_results": 3}
        async with session.post(f"{side.url}/tavily/search", json=body) as resp:
            call.status, call.results = resp.status, result_count(await resp.read())
            call.provider = resp.headers.get("X-Search-Provider", "tavily")
    except (aiohttp.ClientError, TimeoutError):
        pass
    call.seconds = time.perf_counter() - began
    side.calls.append(call)
    return call


async def _agent(
    session: aiohttp.ClientSession, side: Side, n: int, asked: list[str], start: float, end: float
) -> None:
    rng = random.Random(SEED * 100 + n)
    turn = 0
    while time.monotonic() - start < end:
        if asked and rng.random() < REPEAT:
            query, new = rng.choice(asked[-200:]), False
        else:
            query, new = f"chaos agent {n} turn {turn} on resilient search", True
            asked.append(query)
        turn += 1
        await _search(session, side, query, start, new)
        await asyncio.sleep(rng.uniform(*THINK_S))


async def _minute(sides: list[Side], phases: list[Phase]) -> float:
    """Run the agents against every side while the primaries walk through `phases`; returns
    the run's start (time.monotonic, as the fake vendors stamp requests)."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        start = time.monotonic()
        end = phases[-1].end

        async def switcher() -> None:
            for phase in phases:
                await asyncio.sleep(max(0.0, start + phase.start - time.monotonic()))
                for side in sides:
                    switch_fault(side.primary, phase.kind)

        asked: dict[str, list[str]] = {s.label: [] for s in sides}
        agents = [
            _agent(session, side, n, asked[side.label], start, end)
            for side in sides
            for n in range(AGENTS)
        ]
        await asyncio.gather(switcher(), *agents)
    return start


# ------------------------------------------------------------------------------- figures


def _in(calls: list[Call], phase: Phase) -> list[Call]:
    return [c for c in calls if phase.start <= c.sent < phase.end]


def _vendor_calls(side: Side, start: float, lo: float, hi: float) -> tuple[int, int]:
    """(searches, usage probes) every fake vendor of `side` got between lo and hi."""
    by = _by_vendor(side, start, lo, hi)
    probes = by.pop("usage", 0)
    return sum(by.values()), probes


def _by_vendor(side: Side, start: float, lo: float, hi: float) -> dict[str, int]:
    """Searches each fake vendor of `side` got between lo and hi, and the usage probes."""
    by: dict[str, int] = {}
    for name, vendor in side.vendors.items():
        for r in vendor.requests:
            if start + lo <= r.at < start + hi:
                which = "usage" if r.path.endswith("/usage") else name
                by[which] = by.get(which, 0) + 1
    return by


def _share(calls: list[Call]) -> float:
    return 100.0 * sum(1 for c in calls if c.answered) / len(calls) if calls else float("nan")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _state_line(side: Side, start: float, phase_calls: list[Call], lo: float, hi: float) -> str:
    answered = sum(1 for c in phase_calls if c.answered)
    searches, probes = _vendor_calls(side, start, lo, hi)
    each = _by_vendor(side, start, lo, hi)
    each.pop("usage", None)
    new = [c for c in phase_calls if c.new]
    by = sorted({c.provider for c in phase_calls if c.answered})
    return (
        f"{answered}/{len(phase_calls)} answered ({_share(phase_calls):.1f}%), p50 "
        f"{_ms(percentile([c.seconds for c in phase_calls], 50))} p99 "
        f"{_ms(percentile([c.seconds for c in phase_calls], 99))}, "
        f"{searches / answered if answered else float('nan'):.2f} vendor calls per answer "
        f"({searches} searches: {', '.join(f'{k} {v}' for k, v in sorted(each.items()))}; "
        f"{probes} usage probes); new queries only: "
        f"{_share(new):.1f}% answered, p99 {_ms(percentile([c.seconds for c in new], 99))}; "
        f"answered by {', '.join(by) or 'none'}"
    )


def minute(pinning: Pinning) -> list[Scenario]:
    phases = _phases()
    configs = {
        "with fallback": lambda urls: shipped_routes(urls),
        "no fallback": lambda urls: shipped_routes(urls, fallback=False),
    }
    with _sides(pinning, configs) as sides:
        start = asyncio.run(_minute(sides, phases))
        for side in sides:
            side.metrics = get_text(f"{side.url}/metrics")
    out = []
    fallback, alone = sides
    s = Scenario("chaos/minute-with-fallback")
    for kind in FAULTS:
        phase = next(p for p in phases if p.kind == kind)
        calls = _in(fallback.calls, phase)
        answered = sum(1 for c in calls if c.answered)
        searches, _ = _vendor_calls(fallback, start, phase.start, phase.end)
        s.figures.append(at_least(f"{kind}: answered", _share(calls), ANSWERED_TARGET, "{:.1f}%"))
        p99 = percentile([c.seconds for c in calls], 99)
        s.figures.append(at_most("p99", p99, P99_TARGET_S, "{:.2f} s"))
        per = searches / answered if answered else float("inf")
        s.figures.append(at_most("calls/answer", per, CALLS_TARGET, "{:.2f}"))
        s.details.append(f"{kind}: " + _state_line(fallback, start, calls, phase.start, phase.end))
    healthy = [p for p in phases if p.kind == "healthy"]
    calls = [c for p in healthy for c in _in(fallback.calls, p)]
    searches = sum(_vendor_calls(fallback, start, p.start, p.end)[0] for p in healthy)
    s.details.append(
        f"healthy windows: {_share(calls):.1f}% answered, p99 "
        f"{_ms(percentile([c.seconds for c in calls], 99))}, "
        f"{searches / max(1, sum(c.answered for c in calls)):.2f} calls per answer"
    )
    every = Phase("all", 0.0, phases[-1].end)
    s.details.append(
        "the whole minute: "
        + _state_line(fallback, start, _in(fallback.calls, every), 0.0, every.end)
    )
    s.details.insert(0, _setup(len(fallback.calls)))
    s.details.append(_metrics_line(fallback.metrics))
    out.append(s)

    s = Scenario("chaos/minute-no-fallback")
    after = [p for p in phases if p.after_fault]
    calls = [c for p in after for c in _in(alone.calls, p)]
    s.figures.append(
        at_least("answered in the healthy windows after a fault", _share(calls), 99.0, "{:.1f}%")
    )
    windows = []
    for p in after:
        inside = _in(alone.calls, p)
        windows.append(f"{sum(1 for c in inside if c.answered)}/{len(inside)}")
    s.details.append(
        "the shipped config without fallback, the same agents and faults; healthy windows after "
        f"each fault: {', '.join(windows)}; p99 there "
        f"{_ms(percentile([c.seconds for c in calls], 99))}"
    )
    for kind in FAULTS:
        phase = next(p for p in phases if p.kind == kind)
        inside = _in(alone.calls, phase)
        s.details.append(f"{kind}: " + _state_line(alone, start, inside, phase.start, phase.end))
    s.details.append(_metrics_line(alone.metrics))
    out.append(s)
    return out


def _setup(n: int) -> str:
    return (
        f"{AGENTS} agents per proxy, think {THINK_S[0]}-{THINK_S[1]} s, {REPEAT:.0%} of queries "
        f"asked before in the run; primary: {HEALTHY_S:.0f} s healthy, then each of "
        f"{', '.join(FAULTS)} for {FAULT_S:.0f} s with {HEALTHY_S:.0f} s healthy after; exa and "
        f"brave 503 on {FALLBACK_FAIL:.0%} of calls; {n} searches in all; calls per answer counts "
        "every vendor's searches (usage probes apart)"
    )


def _metrics_line(metrics: str) -> str:
    def m(name: str, **labels: str) -> float:
        return metric_sum(metrics, name, **labels) or 0.0

    return (
        "proxy /metrics: tavily breaker opened "
        f"{m('search_proxy_breaker_transitions_total', route='tavily', to='open'):.0f} time(s), "
        f"probes ok {m('search_proxy_breaker_probes_total', route='tavily', result='ok'):.0f} "
        f"failed {m('search_proxy_breaker_probes_total', route='tavily', result='failed'):.0f}; "
        f"failovers answered "
        f"{m('search_proxy_failovers_total', route='tavily', result='answered'):.0f}; hedges won "
        f"{m('search_proxy_hedges_total', route='tavily', result='won'):.0f}; cache hits "
        f"{m('search_proxy_cache_total', route='tavily', result='hit'):.0f}"
    )


# ------------------------------------------------------------------------------- storm


async def _storm(side: Side) -> list[Call]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.monotonic()

        async def agent(n: int) -> None:
            for turn in range(STORM_REQUESTS // AGENTS):
                await _search(session, side, f"storm agent {n} turn {turn}", start, True)

        await asyncio.gather(*(agent(n) for n in range(AGENTS)))
    return side.calls


def storm(pinning: Pinning) -> list[Scenario]:
    with _sides(pinning, {"storm": lambda urls: shipped_routes(urls)}) as (side,):
        for vendor in side.vendors.values():
            vendor.fail_ratio(0)  # healthy fallbacks
        side.primary.set_default(Fault.status(429, retry_after=2))
        calls = asyncio.run(_storm(side))
        side.metrics = get_text(f"{side.url}/metrics")
    s = Scenario("chaos/429-storm")
    seconds = [c.seconds for c in calls]
    s.figures = [
        Figure("answered", f"{sum(1 for c in calls if c.answered)}/{len(calls)}"),
        at_most("p99", percentile(seconds, 99), STORM_P99_TARGET_S, "{:.3f} s"),
    ]
    by: dict[str, int] = {}
    for c in calls:
        by[c.provider or "none"] = by.get(c.provider or "none", 0) + 1
    s.details = [
        f"{STORM_REQUESTS} searches from {AGENTS} agents at once (three each, in turn) while "
        "tavily answers 429 with Retry-After: 2 to every search; exa and brave healthy",
        f"answered by {', '.join(f'{k} x {v}' for k, v in sorted(by.items()))}; tavily got "
        f"{side.primary.count('/tavily/search')} searches; p50 "
        f"{_ms(percentile(seconds, 50))} max {_ms(max(seconds))}",
    ]
    return [s]


# ------------------------------------------------------------------------------- hard outage


def _before(urls: dict[str, str]) -> dict[str, Any]:
    routes = shipped_routes(urls, fallback=False)
    routes["tavily"]["breaker"].update(probe=False, max_wait="0s")
    return routes


async def _hard(sides: list[Side], lead_in: float) -> float:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        start = time.monotonic()
        tasks = []
        for i in range(int((lead_in + HARD_OUTAGE_S) * HARD_RATE)):
            sent = i / HARD_RATE
            await asyncio.sleep(max(0.0, start + sent - time.monotonic()))
            if i == int(lead_in * HARD_RATE):
                for side in sides:
                    side.primary.down(503)
            for side in sides:
                query = f"hard outage {i}"
                tasks.append(asyncio.create_task(_search(session, side, query, start, True)))
        await asyncio.gather(*tasks)
    return start


def hard_outage(pinning: Pinning) -> list[Scenario]:
    lead_in = 2.0
    configs = {
        "now": lambda urls: shipped_routes(urls, fallback=False),
        "before": _before,
    }
    with _sides(pinning, configs) as sides:
        start = asyncio.run(_hard(sides, lead_in))
        for side in sides:
            side.primary.up()
    s = Scenario("chaos/hard-outage")
    counted = {
        side.label: _vendor_calls(side, start, lead_in, lead_in + HARD_OUTAGE_S) for side in sides
    }
    s.figures = [
        at_most("now: search calls", counted["now"][0], counted["before"][0], "{:.0f}"),
        Figure("before", f"{counted['before'][0]}"),
    ]
    for side in sides:
        searches, probes = counted[side.label]
        calls = [c for c in side.calls if c.sent >= lead_in]
        s.details.append(
            f"{side.label}: {searches} searches and {probes} usage probes reached tavily during "
            f"the {HARD_OUTAGE_S:.0f} s outage ({len(calls)} agent calls, p50 "
            f"{_ms(percentile([c.seconds for c in calls], 50))} p99 "
            f"{_ms(percentile([c.seconds for c in calls], 99))})"
        )
    s.details.insert(
        0,
        f"{HARD_RATE} calls/s per proxy, every query new; {lead_in:.0f} s healthy, then 503 to "
        f"every call for {HARD_OUTAGE_S:.0f} s; now: the shipped config without fallback; before: "
        "the same with the breaker as before (no vendor probe, max_wait 0s)",
    )
    return [s]


SCENARIOS: tuple[Callable[[Pinning], list[Scenario]], ...] = (storm, minute, hard_outage)


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    """Each scenario with its own proxies and fake vendors; one failing does not stop the next."""
    with client_pinned(pinning):
        for scenario in SCENARIOS:
            try:
                for s in scenario(pinning):
                    emit(s)
            except StartError as exc:
                emit(Scenario(f"chaos/{scenario.__name__}", error=f"{exc}"))

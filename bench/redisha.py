"""Redis behind a fleet: what one request costs Redis, and agents through two replicas while the
Sentinel master is killed.

- commands: two proxies share one redis-server, on a route with every policy that keeps
  shared state (cache, breaker, retry, rate limit, search). N requests of each kind, one at a
  time: miss (new queries through A), hit on another replica's entry (A's queries through B),
  hit in the replica's own tier (the same through A again), refused (a route whose one token is
  spent: 429). Counted by Redis itself: round trips (the commands clients sent, from MONITOR,
  one request at a time), commands run (INFO commandstats, which counts the commands inside
  scripts too) and Redis CPU per request (INFO cpu), both in a second pass without MONITOR,
  IN_FLIGHT requests at a time. Target: a miss <= 3 round trips.
- sentinel-failover: ten agents for CHAOS_S seconds through two replicas sharing a Sentinel set
  (master, replica, three sentinels), the primary vendor walking through its faults in 6 s
  windows (healthy between each: down, 429 storm, 20% hangs, 20% malformed, 30% 503) while the
  two fallback vendors fail 10% at random; 30% of queries repeat an earlier one (any agent's).
  Run once on a healthy Redis, then again with the master SIGKILLed at KILL_AT_S. Targets: the
  second run's answered % within 1 point of the first, and its vendor calls per answer within
  10%; shown: the seconds each replica ran degraded and the failovers it saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import redis

from bench.chaos import FAULTS, switch_fault
from bench.client import result_count
from bench.procs import Pinning, fake_vendor, get_text, metric_sum, proxy, run_scenarios
from bench.report import Figure, Scenario, at_most, percentile
from testkit.fakevendor import FakeVendor, ThreadedFakeVendor
from testkit.redisha import SentinelSet
from testkit.redisserver import RedisServer

ROUTE = "tavily"
TIMEOUTS = {"connect": "1s", "per_try": "2s", "total": "10s"}
RETRY = {"attempts": 2, "backoff": {"initial": "10ms", "max": "50ms"}}
BREAKER = {"fail_max": 5, "reset_timeout": "5s"}
CACHE = {"ttl": "10m", "stale_ttl": "1h", "lock_wait": "1s"}

REQUESTS = 1000  # per kind and pass
IN_FLIGHT = 16  # requests at once in the pass that measures Redis's CPU
MISS_TARGET = 3.0

AGENTS = 10
CHAOS_S = 60.0
WINDOW_S = 6.0
KILL_AT_S = 30.0
THINK_S = 0.02  # an agent's pause between its calls
REPEAT_SHARE = 0.3
FALLBACK_FAILS = 0.1
REQUEST_TIMEOUT_S = 20.0
ANSWERED_NOISE = 1.0  # percentage points
CALLS_NOISE = 0.10  # share of the healthy run's calls per answer
# The primary walks chaos's FAULTS: a fault window, then a healthy one, each WINDOW_S (a
# 429 storm says Retry-After: 1).


def _route(upstream: str, **policies: Any) -> dict[str, Any]:
    return {"prefix": f"/{ROUTE}", "upstream": upstream, "timeouts": TIMEOUTS, **policies}


async def _search(session: aiohttp.ClientSession, url: str, query: str) -> tuple[int, int]:
    """(status, results) of one Tavily-shaped search; status 0 when no HTTP answer came."""
    body = {"query": query, "max_results": 3}
    try:
        async with session.post(f"{url}/{ROUTE}/search", json=body) as resp:
            data = await resp.read()
            return resp.status, result_count(data)
    except (aiohttp.ClientError, TimeoutError):
        return 0, 0


# ---------------------------------------------------------------------------- commands


# Commands the benchmark itself sends to Redis, left out of every count.
_OURS = frozenset({"INFO", "CONFIG", "ECHO", "MONITOR", "PING"})
# Commands no request sends, counted apart: the breakers' periodic read of their shared record
# (each route's, every second on each replica) and a new connection's handshake.
_BACKGROUND = frozenset({"HGETALL", "HELLO", "CLIENT", "AUTH", "SELECT"})
_END = "bench-monitor-end"


def _name(command: str) -> str:
    """A command's name as counted here: `CLIENT|SETINFO` and `CLIENT SETINFO` are CLIENT."""
    return command.split("|", 1)[0].split(" ", 1)[0].upper()


class _Monitor:
    """MONITOR in a thread: the commands clients sent (round trips) and those scripts ran."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sent: Counter[str] = Counter()
        self.inside: Counter[str] = Counter()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._read, name="monitor", daemon=True)

    def _read(self) -> None:
        with redis.Redis(port=self.port) as client, client.monitor() as monitor:
            self._ready.set()
            while True:
                info = monitor.next_command()
                name = _name(str(info["command"]))
                if name == "ECHO" and _END in info["command"]:
                    return
                if name not in _OURS:
                    (self.inside if info["client_type"] == "lua" else self.sent)[name] += 1

    def __enter__(self) -> _Monitor:
        self._thread.start()
        self._ready.wait(5)
        time.sleep(0.05)  # MONITOR is on before the first counted command
        return self

    def __exit__(self, *exc: object) -> None:
        with redis.Redis(port=self.port) as client:
            client.echo(_END)
        self._thread.join(10)


@dataclass
class _Cost:
    """What N requests of one kind cost Redis, per request."""

    kind: str
    round_trips: Counter[str] = field(default_factory=Counter)
    inside: Counter[str] = field(default_factory=Counter)
    commands: dict[str, float] = field(default_factory=dict)  # INFO commandstats, per request
    cpu_us: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)

    @property
    def trips(self) -> float:
        """Round trips per request, the background left out."""
        sent = (v for k, v in self.round_trips.items() if k not in _BACKGROUND)
        return sum(sent) / REQUESTS

    def detail(self) -> str:
        def shown(counts: dict[str, float], per: float) -> str:
            ordered = sorted(counts.items(), key=_desc)
            return ", ".join(f"{k} {v / per:.2f}" for k, v in ordered) or "none"

        sent = {k: v for k, v in self.round_trips.items() if k not in _BACKGROUND}
        background = {k: v for k, v in self.round_trips.items() if k in _BACKGROUND}
        run = {k: v for k, v in self.commands.items() if k not in _BACKGROUND}
        per_core = f"{1e6 / self.cpu_us:,.0f}" if self.cpu_us > 0 else "n/a"
        return (
            f"{self.kind}: {self.trips:.2f} round trips/request ({shown(sent, REQUESTS)}); "
            f"{sum(run.values()):.2f} commands run/request by INFO commandstats, those inside "
            f"scripts included ({shown(run, 1)}); Redis CPU {self.cpu_us:.1f} µs/request (one "
            f"core: ~{per_core} such requests/s); background meanwhile "
            f"{shown(background, REQUESTS)}; answers {dict(self.statuses)}"
        )


def _desc(item: tuple[str, float]) -> float:
    return -item[1]


def _stats(client: redis.Redis) -> tuple[dict[str, int], float]:
    """INFO commandstats calls by command (ours left out), and Redis's CPU seconds so far."""
    calls: Counter[str] = Counter()
    for name, value in client.info("commandstats").items():
        calls[_name(name.removeprefix("cmdstat_"))] += int(value["calls"])
    cpu = client.info("cpu")
    return (
        {k: v for k, v in calls.items() if k not in _OURS},
        float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
    )


async def _send(
    url: str, queries: list[str], route: str = ROUTE, in_flight: int = 1
) -> Counter[int]:
    statuses: Counter[int] = Counter()
    todo = iter(queries)
    async with aiohttp.ClientSession() as session:

        async def sender() -> None:
            for q in todo:
                async with session.post(f"{url}/{route}/search", json={"query": q}) as resp:
                    await resp.read()
                    statuses[resp.status] += 1

        await asyncio.gather(*(sender() for _ in range(in_flight)))
    return statuses


def _measure(server: RedisServer, kind: str, send: Callable[[int], Counter[int]]) -> _Cost:
    """`send(pass)` twice: under MONITOR (round trips), then for commandstats and CPU."""
    cost = _Cost(kind)
    with _Monitor(server.port) as monitor:
        cost.statuses = send(0)
    cost.round_trips, cost.inside = monitor.sent, monitor.inside
    with redis.Redis(port=server.port) as client:
        client.config_resetstat()
        _, cpu_before = _stats(client)
        send(1)
        calls, cpu_after = _stats(client)
    cost.commands = {k: v / REQUESTS for k, v in calls.items() if v}
    cost.cpu_us = (cpu_after - cpu_before) / REQUESTS * 1e6
    return cost


def commands(pinning: Pinning) -> Scenario:
    name = "redis/commands"
    server = RedisServer()
    server.start()
    try:
        with fake_vendor(pinning) as vendor_url:
            policies = {
                "cache": CACHE,
                "breaker": BREAKER,
                "retry": RETRY,
                "rate_limit": {"rate": "100000/s", "burst": 100000},
                "search": {"vendor": "tavily"},
            }
            limited = {**policies, "rate_limit": {"rate": "1/h", "burst": 1}}
            routes = {
                ROUTE: _route(f"{vendor_url}/tavily", **policies),
                "limited": {**_route(f"{vendor_url}/tavily", **limited), "prefix": "/limited"},
            }
            shared = {"url": server.url, "key_prefix": "bench"}
            with (
                proxy(pinning, routes, redis=shared) as (a, _),
                proxy(pinning, routes, redis=shared) as (b, _),
            ):
                costs = _commands_through(server, a, b)
    finally:
        server.stop()
    s = Scenario(name)
    by_kind = {c.kind: c for c in costs}
    s.figures.append(at_most("miss: round trips", by_kind["miss"].trips, MISS_TARGET, "{:.2f}"))
    for kind in ("hit (another replica's entry)", "hit (own tier)", "refused"):
        s.figures.append(Figure(f"{kind}:", f"{by_kind[kind].trips:.2f}"))
    s.details.append(
        f"{REQUESTS} requests of each kind per pass: counted one at a time under MONITOR, then "
        f"{IN_FLIGHT} at a time for INFO commandstats and Redis's CPU; route: cache, breaker, "
        "retry, rate limit and search (tavily); two proxies on one redis-server"
    )
    s.details += [c.detail() for c in costs]
    return s


def _commands_through(server: RedisServer, a: str, b: str) -> list[_Cost]:
    passes = [[f"redis bench {p} query {i}" for i in range(REQUESTS)] for p in (0, 1)]
    # Scripts loaded, Redis's clock measured, the limited route's one token taken.
    for url in (a, b):
        asyncio.run(_send(url, ["warm up"]))
        asyncio.run(_send(url, ["warm up limited", "warm up limited 2"], route="limited"))

    def through(url: str, route: str = ROUTE, tag: str = "") -> Callable[[int], Counter[int]]:
        # The counted pass one at a time; the CPU pass as a fleet sends, many at once.
        return lambda p: asyncio.run(
            _send(url, [q + tag for q in passes[p]], route, in_flight=1 if p == 0 else IN_FLIGHT)
        )

    return [
        _measure(server, "miss", through(a)),
        _measure(server, "hit (another replica's entry)", through(b)),
        _measure(server, "hit (own tier)", through(a)),
        _measure(server, "refused", through(a, "limited", " refused")),
    ]


# ---------------------------------------------------------------------------- chaos


@dataclass
class _ChaosRun:
    """One run of the agents: what they got, what the vendors and the replicas saw."""

    label: str
    calls: list[tuple[int, int, float]] = field(default_factory=list)  # status, results, s
    vendor_calls: int = 0
    degraded_s: list[float] = field(default_factory=list)  # per replica
    failovers: list[float] = field(default_factory=list)
    killed_at: float | None = None
    promoted_after: float | None = None

    @property
    def answered(self) -> int:
        return sum(1 for status, results, _ in self.calls if status == 200 and results > 0)

    @property
    def share(self) -> float:
        return self.answered / len(self.calls) * 100 if self.calls else 0.0

    @property
    def per_answer(self) -> float:
        return self.vendor_calls / self.answered if self.answered else float("nan")


def _chaos_routes(urls: dict[str, str]) -> dict[str, Any]:
    tavily = _route(
        f"{urls['tavily']}/tavily",
        retry=RETRY,
        breaker=BREAKER,
        cache=CACHE,
        search={"vendor": "tavily"},
        fallback={"providers": ["exa", "brave"]},
    )
    routes = {ROUTE: tavily}
    for other, header in (("exa", "x-api-key"), ("brave", "X-Subscription-Token")):
        routes[other] = {
            "prefix": f"/{other}",
            "upstream": f"{urls[other]}/{other}",
            "timeouts": TIMEOUTS,
            "retry": RETRY,
            "headers": {"set": {header: f"bench-{other}-key"}},
            "search": {"vendor": other},
        }
    return routes


async def _agents(
    run: _ChaosRun, replicas: list[str], primary: FakeVendor, kill: Callable[[], float] | None
) -> None:
    rng = random.Random(7)
    asked: list[str] = []
    start = time.monotonic()
    end = start + CHAOS_S
    sessions = [
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
        for _ in replicas
    ]

    async def agent(n: int) -> None:
        session, url = sessions[n % len(replicas)], replicas[n % len(replicas)]
        i = 0
        while time.monotonic() < end:
            if asked and rng.random() < REPEAT_SHARE:
                query = rng.choice(asked)
            else:
                query = f"chaos agent {n} query {i} {run.label}"
                asked.append(query)
            i += 1
            sent = time.perf_counter()
            status, results = await _search(session, url, query)
            run.calls.append((status, results, time.perf_counter() - sent))
            await asyncio.sleep(THINK_S)

    async def walk() -> None:
        windows = [w for fault in FAULTS for w in (None, fault)]
        for k, fault in enumerate(windows):
            await asyncio.sleep(max(0.0, start + k * WINDOW_S - time.monotonic()))
            switch_fault(primary, fault, retry_after=1)

    async def killer() -> None:
        if kill is None:
            return
        await asyncio.sleep(max(0.0, start + KILL_AT_S - time.monotonic()))
        run.killed_at = time.monotonic() - start
        run.promoted_after = await asyncio.to_thread(kill)

    try:
        await asyncio.gather(walk(), killer(), *(agent(n) for n in range(AGENTS)))
    finally:
        for session in sessions:
            await session.close()
        switch_fault(primary, None, retry_after=1)


@contextlib.contextmanager
def _vendors() -> Iterator[tuple[dict[str, FakeVendor], dict[str, str]]]:
    with contextlib.ExitStack() as stack:
        fakes = {name: FakeVendor(seed=i) for i, name in enumerate(("tavily", "exa", "brave"))}
        urls = {}
        for name, fake in fakes.items():
            urls[name] = stack.enter_context(ThreadedFakeVendor(fake).start()).url
            if name != "tavily":
                fake.fail_ratio(FALLBACK_FAILS)
        yield fakes, urls


def _chaos_run(
    pinning: Pinning, label: str, nodes: SentinelSet, kill: Callable[[], float] | None
) -> _ChaosRun:
    run = _ChaosRun(label)
    shared = nodes.config(key_prefix=f"chaos-{label}", timeout="100ms")
    with _vendors() as (fakes, urls):
        routes = _chaos_routes(urls)
        with (
            proxy(pinning, routes, redis=shared) as (a, _),
            proxy(pinning, routes, redis=shared) as (b, _),
        ):
            asyncio.run(_agents(run, [a, b], fakes["tavily"], kill))
            for url in (a, b):
                metrics = get_text(f"{url}/metrics")
                run.degraded_s.append(
                    metric_sum(metrics, "search_proxy_redis_degraded_seconds_total") or 0.0
                )
                run.failovers.append(metric_sum(metrics, "search_proxy_redis_failovers_total") or 0)
        run.vendor_calls = sum(f.count() for f in fakes.values())
    return run


def sentinel_failover(pinning: Pinning) -> Scenario:
    name = "redis/sentinel-failover"
    with SentinelSet() as nodes:

        def kill() -> float:
            killed = time.monotonic()
            nodes.wait_promoted(nodes.kill_master())
            return time.monotonic() - killed

        nodes.wait_agreed()
        healthy = _chaos_run(pinning, "healthy", nodes, None)
        failover = _chaos_run(pinning, "failover", nodes, kill)
    s = Scenario(name)
    s.figures.append(Figure("healthy Redis: answered", f"{healthy.share:.2f}%"))
    floor = healthy.share - ANSWERED_NOISE
    s.figures.append(
        Figure(
            "master killed: answered",
            f"{failover.share:.2f}%",
            f">= {floor:.2f}%",
            failover.share >= floor,
        )
    )
    s.figures.append(Figure("healthy: vendor calls/answer", f"{healthy.per_answer:.2f}"))
    s.figures.append(
        at_most(
            "master killed: vendor calls/answer",
            failover.per_answer,
            healthy.per_answer * (1 + CALLS_NOISE),
            "{:.2f}",
        )
    )
    s.figures.append(Figure("degraded", " + ".join(f"{d:.1f}" for d in failover.degraded_s) + " s"))
    s.details.append(
        f"{AGENTS} agents for {CHAOS_S:.0f} s through two replicas (agents alternate); the primary "
        f"walks {WINDOW_S:.0f} s windows, healthy then {', '.join(FAULTS)}, healthy between each; "
        f"fallbacks exa and brave fail {FALLBACK_FAILS:.0%} at random; {REPEAT_SHARE:.0%} of "
        "queries repeat an earlier one"
    )
    for run in (healthy, failover):
        seconds = [c[2] for c in run.calls]
        line = (
            f"{run.label}: {run.answered}/{len(run.calls)} answered, {run.vendor_calls} vendor "
            f"calls; p50 {percentile(seconds, 50) * 1000:.0f} ms, p99 "
            f"{percentile(seconds, 99) * 1000:.0f} ms; statuses "
            f"{dict(Counter(c[0] for c in run.calls))}"
        )
        if run.killed_at is not None:
            line += (
                f"; master SIGKILLed at {run.killed_at:.1f} s, replica promoted "
                f"{run.promoted_after or 0:.1f} s later; each replica degraded "
                f"{', '.join(f'{d:.1f} s' for d in run.degraded_s)}, failovers seen "
                f"{', '.join(f'{f:.0f}' for f in run.failovers)}"
            )
        s.details.append(line)
    return s


SCENARIOS: tuple[Callable[[Pinning], Scenario], ...] = (commands, sentinel_failover)


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    """Each scenario with its own Redis, proxies and fake vendors."""
    run_scenarios("redis", SCENARIOS, pinning, emit)

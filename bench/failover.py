"""Cross-vendor failover: what an agent pointed at Tavily sees while Tavily is down.

The primary route `tavily` points at a closed loopback port (connection refused); every query
is new (the cache is cold, nothing can answer stale). The route, in both configs:

    retry: {attempts: 3, backoff: {initial: 10ms, max: 50ms}}
    breaker: {fail_max: 5, reset_timeout: 30s}
    cache: {ttl: 10m, stale_ttl: 1h}
    search: {vendor: tavily}

- cold outage: COLD_REQUESTS Tavily-shaped searches POSTed to /tavily/search at concurrency
  CONCURRENCY by an aiohttp client, through config A (no fallback) and then config B (the same
  plus `fallback: {providers: [exa]}`, an `exa` route to the fake vendor with its own key), each
  with a new proxy process. Answered = 200 with at least one result; p50 / p99 of every request.
  Target (B): every search answered;
- translated vs direct: config B with the primary's breaker already open (so the failover
  answers at once), concurrency 1, the same queries to /tavily/search (answered by exa,
  translated into Tavily's shape) and to /exa/search (the same search, straight through the exa
  route), interleaved query by query. Target: <= 1 ms added p50.

The exa route has no cache, so both paths of the second scenario call the vendor every time.
The fake vendor answers at once (latency 0). The load client runs in this process, pinned to
the non-proxy CPU while the group runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.procs import Pinning, client_pinned, fake_vendor, get_json, get_text, metric_sum, proxy
from bench.report import Figure, Scenario, at_most, percentile, spread
from bench.search import QUERIES
from policies.profiles import BUILTIN_PROFILES, build_search_request
from testkit.procs import StartError, free_port

PRIMARY = "tavily"
FALLBACK = "exa"
RETRY = {"attempts": 3, "backoff": {"initial": "10ms", "max": "50ms"}}
FAIL_MAX = 5
BREAKER = {"fail_max": FAIL_MAX, "reset_timeout": "30s"}
CACHE = {"ttl": "10m", "stale_ttl": "1h"}
TIMEOUTS = {"connect": "1s", "per_try": "2s", "total": "10s"}
MAX_RESULTS = 3

COLD_REQUESTS = 1000
CONCURRENCY = 8
COLD_TIME_LIMIT_S = 15.0  # per config: requests not started by then are not sent

DIRECT_QUERIES = 1500  # each asked once through each path
DIRECT_BLOCKS = 4  # the interleaved run cut in blocks, to show how steady the difference is
DIRECT_TIME_LIMIT_S = 15.0  # well inside reset_timeout: the breaker stays open throughout
ADDED_P50_TARGET_MS = 1.0
REQUEST_TIMEOUT_S = 15.0

KEEP = ("X-Search-Provider", "X-Search-Failover", "X-Proxy-Error", "X-Circuit", "X-Cache")


# --------------------------------------------------------------------------------- config


def _routes(dead_url: str, vendor_url: str, *, fallback: bool) -> dict[str, Any]:
    """Config A (fallback=False) or B: the primary at a closed port; in B an exa route too."""
    primary: dict[str, Any] = {
        "prefix": f"/{PRIMARY}",
        "upstream": dead_url,
        "timeouts": TIMEOUTS,
        "retry": RETRY,
        "breaker": BREAKER,
        "cache": CACHE,
        "search": {"vendor": PRIMARY},
    }
    routes: dict[str, Any] = {PRIMARY: primary}
    if fallback:
        primary["fallback"] = {"providers": [FALLBACK]}
        routes[FALLBACK] = {
            "prefix": f"/{FALLBACK}",
            "upstream": f"{vendor_url}/{FALLBACK}",
            "timeouts": TIMEOUTS,
            "headers": {"set": {"Authorization": "Bearer bench-exa-key"}},
            "search": {"vendor": FALLBACK},
        }
    return routes


def _dead_url() -> str:
    """A loopback port nothing listens on: every connect is refused at once."""
    return f"http://127.0.0.1:{free_port()}"


def _tavily_body(query: str) -> dict[str, Any]:
    return {"query": query, "max_results": MAX_RESULTS}


def _exa_body(query: str) -> dict[str, Any]:
    """What the failover itself sends exa for this query (the same vendor request)."""
    request = build_search_request(BUILTIN_PROFILES[FALLBACK], query, MAX_RESULTS)
    assert request.json_body is not None
    return request.json_body


def _queries(tag: str, n: int) -> list[str]:
    return [f"{QUERIES[i % len(QUERIES)]} failover-{tag}-{i}" for i in range(n)]


# --------------------------------------------------------------------------------- client


@dataclass
class Answer:
    status: int  # 0: no HTTP answer
    seconds: float
    results: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    error: str = ""

    @property
    def answered(self) -> bool:
        return self.status == 200 and self.results > 0


@dataclass
class Load:
    answers: list[Answer] = field(default_factory=list)
    wall: float = 0.0
    planned: int = 0

    @property
    def n(self) -> int:
        return len(self.answers)

    @property
    def answered(self) -> int:
        return sum(1 for a in self.answers if a.answered)

    def seconds(self, keep: Callable[[Answer], bool] = lambda a: True) -> list[float]:
        return [a.seconds for a in self.answers if keep(a)]

    def statuses(self) -> str:
        counts = Counter(a.status for a in self.answers)
        return ", ".join(f"{s or 'no answer'} x {c}" for s, c in sorted(counts.items()))

    def header_counts(self, name: str, cut: str | None = None) -> str:
        """`exa x 990, none x 10`; with `cut`, only the header's text before it."""
        values = Counter(
            (a.headers.get(name, "none").split(cut, 1)[0] if cut else a.headers.get(name, "none"))
            for a in self.answers
        )
        return ", ".join(f"{v} x {c}" for v, c in values.most_common())


def _count_results(body: bytes) -> int:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return 0
    results = data.get("results") if isinstance(data, dict) else None
    return len(results) if isinstance(results, list) else 0


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Answer:
    started = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            data = await resp.read()
            seconds = time.perf_counter() - started
            headers = {h: resp.headers[h] for h in KEEP if h in resp.headers}
            error = "" if resp.status == 200 else data.decode("utf-8", "replace")[:200]
            return Answer(resp.status, seconds, _count_results(data), headers, error)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Answer(0, time.perf_counter() - started, error=repr(exc)[:200])


def _session(concurrency: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
    )


async def _load(url: str, bodies: list[dict[str, Any]], concurrency: int, limit_s: float) -> Load:
    """POST each body once, `concurrency` at a time; none is started after `limit_s`."""
    load = Load(planned=len(bodies))
    pending = iter(bodies)

    async def worker(session: aiohttp.ClientSession, stop_at: float) -> None:
        for body in pending:
            if time.perf_counter() >= stop_at:
                return
            load.answers.append(await _post(session, url, body))

    async with _session(concurrency) as session:
        started = time.perf_counter()
        stop_at = started + limit_s
        await asyncio.gather(*(worker(session, stop_at) for _ in range(concurrency)))
        load.wall = time.perf_counter() - started
    return load


async def _interleaved(
    px_url: str, queries: list[str], limit_s: float
) -> tuple[Load, Load, list[tuple[int, int]]]:
    """Each query through /tavily/search and /exa/search, one request at a time, alternating
    which goes first; returns both loads and the (tavily, exa) index ranges of each block."""
    translated, direct = Load(planned=len(queries)), Load(planned=len(queries))
    tavily_url = f"{px_url}/{PRIMARY}/search"
    exa_url = f"{px_url}/{FALLBACK}/search"
    async with _session(1) as session:
        started = time.perf_counter()
        for i, q in enumerate(queries):
            if time.perf_counter() - started >= limit_s:
                break
            pair = [(translated, tavily_url, _tavily_body(q)), (direct, exa_url, _exa_body(q))]
            for load, url, body in pair if i % 2 == 0 else pair[::-1]:
                load.answers.append(await _post(session, url, body))
        translated.wall = direct.wall = time.perf_counter() - started
    done = translated.n
    size = max(1, done // DIRECT_BLOCKS)
    blocks = [
        (b * size, done if b == DIRECT_BLOCKS - 1 else (b + 1) * size) for b in range(DIRECT_BLOCKS)
    ]
    return translated, direct, [(lo, hi) for lo, hi in blocks if hi > lo]


# -------------------------------------------------------------------------------- figures


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _ms2(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _answered_text(answered: int, n: int) -> str:
    return f"{answered / n:.1%} ({answered}/{n})" if n else "n/a"


def _metric(metrics: str, name: str, **labels: str) -> float:
    return metric_sum(metrics, name, **labels) or 0.0


def _proxy_line(metrics: str) -> str:
    opened = _metric(metrics, "search_proxy_breaker_transitions_total", route=PRIMARY, to="open")
    attempts = {
        o: _metric(metrics, "search_proxy_upstream_attempts_total", route=PRIMARY, outcome=o)
        for o in ("connect_error", "reset", "timeout", "ok")
    }
    shown = ", ".join(f"{o} {v:.0f}" for o, v in attempts.items() if v)
    retries = _metric(metrics, "search_proxy_retries_total", route=PRIMARY)
    refused = _metric(metrics, "search_proxy_retry_budget_exhausted_total", route=PRIMARY)
    failovers = {
        r: _metric(
            metrics, "search_proxy_failovers_total", route=PRIMARY, provider=FALLBACK, result=r
        )
        for r in ("answered", "empty", "failed", "skipped")
    }
    fo = ", ".join(f"{r} {v:.0f}" for r, v in failovers.items() if v)
    return (
        f"proxy /metrics: {PRIMARY} breaker opened {opened:.0f} time(s); {PRIMARY} attempts "
        f"{shown or 'none'}; retries {retries:.0f} (refused by the retry budget {refused:.0f}); "
        f"failovers to {FALLBACK}: {fo or 'none'}"
    )


def _latency_line(load: Load, concurrency: int) -> str:
    cut = f" of {load.planned} planned (time bound reached)" if load.n < load.planned else ""
    return (
        f"{load.n} requests{cut} at concurrency {concurrency} in {load.wall:.2f} s "
        f"({load.n / load.wall:.0f} req/s); p50 {_ms(percentile(load.seconds(), 50))} "
        f"p99 {_ms(percentile(load.seconds(), 99))} max {_ms(percentile(load.seconds(), 100))}"
    )


def _after_open(a: Answer) -> bool:
    """Failed over because the primary's breaker was open (no attempt at the primary)."""
    return "circuit_open" in a.headers.get("X-Search-Failover", "")


def _sample_failure(load: Load) -> str | None:
    for a in load.answers:
        if not a.answered:
            return f"{a.status or 'no answer'}: {a.error.strip() or f'{a.results} results'}"
    return None


# ------------------------------------------------------------------------------ scenarios


def _cold_run(pinning: Pinning, vendor_url: str, *, fallback: bool) -> tuple[Load, str, int]:
    tag = "b" if fallback else "a"
    routes = _routes(_dead_url(), vendor_url, fallback=fallback)
    stats = f"{vendor_url}/__fake__/stats"
    with proxy(pinning, routes) as (px_url, _):
        before = int(get_json(stats)["total"])
        bodies = [_tavily_body(q) for q in _queries(f"cold-{tag}", COLD_REQUESTS)]
        load = asyncio.run(
            _load(f"{px_url}/{PRIMARY}/search", bodies, CONCURRENCY, COLD_TIME_LIMIT_S)
        )
        calls = int(get_json(stats)["total"]) - before
        metrics = get_text(f"{px_url}/metrics")
    return load, metrics, calls


def cold_outage(pinning: Pinning, vendor_url: str) -> list[Scenario]:
    """Config A then config B, each a new proxy with a cold cache; every query new."""
    setup = (
        f"{PRIMARY} upstream: a closed loopback port (connection refused); retry 3 attempts "
        "(backoff 10-50 ms), breaker fail_max 5 / reset 30s, cache ttl 10m; every query new; "
        f"{COLD_REQUESTS} Tavily-shaped POSTs to /{PRIMARY}/search (max_results {MAX_RESULTS}) "
        f"at concurrency {CONCURRENCY}, at most {COLD_TIME_LIMIT_S:.0f} s; answered = 200 with "
        "results; p50/p99 over every request"
    )
    out: list[Scenario] = []
    for fallback in (False, True):
        load, metrics, calls = _cold_run(pinning, vendor_url, fallback=fallback)
        name = "failover/cold-outage-" + ("with-fallback" if fallback else "no-fallback")
        s = Scenario(name)
        answered = Figure("answered", _answered_text(load.answered, load.n))
        if fallback:
            answered = Figure(
                "answered",
                _answered_text(load.answered, load.n),
                "100%",
                load.n > 0 and load.answered == load.n,
            )
        s.figures = [
            answered,
            Figure("p50", _ms(percentile(load.seconds(), 50))),
            Figure("p99", _ms(percentile(load.seconds(), 99))),
        ]
        if not fallback:
            s.details.append(setup)
        s.details.append(
            (
                "config B: config A plus fallback {providers: [exa]}, exa route -> fake vendor "
                "(latency 0, own key via headers.set, no cache); "
                if fallback
                else "config A: no fallback; "
            )
            + _latency_line(load, CONCURRENCY)
        )
        s.details.append(
            f"agent saw: {load.statuses()}; X-Search-Provider: "
            f"{load.header_counts('X-Search-Provider')}; X-Proxy-Error: "
            f"{load.header_counts('X-Proxy-Error')}; fake vendor calls {calls}"
        )
        if fallback:
            via_open = [a for a in load.answers if _after_open(a)]
            before = [a for a in load.answers if not _after_open(a)]
            s.details.append(
                f"why it failed over (X-Search-Failover): "
                f"{load.header_counts('X-Search-Failover', cut=' (')}; failed over with the "
                f"breaker open: {len(via_open)} requests, p50 "
                f"{_ms(percentile([a.seconds for a in via_open], 50))} p99 "
                f"{_ms(percentile([a.seconds for a in via_open], 99))}; before it opened "
                f"(the primary tried first; the retry budget refuses most retries): "
                f"{len(before)}, p50 "
                f"{_ms(percentile([a.seconds for a in before], 50))} max "
                f"{_ms(percentile([a.seconds for a in before], 100))}"
            )
        s.details.append(_proxy_line(metrics))
        failure = _sample_failure(load)
        if failure:
            s.details.append(f"an unanswered request: {failure}")
        out.append(s)
    return out


def translated_vs_direct(pinning: Pinning, vendor_url: str) -> list[Scenario]:
    """Config B, breaker open: /tavily/search (failed over to exa) vs /exa/search, same queries."""
    name = "failover/translated-vs-direct"
    routes = _routes(_dead_url(), vendor_url, fallback=True)
    with proxy(pinning, routes) as (px_url, _):
        # Open the primary's breaker (fail_max consecutive failed requests), and warm both paths.
        warm = asyncio.run(
            _load(
                f"{px_url}/{PRIMARY}/search",
                [_tavily_body(q) for q in _queries("open-breaker", 20)],
                1,
                10.0,
            )
        )
        if not warm.answers or not _after_open(warm.answers[-1]):
            last = warm.answers[-1].headers if warm.answers else "no answer"
            return [Scenario(name, error=f"the {PRIMARY} breaker did not open: {last}")]
        asyncio.run(
            _load(
                f"{px_url}/{FALLBACK}/search",
                [_exa_body(q) for q in _queries("warm-exa", 20)],
                1,
                10.0,
            )
        )
        translated, direct, blocks = asyncio.run(
            _interleaved(px_url, _queries("direct", DIRECT_QUERIES), DIRECT_TIME_LIMIT_S)
        )
        metrics = get_text(f"{px_url}/metrics")
    via_open = sum(1 for a in translated.answers if _after_open(a))
    t_p50 = percentile(translated.seconds(), 50)
    d_p50 = percentile(direct.seconds(), 50)
    added_ms = (t_p50 - d_p50) * 1000
    per_block = [
        (percentile(translated.seconds()[lo:hi], 50) - percentile(direct.seconds()[lo:hi], 50))
        * 1000
        for lo, hi in blocks
    ]
    s = Scenario(name)
    s.figures = [
        Figure(f"/{PRIMARY} via {FALLBACK} p50", _ms2(t_p50)),
        Figure(f"/{FALLBACK} direct p50", _ms2(d_p50)),
        at_most("added p50", added_ms, ADDED_P50_TARGET_MS, "{:.2f} ms"),
    ]
    s.details = [
        f"config B with the {PRIMARY} breaker open (opened during 20 warm-up searches: "
        f"{FAIL_MAX} failed requests open it); {translated.n} queries, each once to "
        f"/{PRIMARY}/search (answered by {FALLBACK}, in Tavily's shape) and once to "
        f"/{FALLBACK}/search with the request the failover sends, interleaved one at a time "
        f"(order alternating), in {translated.wall:.1f} s"
        "; one proxy, fake vendor latency 0, exa route without cache",
        f"/{PRIMARY}: answered {_answered_text(translated.answered, translated.n)}, failed over "
        f"with the breaker open {via_open}, p99 {_ms2(percentile(translated.seconds(), 99))}; "
        f"/{FALLBACK}: answered {_answered_text(direct.answered, direct.n)}, p99 "
        f"{_ms2(percentile(direct.seconds(), 99))}; added p99 "
        f"{(percentile(translated.seconds(), 99) - percentile(direct.seconds(), 99)) * 1000:+.2f}"
        " ms",
        f"added p50 per block of {blocks[0][1] - blocks[0][0]} queries (ms): "
        + spread(per_block, "{:+.2f}"),
        _proxy_line(metrics),
    ]
    for load in (translated, direct):
        failure = _sample_failure(load)
        if failure:
            s.details.append(f"an unanswered request: {failure}")
    return [s]


SCENARIOS: tuple[Callable[[Pinning, str], list[Scenario]], ...] = (
    cold_outage,
    translated_vs_direct,
)


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    """One fake vendor (latency 0) for the group; a proxy per config."""
    with client_pinned(pinning), fake_vendor(pinning) as vendor_url:
        for scenario in SCENARIOS:
            try:
                for s in scenario(pinning, vendor_url):
                    emit(s)
            except StartError as exc:
                emit(
                    Scenario(f"failover/{scenario.__name__}", error=f"{type(exc).__name__}: {exc}")
                )

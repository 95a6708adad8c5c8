"""Search-aware recovery against the fake vendor: empty results, malformed bodies, and /v1/search
falling back to a second vendor.

Routes carry `search: {vendor: <name>}` and point at the fake vendor's per-vendor prefixes
(upstream `<fake>/tavily`, prefix `/tavily`); retries: {attempts: 2 or 3, backoff 10-50 ms}.

- empty: the vendor finds nothing for queries over 3 words; 50 realistic queries of 4-8 words,
  each asked once: >= 95% answered with results, vendor calls per request <= 3 on average and
  at most 3 for any request. The proxy tries the original and at most `max_variants` (default 3)
  simplified variants, the first fully cleaned and the second at most three words, so three
  calls reach a three-word query; the same queries with `max_variants: 2` follow for context;
- malformed: the vendor answers 20% of calls with a truncated 200 body: >= 99% success with 3
  attempts, measured (as retries/30%-503) with `retry.budget: {ratio: 0.5, min_per_s: 3}`, a
  budget sized for the failure rate (0.24 retries per request); the default budget (ratio 0.2)
  follows for context, where it binds by design;
- fallback: the first vendor is down (503 to everything), the second healthy; /v1/search with
  providers [down, healthy]: 100% success, and once the first one's breaker is open, p50 within
  5 ms of /v1/search with providers [healthy] alone.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from bench.client import LoadResult, run_load
from bench.procs import Pinning, fake_vendor, get_json, get_text, metric_sum, proxy
from bench.report import Figure, Scenario, at_least, at_most, median, percentile
from policies.simplify import simplify_query
from testkit.procs import StartError

TIMEOUTS = {"connect": "1s", "per_try": "2s", "total": "10s"}
BACKOFF = {"initial": "10ms", "max": "50ms"}
BREAKER = {"fail_max": 5, "reset_timeout": "30s"}
EMPTY_OVER_WORDS = 3

# Searches an agent might send, 4 to 8 words each; written once, not tuned to the fake's rule.
QUERIES: tuple[str, ...] = (
    "how to reset a forgotten router admin password",
    "best budget mechanical keyboard for programming",
    "python asyncio cancel task after timeout",
    "symptoms of vitamin d deficiency in adults",
    "why do northern lights change color",
    "postgres vs mysql replication performance comparison",
    "kubernetes pod stuck in crashloopbackoff fix",
    "average rainfall in seattle by month",
    "how long to boil a soft egg",
    "electric car battery degradation after ten years",
    "who won the 2022 world cup final",
    "rust borrow checker lifetime error explanation",
    "cheapest flights from london to tokyo in march",
    "what is the capital of australia",
    "how does a heat pump work in winter",
    "react useEffect runs twice in development mode",
    "side effects of ibuprofen and alcohol together",
    "history of the printing press in europe",
    "best practices for rest api pagination",
    "how to remove rust from cast iron pan",
    "latest research on alzheimer's disease treatment 2024",
    "difference between tcp and udp explained",
    "git undo last commit but keep changes",
    "population of tokyo metropolitan area in 2023",
    "how to train a puppy to stop biting",
    "climate change impact on coral reefs",
    "nvidia rtx 4090 power supply requirements",
    "tax deduction rules for home office expenses",
    "how to make sourdough starter from scratch",
    "mediterranean diet benefits for heart health",
    "docker compose environment variables from file",
    "what causes high blood pressure in young adults",
    "javascript sort array of numbers descending",
    "compound interest calculator with monthly contributions",
    "open source alternatives to microsoft office",
    "when is the next total solar eclipse",
    "linux find files modified in last 24 hours",
    "calories burned running one mile",
    "EU AI Act obligations for general purpose models",
    "signs of burnout and how to recover",
    "fastest way to learn spanish as an adult",
    "how does bitcoin mining difficulty adjustment work",
    '"circuit breaker" pattern for microservices',
    "typescript generic constraints with keyof examples",
    "what did the fed decide in september 2024",
    "how to fix a leaking kitchen faucet",
    "best hiking trails near denver for beginners",
    "aws lambda cold start reduction techniques",
    "how to negotiate a higher salary offer",
    "C++ unique_ptr vs shared_ptr performance",
)


def _route(vendor_url: str, vendor: str, **extra: Any) -> dict[str, Any]:
    route = {
        "prefix": f"/{vendor}",
        "upstream": f"{vendor_url}/{vendor}",
        "timeouts": TIMEOUTS,
        "retry": {"attempts": 2, "backoff": BACKOFF},
        "search": {"vendor": vendor},
    }
    route.update(extra)
    return route


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _results(body: bytes, key: str = "results") -> list[Any]:
    """The result list of a Tavily-shaped (or /v1/search) answer; [] when there is none."""
    try:
        data = json.loads(body)
    except ValueError:
        return []
    found = data.get(key) if isinstance(data, dict) else None
    return found if isinstance(found, list) else []


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


# -------------------------------------------------------------------------------- empty


@dataclass
class Asked:
    query: str
    status: int
    results: int
    calls: int
    used: str | None


def _ask_each(url: str, vendor_url: str) -> list[Asked]:
    """Each query once, one at a time, counting the vendor calls it took."""
    asked = []
    before = int(get_json(f"{vendor_url}/__fake__/stats")["total"])
    for q in QUERIES:
        status, headers, body = _post(url, {"query": q, "max_results": 3})
        after = int(get_json(f"{vendor_url}/__fake__/stats")["total"])
        used = headers.get("X-Search-Query-Used")
        n = len(_results(body)) if status == 200 else 0
        asked.append(Asked(q, status, n, after - before, unquote(used) if used else None))
        before = after
    return asked


def _empty_figures(asked: list[Asked]) -> tuple[float, float, Counter[int]]:
    answered = sum(1 for a in asked if _answered(a)) / len(asked)
    calls = sum(a.calls for a in asked) / len(asked)
    return answered, calls, Counter(a.calls for a in asked)


def _distribution(counts: Counter[int]) -> str:
    return ", ".join(f"{n} call(s) x {c}" for n, c in sorted(counts.items()))


def empty_results(pinning: Pinning) -> list[Scenario]:
    name = "search/empty-over-3-words"
    with fake_vendor(pinning, "--empty-words-over", str(EMPTY_OVER_WORDS)) as vendor_url:
        routes = {
            "tavily": _route(vendor_url, "tavily"),
            "tavily2": {
                **_route(vendor_url, "tavily"),
                "prefix": "/tavily2",
                "search": {"vendor": "tavily", "max_variants": 2},
            },
        }
        with proxy(pinning, routes) as (px_url, _):
            default = _ask_each(f"{px_url}/tavily/search", vendor_url)
            two = _ask_each(f"{px_url}/tavily2/search", vendor_url)
            metrics = get_text(f"{px_url}/metrics")

    answered, calls, counts = _empty_figures(default)
    s = Scenario(name)
    s.figures = [
        at_least("answered with results", answered * 100, 95.0, "{:.0f}%"),
        at_most("vendor calls/request", calls, 3.0, "{:.2f}"),
        at_most("max", max(a.calls for a in default), 3, "{:.0f}"),
    ]
    words = Counter(len(q.split()) for q in QUERIES)
    variants = {
        o: metric_sum(metrics, "search_proxy_search_variants_total", route="tavily", outcome=o)
        for o in ("results", "empty", "failed")
    }
    s.details = [
        f"{len(QUERIES)} queries asked once each, one at a time; words per query: "
        + ", ".join(f"{w} x {c}" for w, c in sorted(words.items())),
        f"max_variants 3 (default): vendor calls per request: {_distribution(counts)}; "
        f"answered with results {sum(_answered(a) for a in default)}/{len(default)}",
        "proxy /metrics variants: " + ", ".join(f"{o} {v or 0:.0f}" for o, v in variants.items()),
    ]
    s.details += _why_calls(default)
    for a in [a for a in default if not _answered(a)][:3]:
        s.details.append(f"not answered with results: {a.query!r}: status {a.status}")

    answered2, calls2, counts2 = _empty_figures(two)
    s2 = Scenario(f"{name}-max-variants-2")
    s2.figures = [
        Figure("answered with results", f"{answered2:.0%}"),
        Figure("vendor calls/request", f"{calls2:.2f}"),
        Figure("max", str(max(a.calls for a in two))),
    ]
    s2.details = [
        f"context only: the same {len(QUERIES)} queries through a route with max_variants 2; "
        f"vendor calls per request: {_distribution(counts2)}",
    ]
    missed = [a.query for a in two if not _answered(a)]
    if missed:
        s2.details.append(
            f"{len(missed)} left without results (no variant of <= {EMPTY_OVER_WORDS} words "
            f"among the first two), e.g. {missed[0]!r}: variants {simplify_query(missed[0], 2)}"
        )
    return [s, s2]


def _answered(a: Asked) -> bool:
    return a.status == 200 and a.results > 0


def _why_calls(asked: list[Asked]) -> list[str]:
    """How the variant ladder spent the calls, with an example, and any request over 3."""
    lines = [
        f"why: the fake finds nothing above {EMPTY_OVER_WORDS} words; simplify_query's 1st "
        "variant is the fully cleaned query (special characters, years and filler words "
        "dropped at once; skipped when it changes nothing), then the first three key terms, "
        "so a query costs 2 calls when its first variant has <= 3 words and 3 otherwise"
    ]
    over = [a for a in asked if a.calls > 3]
    if over:
        lines.append("took more than 3 calls: " + "; ".join(repr(a.query) for a in over))
    sample = over[0] if over else max(asked, key=lambda a: (a.calls, len(a.query)))
    lines.append(
        f"e.g. {sample.query!r} ({sample.calls} calls, answered with {sample.used!r}): "
        f"simplify_query variants {simplify_query(sample.query, 3)}"
    )
    return lines


# ---------------------------------------------------------------------------- malformed


def _usable(load: LoadResult) -> int:
    """200 answers whose body is a whole JSON answer with results."""
    return sum(1 for o in load.outcomes if o.status == 200 and _results(o.body))


# The same budget as retries/30%-503: sized for the failure rate (3 attempts at 20% malformed
# need 0.2 + 0.04 = 0.24 retries per request, over the default ratio 0.2).
SIZED_BUDGET = {"ratio": 0.5, "min_per_s": 3}
MALFORMED_REQUESTS = 1000
MALFORMED_CONCURRENCY = 20


def _malformed_run(pinning: Pinning, name: str, budget: dict[str, Any] | None) -> Scenario:
    retry: dict[str, Any] = {"attempts": 3, "backoff": BACKOFF}
    if budget:
        retry["budget"] = budget
    with fake_vendor(pinning, "--malformed-ratio", "0.2") as vendor_url:
        routes = {"tavily": _route(vendor_url, "tavily", retry=retry)}
        with proxy(pinning, routes) as (px_url, _):
            load = asyncio.run(
                run_load(
                    f"{px_url}/tavily/search",
                    MALFORMED_REQUESTS,
                    MALFORMED_CONCURRENCY,
                    lambda i: {"query": f"malformed bench query {i}", "max_results": 3},
                    keep_bodies=True,
                )
            )
            metrics = get_text(f"{px_url}/metrics")
        calls = int(get_json(f"{vendor_url}/__fake__/stats")["total"])
    usable = _usable(load)
    ratio = usable / load.n
    s = Scenario(name)
    success = f"{ratio:.1%} ({usable}/{load.n})"
    if budget:
        s.figures = [Figure("success", success, ">= 99%", ratio >= 0.99)]
    else:
        s.figures = [Figure("success", success)]
    s.figures.append(Figure("vendor calls/request", f"{calls / load.n:.2f}"))
    retries = metric_sum(metrics, "search_proxy_retries_total", route="tavily") or 0
    refused = metric_sum(metrics, "search_proxy_retry_budget_exhausted_total", route="tavily")
    budget_text = (
        f"{{ratio: {budget['ratio']}, min_per_s: {budget['min_per_s']}}}, sized for a 20% "
        "failure rate (the same as retries/30%-503)"
        if budget
        else "the default {ratio: 0.2, min_per_s: 3}, which binds by design here: 3 attempts "
        "at 20% malformed need 0.24 retries per request, the budget allows 0.2 (+ 3/s)"
    )
    expected = 0.2**3 * load.n
    sd = (0.2**3 * (1 - 0.2**3) * load.n) ** 0.5
    s.details = [
        ("context only: " if not budget else "")
        + "retry {attempts: 3, backoff 10-50 ms}, retry budget "
        + budget_text,
        f"{load.n} requests at concurrency {MALFORMED_CONCURRENCY} in {load.wall_seconds:.1f} s; "
        f"p50 {_ms(load.latency(50))} p99 {_ms(load.latency(99))}",
        f"agent saw: {load.statuses()}; 200s with a whole body and results: {usable}; "
        f"vendor calls {calls}; retries {retries:.0f}, refused by the budget {refused or 0:.0f}",
    ]
    if budget:
        s.details.append(
            "ceiling with 3 attempts and independent 20% malformed: 1 - 0.2^3 = 99.2%, i.e. "
            f"{expected:.0f} +- {sd:.0f} (1 sd) failed of {load.n}; the target allows "
            f"{int(load.n * 0.01)}"
        )
    bad_200 = sum(1 for o in load.outcomes if o.status == 200) - usable
    if bad_200:
        s.details.append(f"WARNING: {bad_200} answers were 200 without a usable body")
    failure = load.sample_failure()
    if failure:
        s.details.append(f"a failed answer: {failure}")
    return s


def malformed(pinning: Pinning) -> list[Scenario]:
    """Targets with the sized budget; the default budget for context, as in retries."""
    return [
        _malformed_run(pinning, "search/malformed-20%", SIZED_BUDGET),
        _malformed_run(pinning, "search/malformed-20%-default-budget", None),
    ]


# ----------------------------------------------------------------------------- fallback


def _search_body(providers: list[str], tag: str) -> Callable[[int], dict[str, Any]]:
    def body(i: int) -> dict[str, Any]:
        return {"query": f"fallback {tag} query {i}", "max_results": 3, "providers": providers}

    return body


def fallback(pinning: Pinning) -> list[Scenario]:
    name = "search/v1-first-vendor-down"
    both, alone = ["tavily", "brave"], ["brave"]
    blocks, per_block = 6, 50
    with (
        fake_vendor(pinning, "--down") as down_url,
        fake_vendor(pinning) as healthy_url,
    ):
        routes = {
            "tavily": _route(down_url, "tavily", breaker=BREAKER),
            "brave": _route(healthy_url, "brave", breaker=BREAKER),
        }
        with proxy(pinning, routes) as (px_url, _):
            url = f"{px_url}/v1/search"
            # Until the down vendor's breaker is open: /v1/search skips it without a call.
            tripping: list[tuple[int, bytes]] = []
            for i in range(50):
                status, _, body = _post(url, _search_body(both, "trip")(i))
                tried = json.loads(body).get("attempts", []) if status == 200 else []
                tripping.append((status, body))
                if tried and tried[0]["outcome"] == "skipped":
                    break
            calls_at_open = int(get_json(f"{down_url}/__fake__/stats")["total"])
            trip_metrics = get_text(f"{px_url}/metrics")
            loads: dict[str, list[LoadResult]] = {"both": [], "alone": []}
            for b in range(blocks):  # alternate, so drift hits both alike
                for label, providers in (("both", both), ("alone", alone)):
                    body = _search_body(providers, f"{label}{b}")
                    loads[label].append(
                        asyncio.run(run_load(url, per_block, 1, body, keep_bodies=True))
                    )
        calls_after = int(get_json(f"{down_url}/__fake__/stats")["total"]) - calls_at_open
        healthy_calls = int(get_json(f"{healthy_url}/__fake__/stats")["total"])

    def ok(o_status: int, body: bytes) -> bool:
        return o_status == 200 and bool(_results(body))

    trip_ok = sum(1 for st, body in tripping if ok(st, body))
    trip_retries = metric_sum(trip_metrics, "search_proxy_retries_total", route="tavily") or 0
    trip_refused = (
        metric_sum(trip_metrics, "search_proxy_retry_budget_exhausted_total", route="tavily") or 0
    )
    outs = {k: [o for load in v for o in load.outcomes] for k, v in loads.items()}
    both_ok = sum(1 for o in outs["both"] if ok(o.status, o.body))
    alone_ok = sum(1 for o in outs["alone"] if ok(o.status, o.body))
    total = len(tripping) + len(outs["both"])
    p50 = {k: percentile([o.seconds for o in v], 50) for k, v in outs.items()}
    diff_ms = (p50["both"] - p50["alone"]) * 1000
    block_p50 = {k: [load.latency(50) * 1000 for load in v] for k, v in loads.items()}
    providers_seen = Counter(
        json.loads(o.body).get("provider") for o in outs["both"] if o.status == 200
    )
    s = Scenario(name)
    s.figures = [
        Figure(
            "success",
            f"{(trip_ok + both_ok) / total:.1%} ({trip_ok + both_ok}/{total})",
            "100%",
            trip_ok + both_ok == total,
        ),
        Figure("p50 [down, healthy]", f"{p50['both'] * 1000:.2f} ms"),
        Figure("[healthy]", f"{p50['alone'] * 1000:.2f} ms"),
        at_most("difference", abs(diff_ms), 5.0, "{:.2f} ms"),
    ]
    s.details = [
        "providers [tavily: fake vendor --down, brave: healthy fake vendor]; breaker "
        "{fail_max: 5, reset_timeout: 30s}, retry {attempts: 2, backoff 10-50 ms}",
        f"tripping: {len(tripping)} requests until /v1/search skipped tavily (breaker open), "
        f"{trip_ok} answered with results (from brave); tavily vendor calls {calls_at_open} "
        f"(retries {trip_retries:.0f}, refused by the retry budget {trip_refused:.0f})",
        f"then {blocks} x {per_block} requests each way, alternating, one at a time: "
        f"[down, healthy] {both_ok}/{len(outs['both'])} with results "
        f"(provider: {dict(providers_seen)}), [healthy] {alone_ok}/{len(outs['alone'])}; "
        f"tavily vendor calls meanwhile {calls_after}; brave vendor calls {healthy_calls}",
        f"p50 [down, healthy] minus [healthy]: {diff_ms:+.2f} ms; block p50s ms: "
        f"[down, healthy] {', '.join(f'{x:.2f}' for x in block_p50['both'])}; "
        f"[healthy] {', '.join(f'{x:.2f}' for x in block_p50['alone'])}",
        f"p99 [down, healthy] {_ms(percentile([o.seconds for o in outs['both']], 99))}, "
        f"[healthy] {_ms(percentile([o.seconds for o in outs['alone']], 99))}; "
        f"medians of block p50s: {median(block_p50['both']):.2f} vs "
        f"{median(block_p50['alone']):.2f} ms",
    ]
    bad = next(
        (o for o in outs["both"] + outs["alone"] if not ok(o.status, o.body)),
        None,
    )
    if bad is not None:
        s.details.append(f"a failed answer: {bad.status}: {bad.body[:300]!r}")
    return [s]


GROUPS: tuple[Callable[[Pinning], list[Scenario]], ...] = (empty_results, malformed, fallback)


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    """Run each scenario with its own processes; one failing does not stop the next."""
    for group in GROUPS:
        try:
            for scenario in group(pinning):
                emit(scenario)
        except StartError as exc:
            emit(Scenario(f"search/{group.__name__}", error=f"{type(exc).__name__}: {exc}"))

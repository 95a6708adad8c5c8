"""The hot path: the same wrk load straight to a local upstream, through the least a Python
forwarder does (`bench.forwarder`), and through the proxy on each path a request takes, in one
run, so every figure is comparable with the others and their ratios hold when the machine drifts.

Paths: a route with no policies; a route with every policy (search guard and recovery, cache,
failover, breaker, retry, hedge, rate limit, an injected key) on a cache miss (each request a
new query) and on a cache hit (the same query again).

- throughput: 1 KB JSON POSTs, `wrk -t1 -c32`, the proxy alone on one core: no policies and
  every policy on a miss >= 0.85 x the bare forwarder, a cache hit >= 2.0 x;
- latency: one connection (`wrk -t1 -c1`): p50 added over the bare forwarder <= 0.1 ms on the
  miss path;
- memory: RSS idle with the shipped config.yaml <= 60 MB, after the load <= 80 MB.

The paths are run in rounds: one short run of each path, in turn, forwards in one round and
backwards in the next. Each ratio and each added p50 is taken within a round, against that
round's bare forwarder, and the median over rounds is reported. On a VM a run's speed swings by
up to 2x with the host (a c=1 p50 of 0.7 ms in one run and 1.5 ms in the next); paired within a
round the swing cancels, where a ratio of medians over whole runs read "met" or "NOT met" by
chance. The proxy runs at log level warning (no request log lines); one extra run at level info
shows what the per-request JSON log line costs.
"""

from __future__ import annotations

import json
import resource
import secrets
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.procs import (
    Pinning,
    bare_forwarder,
    bench_upstream,
    proxy,
    proxy_from_file,
    rss_mb,
)
from bench.report import Figure, Scenario, at_least, at_most, in_turn, median, per_round, spread
from testkit.procs import ROOT, Child

PLAIN_RATIO_TARGET = 0.85  # no policies, req/s over the bare forwarder's
MISS_RATIO_TARGET = 0.85  # every policy, cache miss
HIT_RATIO_TARGET = 2.0  # every policy, cache hit
ADDED_P50_TARGET_MS = 0.1  # p50 the miss path adds over the bare forwarder, one client
RSS_IDLE_TARGET_MB = 60.0  # the shipped config, just started
RSS_LOADED_TARGET_MB = 80.0  # the every-policy proxy after the whole load
CONNECTIONS = 32
# Short runs, many rounds: a round should end before the host changes its mind about the VM.
THROUGHPUT_ROUNDS = 8
THROUGHPUT_SECONDS = 2
LATENCY_ROUNDS = 12
LATENCY_SECONDS = 1
LEVEL_ROUNDS = 4  # log level info against warning
WARMUP_SECONDS = 1
ROUTE = "bench"
FULL = "full"  # the route with every policy
PATHS = ("direct", "bare", "plain", "miss", "hit")

# A 1 KB JSON search request, as an agent sends it.
_REQUEST = {
    "query": "latest results on retrieval augmented generation benchmarks",
    "search_depth": "basic",
    "max_results": 5,
    "include_domains": [f"site{i}.example.com" for i in range(8)],
    "exclude_domains": [],
    "topic": "general",
}
_REQUEST["padding"] = "x" * (1024 - len(json.dumps(_REQUEST)) - len(', "padding": ""'))
REQUEST_BODY = json.dumps(_REQUEST)
assert len(REQUEST_BODY) == 1024, len(REQUEST_BODY)


def full_routes(upstream: str) -> dict[str, object]:
    """A route with every policy, and the search route it fails over to."""
    return {
        FULL: {
            "prefix": f"/{FULL}",
            "upstream": upstream,
            "headers": {"set": {"Authorization": "Bearer bench-key"}},
            "retry": {"attempts": 3},
            # Never refuses at these rates: the limiter's work is measured, not its waiting.
            "rate_limit": {"rate": "1000000/s", "burst": 1000000},
            "breaker": {"fail_max": 5, "reset_timeout": "30s"},
            "cache": {"ttl": "10m", "stale_ttl": "1h"},
            "search": {"vendor": "tavily"},
            "hedge": {"after": "auto"},
            "fallback": {"providers": ["other"]},
        },
        "other": {"prefix": "/other", "upstream": upstream, "search": {"vendor": "tavily"}},
    }


_WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = assert(io.open("%(body_path)s", "rb"))
wrk.body = f:read("*a")
f:close()
local unique = %(unique)s
local counter = 0
if unique then
  request = function()
    counter = counter + 1
    local body = string.gsub(wrk.body, "latest results", "%(run)s " .. counter, 1)
    return wrk.format(nil, nil, nil, body)
  end
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %%d, "duration_us": %%d, "p50_us": %%.1f, "p99_us": %%.1f, ' ..
    '"mean_us": %%.1f, "connect": %%d, "read": %%d, "write": %%d, "status": %%d, ' ..
    '"timeout": %%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency.mean, e.connect, e.read, e.write, e.status, e.timeout))
end
"""


@dataclass
class WrkRun:
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int  # socket errors and non-2xx answers
    cpu: dict[str, float]  # share of one core used during the run, by process
    wall: float = 0.0  # seconds the run took, wrk's start and exit included (what `cpu` is over)


def _write_script(tmp: Path, *, unique: bool = False) -> Path:
    """The wrk script: the same 1 KB body every time, or (`unique`) a new query in each request,
    prefixed by a random run id so that no run meets another's cache entries."""
    body_path = tmp / "body.json"
    body_path.write_text(REQUEST_BODY)
    run = secrets.token_hex(4)
    script = tmp / f"post-{run}.lua"
    values = {"body_path": body_path, "unique": "true" if unique else "false", "run": run}
    script.write_text(_WRK_SCRIPT % values)
    return script


def _wrk(
    pinning: Pinning,
    script: Path,
    url: str,
    connections: int,
    seconds: int,
    watch: dict[str, Child],
) -> WrkRun:
    """One wrk run on the load-generator CPU; CPU use of the watched processes and of wrk."""
    cmd = [*pinning.prefix(pinning.other_cpu), "wrk", "-t1", f"-c{connections}"]
    cmd += [f"-d{seconds}s", "--timeout", "5s", "-s", str(script), url]
    before = {name: child.cpu_seconds() for name, child in watch.items()}
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30, check=False)
    wall = time.perf_counter() - started
    ru2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {name: (child.cpu_seconds() - before[name]) / wall for name, child in watch.items()}
    cpu["wrk"] = (ru2.ru_utime + ru2.ru_stime - ru.ru_utime - ru.ru_stime) / wall
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRK_JSON ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr.strip() or out.stdout}")
    r = json.loads(line.removeprefix("WRK_JSON "))
    errors = sum(r[k] for k in ("connect", "read", "write", "status", "timeout"))
    return WrkRun(
        rps=r["requests"] / (r["duration_us"] / 1e6),
        p50_ms=r["p50_us"] / 1000,
        p99_ms=r["p99_us"] / 1000,
        requests=r["requests"],
        errors=errors,
        cpu=cpu,
        wall=wall,
    )


def _check_answers(url: str) -> None:
    """One POST, to fail early with a readable message if the path does not answer 200."""
    req = urllib.request.Request(
        url, data=REQUEST_BODY.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        body = resp.read()
        if resp.status != 200 or not body:
            raise RuntimeError(f"{url} answered {resp.status} with {len(body)} bytes")


def _cpu_text(runs: list[WrkRun], proxy_cpu: int | None, other_cpu: int | None) -> str:
    def share(name: str) -> float:
        return median([r.cpu.get(name, 0.0) for r in runs]) * 100

    parts = []
    if any("proxy" in r.cpu for r in runs):
        parts.append(f"proxy {share('proxy'):.0f}%")
    parts.append(f"upstream {share('upstream'):.0f}% + wrk {share('wrk'):.0f}%")
    where = ""
    if proxy_cpu is not None:
        where = f" (proxy alone on CPU {proxy_cpu}; upstream and wrk share CPU {other_cpu})"
    return "CPU use, % of one core: " + ", ".join(parts) + where


def _errors_note(label: str, runs: list[WrkRun]) -> list[str]:
    errors = sum(r.errors for r in runs)
    if not errors:
        return []
    total = sum(r.requests for r in runs)
    return [f"WARNING {label}: {errors} of {total} requests failed (socket errors or non-2xx)"]


def _shipped_idle_rss(pinning: Pinning) -> float:
    """RSS of a proxy on the repository's config.yaml, just started (no vendor keys set)."""
    with proxy_from_file(pinning, str(ROOT / "config.yaml")) as (_, child):
        time.sleep(1.0)  # let start-up's garbage settle
        return rss_mb(child)


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    """Measure every path in one sitting, then emit the throughput, latency, memory and logging
    lines."""
    thr: dict[str, list[WrkRun]] = {p: [] for p in PATHS}
    lat: dict[str, list[WrkRun]] = {p: [] for p in PATHS}
    # The no-policy proxy at log level warning and at info, in rounds of their own.
    levels: dict[str, dict[str, list[WrkRun]]] = {
        "c32": {"warning": [], "info": []},
        "c1": {"warning": [], "info": []},
    }
    rss: dict[str, float] = {"shipped idle": _shipped_idle_rss(pinning)}
    with tempfile.TemporaryDirectory(prefix="bench-core-") as tmpdir:
        tmp = Path(tmpdir)
        same = _write_script(tmp)
        with (
            bench_upstream(pinning) as (up_url, up_child),
            bare_forwarder(pinning, up_url) as (fw_url, fw_child),
            proxy(pinning, {ROUTE: {"prefix": f"/{ROUTE}", "upstream": up_url}}) as (
                px_url,
                px_child,
            ),
            proxy(pinning, full_routes(up_url)) as (full_url, full_child),
        ):
            rss["every policy idle"] = rss_mb(full_child)
            urls = {
                "direct": f"{up_url}/search",
                "bare": f"{fw_url}/search",
                "plain": f"{px_url}/{ROUTE}/search",
                "miss": f"{full_url}/{FULL}/search",
                "hit": f"{full_url}/{FULL}/search",
            }
            watch = {
                "direct": {"upstream": up_child},
                "bare": {"proxy": fw_child, "upstream": up_child},
                "plain": {"proxy": px_child, "upstream": up_child},
                "miss": {"proxy": full_child, "upstream": up_child},
                "hit": {"proxy": full_child, "upstream": up_child},
            }

            def script(path: str) -> Path:
                return _write_script(tmp, unique=True) if path == "miss" else same

            for path, url in urls.items():
                _check_answers(url)  # also stores the entry the hit path then answers from
                _wrk(pinning, script(path), url, CONNECTIONS, WARMUP_SECONDS, watch[path])
            for r in range(THROUGHPUT_ROUNDS):
                for path, url in in_turn(list(urls.items()), r):
                    thr[path].append(
                        _wrk(
                            pinning, script(path), url, CONNECTIONS, THROUGHPUT_SECONDS, watch[path]
                        )
                    )
            for r in range(LATENCY_ROUNDS):
                for path, url in in_turn(list(urls.items()), r):
                    lat[path].append(
                        _wrk(pinning, script(path), url, 1, LATENCY_SECONDS, watch[path])
                    )
            rss["every policy after load"] = rss_mb(full_child)

            # The no-policy proxy with log.level info: one JSON line per request, to a file.
            with proxy(
                pinning, {ROUTE: {"prefix": f"/{ROUTE}", "upstream": up_url}}, log_level="info"
            ) as (info_url, info_child):
                by_level = {
                    "warning": (urls["plain"], watch["plain"]),
                    "info": (
                        f"{info_url}/{ROUTE}/search",
                        {"proxy": info_child, "upstream": up_child},
                    ),
                }
                _check_answers(by_level["info"][0])
                _wrk(pinning, same, by_level["info"][0], CONNECTIONS, WARMUP_SECONDS, {})
                for r in range(LEVEL_ROUNDS):
                    for level, (url, w) in in_turn(list(by_level.items()), r):
                        levels["c32"][level].append(
                            _wrk(pinning, same, url, CONNECTIONS, THROUGHPUT_SECONDS, w)
                        )
                        levels["c1"][level].append(_wrk(pinning, same, url, 1, LATENCY_SECONDS, w))

    cpus = (pinning.proxy_cpu, pinning.other_cpu)

    def rps(path: str) -> float:
        return median([r.rps for r in thr[path]])

    def p50(path: str, runs: dict[str, list[WrkRun]]) -> float:
        return median([r.p50_ms for r in runs[path]])

    def p99(path: str, runs: dict[str, list[WrkRun]]) -> float:
        return median([r.p99_ms for r in runs[path]])

    def ratios(path: str) -> list[float]:
        """req/s over the bare forwarder's, round by round."""
        return per_round(
            [r.rps for r in thr[path]], [r.rps for r in thr["bare"]], lambda v, a: v / a
        )

    def added(path: str) -> list[float]:
        """p50 over the bare forwarder's at c=1, round by round (ms)."""
        return per_round(
            [r.p50_ms for r in lat[path]], [r.p50_ms for r in lat["bare"]], lambda v, a: v - a
        )

    s = Scenario("core/throughput-c32")
    s.figures = [
        Figure("bare forwarder", f"{rps('bare'):,.0f} req/s"),
        at_least("no policies", median(ratios("plain")), PLAIN_RATIO_TARGET, "{:.2f}x"),
        at_least("every policy, miss", median(ratios("miss")), MISS_RATIO_TARGET, "{:.2f}x"),
        at_least("every policy, hit", median(ratios("hit")), HIT_RATIO_TARGET, "{:.2f}x"),
        Figure("direct", f"{rps('direct'):,.0f} req/s"),
    ]
    if not pinning.enabled:
        s.figures.append(Figure("NOTE", "unpinned: not a one-core figure"))
    s.details = [
        f"wrk -t1 -c{CONNECTIONS} -d{THROUGHPUT_SECONDS}s, 1 KB JSON POST -> 1 KB JSON answer, "
        f"{THROUGHPUT_ROUNDS} rounds of one run per path; each ratio is over the same round's "
        "bare forwarder, the median of rounds",
        *(
            f"{path:<6} over bare: {spread(ratios(path), '{:.2f}x')}"
            for path in ("plain", "miss", "hit")
        ),
        *(
            f"{path:<6} req/s: {spread([r.rps for r in thr[path]], '{:,.0f}')}; "
            f"p50/p99 {p50(path, thr):.2f}/{p99(path, thr):.2f} ms"
            for path in PATHS
        ),
        *(f"{path:<6} {_cpu_text(thr[path], *cpus)}" for path in PATHS if path != "direct"),
        *(note for path in PATHS for note in _errors_note(path, thr[path])),
    ]
    emit(s)

    s = Scenario("core/latency-c1")
    s.figures = [
        Figure("bare p50/p99", f"{p50('bare', lat):.3f}/{p99('bare', lat):.3f} ms"),
        Figure("no policies", f"{median(added('plain')):+.3f} ms"),
        at_most("every policy, miss", median(added("miss")), ADDED_P50_TARGET_MS, "{:+.3f} ms"),
        Figure("hit", f"{median(added('hit')):+.3f} ms"),
        Figure("direct p50", f"{p50('direct', lat):.3f} ms"),
    ]
    s.details = [
        f"wrk -t1 -c1 -d{LATENCY_SECONDS}s, {LATENCY_ROUNDS} rounds of one run per path; each "
        "added p50 is over the same round's bare forwarder, the median of rounds",
        *(
            f"{path:<6} added p50 ms: {spread(added(path), '{:+.3f}')}"
            for path in ("plain", "miss", "hit")
        ),
        *(
            f"{path:<6} p50 ms: {spread([r.p50_ms for r in lat[path]], '{:.3f}')}; "
            f"p99 {p99(path, lat):.3f} ms"
            for path in PATHS
        ),
        *(note for path in PATHS for note in _errors_note(path, lat[path])),
    ]
    emit(s)

    s = Scenario("core/rss")
    s.figures = [
        at_most("shipped config idle", rss["shipped idle"], RSS_IDLE_TARGET_MB, "{:.0f} MB"),
        Figure("every policy idle", f"{rss['every policy idle']:.0f} MB"),
        at_most(
            "after the load", rss["every policy after load"], RSS_LOADED_TARGET_MB, "{:.0f} MB"
        ),
    ]
    s.details = ["VmRSS of the proxy process; 'after the load' is the every-policy proxy"]
    emit(s)

    # What log.level info (one JSON request line per request) costs.
    info, warning = levels["c32"]["info"], levels["c32"]["warning"]
    throughput = per_round([r.rps for r in info], [r.rps for r in warning], lambda v, a: v / a)
    info1, warning1 = levels["c1"]["info"], levels["c1"]["warning"]
    line = per_round([r.p50_ms for r in info1], [r.p50_ms for r in warning1], lambda v, a: v - a)
    s = Scenario("core/log-level-info")
    s.figures = [
        Figure(
            "no policies, throughput",
            f"{median([r.rps for r in info]):,.0f} req/s "
            f"({median(throughput):.2f}x of level warning)",
        ),
        Figure("added p50 at c=1 over level warning", f"{median(line):+.3f} ms"),
    ]
    s.details = [
        f"{LEVEL_ROUNDS} rounds of one run at each level (c={CONNECTIONS} for "
        f"{THROUGHPUT_SECONDS}s, c=1 for {LATENCY_SECONDS}s), each over the same round's run "
        "at level warning; request log lines written to a file; targets apply to level warning",
        "at level info, " + _cpu_text(info, *cpus),
        *_errors_note("level info", info + info1),
    ]
    emit(s)

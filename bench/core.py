"""Core overhead (issue 2): the same wrk load straight to a local upstream and through the proxy
with a policy-free route, in one run, so the two figures and their ratio are comparable.

- throughput: 1 KB JSON POSTs, `wrk -t1 -c32`, target >= 3,000 req/s with the proxy on one core;
- latency: one connection (`wrk -t1 -c1`), target: p50 added by the proxy <= 0.5 ms.

Runs alternate direct/proxy and repeat; medians are reported with their spread. The proxy
runs at log level warning (no request log lines); one extra run at level info shows what the
per-request JSON log line costs.
"""

from __future__ import annotations

import json
import resource
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.procs import Pinning, bench_upstream, proxy
from bench.report import Figure, Scenario, at_least, at_most, median, spread
from testkit.procs import Child

THROUGHPUT_TARGET = 3000.0  # req/s through the proxy, on one core
ADDED_P50_TARGET_MS = 0.5  # p50 latency the proxy adds at one concurrent client
CONNECTIONS = 32
RUN_SECONDS = 4
WARMUP_SECONDS = 1
REPEATS = 3
ROUTE = "bench"

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

_WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = assert(io.open("%(body_path)s", "rb"))
wrk.body = f:read("*a")
f:close()

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


def _write_script(tmp: Path) -> Path:
    body_path = tmp / "body.json"
    body_path.write_text(REQUEST_BODY)
    script = tmp / "post.lua"
    script.write_text(_WRK_SCRIPT % {"body_path": body_path})
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


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    """Measure direct and through the proxy, then emit the latency, throughput, logging lines."""
    with tempfile.TemporaryDirectory(prefix="bench-core-") as tmpdir:
        script = _write_script(Path(tmpdir))
        with bench_upstream(pinning) as (up_url, up_child):
            routes = {ROUTE: {"prefix": f"/{ROUTE}", "upstream": up_url}}
            direct_url = f"{up_url}/search"
            thr: dict[str, list[WrkRun]] = {"direct": [], "proxy": [], "proxy-info": []}
            lat: dict[str, list[WrkRun]] = {"direct": [], "proxy": [], "proxy-info": []}

            with proxy(pinning, routes) as (px_url, px_child):
                proxy_url = f"{px_url}/{ROUTE}/search"
                urls = {"direct": direct_url, "proxy": proxy_url}
                watch = {
                    "direct": {"upstream": up_child},
                    "proxy": {"proxy": px_child, "upstream": up_child},
                }
                for label, url in urls.items():
                    _check_answers(url)
                    _wrk(pinning, script, url, CONNECTIONS, WARMUP_SECONDS, watch[label])
                for _ in range(REPEATS):  # alternate, so drift hits both alike
                    for label, url in urls.items():
                        run_ = _wrk(pinning, script, url, CONNECTIONS, RUN_SECONDS, watch[label])
                        thr[label].append(run_)
                for _ in range(REPEATS):
                    for label, url in urls.items():
                        lat[label].append(_wrk(pinning, script, url, 1, RUN_SECONDS, watch[label]))

            # The same proxy with log.level info: one JSON line per request, to a file.
            with proxy(pinning, routes, log_level="info") as (px_url, px_child):
                url = f"{px_url}/{ROUTE}/search"
                w = {"proxy": px_child, "upstream": up_child}
                _check_answers(url)
                _wrk(pinning, script, url, CONNECTIONS, WARMUP_SECONDS, w)
                thr["proxy-info"].append(_wrk(pinning, script, url, CONNECTIONS, RUN_SECONDS, w))
                lat["proxy-info"].append(_wrk(pinning, script, url, 1, RUN_SECONDS, w))

    cpus = (pinning.proxy_cpu, pinning.other_cpu)

    # Latency at one concurrent client.
    d50 = median([r.p50_ms for r in lat["direct"]])
    d99 = median([r.p99_ms for r in lat["direct"]])
    p50 = median([r.p50_ms for r in lat["proxy"]])
    p99 = median([r.p99_ms for r in lat["proxy"]])
    s = Scenario("core/latency-c1")
    s.figures = [
        Figure("direct p50/p99", f"{d50:.3f}/{d99:.3f} ms"),
        Figure("proxy p50/p99", f"{p50:.3f}/{p99:.3f} ms"),
        at_most("added p50", p50 - d50, ADDED_P50_TARGET_MS, "{:.3f} ms"),
        Figure("proxy/direct p50", f"{p50 / d50:.2f}x"),
    ]
    s.details = [
        f"wrk -t1 -c1 -d{RUN_SECONDS}s, {REPEATS} runs each, alternating; medians of runs",
        "direct p50 ms: " + spread([r.p50_ms for r in lat["direct"]], "{:.3f}"),
        "proxy  p50 ms: " + spread([r.p50_ms for r in lat["proxy"]], "{:.3f}"),
        "proxy  p99 ms: " + spread([r.p99_ms for r in lat["proxy"]], "{:.3f}"),
        *_errors_note("direct", lat["direct"]),
        *_errors_note("proxy", lat["proxy"]),
    ]
    emit(s)

    # Throughput of 1 KB JSON POSTs.
    d_rps = median([r.rps for r in thr["direct"]])
    p_rps = median([r.rps for r in thr["proxy"]])
    s = Scenario("core/throughput-c32")
    s.figures = [
        at_least("proxy", p_rps, THROUGHPUT_TARGET, "{:,.0f} req/s"),
        Figure("direct", f"{d_rps:,.0f} req/s"),
        Figure("proxy/direct", f"{p_rps / d_rps:.2f}"),
        Figure(
            "p50/p99 direct",
            f"{median([r.p50_ms for r in thr['direct']]):.2f}/"
            f"{median([r.p99_ms for r in thr['direct']]):.2f} ms",
        ),
        Figure(
            "proxy",
            f"{median([r.p50_ms for r in thr['proxy']]):.2f}/"
            f"{median([r.p99_ms for r in thr['proxy']]):.2f} ms",
        ),
    ]
    if not pinning.enabled:
        s.figures.append(Figure("NOTE", "unpinned: not a one-core figure"))
    s.details = [
        f"wrk -t1 -c{CONNECTIONS} -d{RUN_SECONDS}s, 1 KB JSON POST -> 1 KB JSON answer, "
        f"{REPEATS} runs each, alternating; medians of runs",
        "direct req/s: " + spread([r.rps for r in thr["direct"]], "{:,.0f}"),
        "proxy  req/s: " + spread([r.rps for r in thr["proxy"]], "{:,.0f}"),
        "direct " + _cpu_text(thr["direct"], *cpus),
        "proxy  " + _cpu_text(thr["proxy"], *cpus),
        *_errors_note("direct", thr["direct"]),
        *_errors_note("proxy", thr["proxy"]),
    ]
    emit(s)

    # What log.level info (one JSON request line per request) costs.
    i_rps = thr["proxy-info"][0].rps
    i50 = lat["proxy-info"][0].p50_ms
    s = Scenario("core/log-level-info")
    s.figures = [
        Figure("proxy throughput", f"{i_rps:,.0f} req/s ({i_rps / p_rps:.2f}x of level warning)"),
        Figure("added p50", f"{i50 - d50:.3f} ms (level warning: {p50 - d50:.3f} ms)"),
    ]
    s.details = [
        "one run each; request log lines written to a file; targets apply to level warning",
        "proxy " + _cpu_text(thr["proxy-info"], *cpus),
        *_errors_note("proxy-info", thr["proxy-info"] + lat["proxy-info"]),
    ]
    emit(s)

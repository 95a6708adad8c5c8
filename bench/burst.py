"""An agent's parallel tool calls: 50 distinct Tavily searches at once, with tavily-python's
AsyncTavilyClient, straight to the fake vendor and through the proxy running the shipped
config.yaml (only the upstream origins changed, to the fake vendor; log level warning).

The fake vendor answers every search after 300 ms (`--latency 0.3`). The shipped tavily route
has `rate_limit: {rate: 50/m, burst: 50}` (a dev key's 100/min), `timeouts.total: 30s`, no
`max_wait`:

- fresh bucket: ROUNDS rounds, each with a new proxy process (full bucket, empty cache) and the
  same 50 searches straight to the vendor, alternating which goes first. Per mode: answered,
  p50 / p99 / max of the individual calls and the burst's wall time; then proxy minus direct.
  Target: through the proxy every call answered and none queued by the rate limit (the config
  says a burst of up to 50 goes out at once);
- back-to-back: one more fresh proxy, a first burst of 50 and at once a second burst of 50
  other searches. The bucket is empty, it refills one token per 1.2 s: the second burst's calls
  queue for their turn up to their 30 s deadline (less 0.25 s room for the attempt); those whose
  turn comes later are refused at once with 429 and a retry time. Context only.

Every query is distinct (the proxy's cache never answers). The agent runs in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tavily import AsyncTavilyClient

from bench.procs import Pinning, fake_vendor, get_json, get_text, metric_sum
from bench.report import Figure, Scenario, median, percentile, spread
from bench.search import QUERIES
from proxy.config import ConfigError, _Loader, load_config
from testkit.procs import Child, StartError, free_port

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_CONFIG = ROOT / "config.yaml"
LATENCY_S = 0.3  # the fake vendor's answer time for every search
CALLS = 50  # parallel tool calls in one burst
ROUNDS = 5  # fresh-bucket rounds, each with its own proxy process
ROUTE = "tavily"
API_KEY = "tvly-bench-burst"  # the fake accepts any key; with none the SDK runs keyless
CLIENT_TIMEOUT_S = 60.0  # tavily-python's default per-call timeout


# ------------------------------------------------------------------------------- processes


def shipped_config(vendor_url: str, port: int) -> dict[str, Any]:
    """config.yaml as the proxy reads it, each route's upstream pointed at the fake vendor.

    Read with the proxy's own loader (YAML 1.2 booleans, so `on:` stays a key). Beyond the
    upstreams only what running a bench child needs: the port, loopback, log level warning.
    """
    raw = yaml.load(SHIPPED_CONFIG.read_text(encoding="utf-8"), Loader=_Loader)
    doc: dict[str, Any] = copy.deepcopy(raw)
    for name, route in doc["routes"].items():
        vendor = (route.get("search") or {}).get("vendor", name)
        route["upstream"] = f"{vendor_url}/{vendor}"
    doc["server"].update(host="127.0.0.1", port=port)
    doc.setdefault("log", {})["level"] = "warning"
    return doc


@contextlib.contextmanager
def shipped_proxy(
    pinning: Pinning, vendor_url: str, timeout: float = 15.0
) -> Iterator[tuple[str, Child]]:
    """`python -m proxy` with the shipped config against the fake vendor, on the proxy CPU.

    The written config is validated with proxy.config.load_config first (a ConfigError says
    which key is wrong). Yields (url, child) once /healthz answers.
    """
    port = free_port()
    fd, config_path = tempfile.mkstemp(prefix="bench-burst-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(shipped_config(vendor_url, port), f, sort_keys=False)
    child = None
    try:
        load_config(config_path, env={})
        argv = [*pinning.prefix(pinning.proxy_cpu), sys.executable, "-m", "proxy"]
        child = Child("proxy", [*argv, "--config", config_path, "--port", str(port)])
        url = f"http://127.0.0.1:{port}"
        child.wait_http(url + "/healthz", timeout)
        yield url, child
    finally:
        if child is not None:
            child.stop()
        with contextlib.suppress(OSError):
            os.unlink(config_path)


# ----------------------------------------------------------------------------------- agent


@dataclass
class Call:
    seconds: float
    results: int = 0
    error: str | None = None  # exception type and message when the SDK raised

    @property
    def answered(self) -> bool:
        return self.error is None and self.results > 0


@dataclass
class Burst:
    calls: list[Call] = field(default_factory=list)
    wall: float = 0.0

    @property
    def answered(self) -> int:
        return sum(1 for c in self.calls if c.answered)

    def seconds(self, answered_only: bool = False) -> list[float]:
        return [c.seconds for c in self.calls if c.answered or not answered_only]

    def errors(self) -> Counter[str]:
        return Counter((c.error or "").split(":", 1)[0] for c in self.calls if c.error)


def _queries(tag: str) -> list[str]:
    """CALLS distinct searches an agent might send, tagged so no two rounds share one."""
    return [f"{QUERIES[i % len(QUERIES)]} {tag}-{i}" for i in range(CALLS)]


async def _burst(base_url: str, queries: list[str]) -> Burst:
    """Every query at once through one AsyncTavilyClient, as an agent's parallel tool calls."""
    client = AsyncTavilyClient(api_key=API_KEY, api_base_url=base_url)

    async def one(query: str) -> Call:
        t0 = time.perf_counter()
        try:
            answer = await client.search(query, max_results=3, timeout=CLIENT_TIMEOUT_S)
        except Exception as exc:  # the SDK raises on every non-200
            text = str(exc).strip().replace("\n", " ")[:200]
            return Call(time.perf_counter() - t0, error=f"{type(exc).__name__}: {text}")
        results = answer.get("results") if isinstance(answer, dict) else None
        return Call(time.perf_counter() - t0, len(results) if isinstance(results, list) else 0)

    try:
        t0 = time.perf_counter()
        calls = await asyncio.gather(*(one(q) for q in queries))
        return Burst(list(calls), time.perf_counter() - t0)
    finally:
        await client.close()


def burst(base_url: str, queries: list[str]) -> Burst:
    return asyncio.run(_burst(base_url, queries))


def _vendor_calls(vendor_url: str) -> int:
    return int(get_json(f"{vendor_url}/__fake__/stats")["total"])


# --------------------------------------------------------------------------------- figures


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _answered_text(answered: int, n: int) -> str:
    return f"{answered / n:.0%} ({answered}/{n})" if n else "n/a"


def _calls_line(b: Burst) -> str:
    s = b.seconds()
    return (
        f"answered {_answered_text(b.answered, len(b.calls))}, p50 {_ms(percentile(s, 50))} "
        f"p99 {_ms(percentile(s, 99))} max {_ms(max(s))}, wall {_ms(b.wall)}"
    )


def _mode_figures(bursts: list[Burst]) -> tuple[list[Figure], list[float]]:
    """answered, p50 / p99 / max of every call of every round, median wall time."""
    calls = [s for b in bursts for s in b.seconds()]
    answered = sum(b.answered for b in bursts)
    walls = [b.wall for b in bursts]
    figures = [
        Figure("answered", _answered_text(answered, len(calls))),
        Figure("p50", _ms(percentile(calls, 50))),
        Figure("p99", _ms(percentile(calls, 99))),
        Figure("max", _ms(max(calls))),
        Figure("wall", _ms(median(walls))),
    ]
    return figures, walls


def _ratelimit(metrics: str) -> dict[str, float]:
    found = {
        d: metric_sum(metrics, "search_proxy_ratelimit_total", route=ROUTE, decision=d) or 0.0
        for d in ("allowed", "delayed", "rejected")
    }
    found["wait_sum"] = (
        metric_sum(metrics, "search_proxy_ratelimit_wait_seconds_sum", route=ROUTE) or 0.0
    )
    return found


def _failures(bursts: list[Burst]) -> list[str]:
    errors: Counter[str] = Counter()
    sample = None
    for b in bursts:
        errors.update(b.errors())
        sample = sample or next((c.error for c in b.calls if c.error), None)
    if not errors:
        return []
    return [f"SDK errors: {dict(errors)}; e.g. {sample}"]


# ------------------------------------------------------------------------------- scenarios


def fresh_bucket(pinning: Pinning, vendor_url: str) -> list[Scenario]:
    """ROUNDS x (50 through a new proxy, 50 direct); which goes first alternates."""
    direct: list[Burst] = []
    proxied: list[Burst] = []
    limits: list[dict[str, float]] = []
    vendor_per_proxy_burst: list[int] = []
    burst(f"{vendor_url}/tavily", [f"warm-up {i}" for i in range(3)])  # imports, first connects
    for r in range(ROUNDS):
        with shipped_proxy(pinning, vendor_url) as (px_url, _):
            for mode in ("direct", "proxy") if r % 2 == 0 else ("proxy", "direct"):
                if mode == "direct":
                    direct.append(burst(f"{vendor_url}/tavily", _queries(f"direct-r{r}")))
                    continue
                before = _vendor_calls(vendor_url)
                proxied.append(burst(f"{px_url}/tavily", _queries(f"proxy-r{r}")))
                vendor_per_proxy_burst.append(_vendor_calls(vendor_url) - before)
                limits.append(_ratelimit(get_text(f"{px_url}/metrics")))

    d_figs, d_walls = _mode_figures(direct)
    p_figs, p_walls = _mode_figures(proxied)
    n = len(proxied) * CALLS
    answered = sum(b.answered for b in proxied)
    queued = sum(x["delayed"] for x in limits)
    refused = sum(x["rejected"] for x in limits)
    setup = (
        f"{CALLS} parallel searches per round with tavily-python {_tavily_version()} "
        f"AsyncTavilyClient (one client per burst), {ROUNDS} rounds; fake vendor latency "
        f"{LATENCY_S * 1000:.0f} ms; figures over all {ROUNDS * CALLS} calls, wall = median of "
        "the rounds"
    )

    d = Scenario("burst/50-parallel-direct", d_figs)
    d.details = [
        setup,
        "per round: " + "; ".join(_calls_line(b) for b in direct),
        *_failures(direct),
    ]

    p = Scenario("burst/50-parallel-proxy")
    p.figures = [
        Figure("answered", _answered_text(answered, n), "100%", answered == n),
        *p_figs[1:],
        Figure("queued by the rate limit", f"{queued:.0f}", "0", queued == 0),
    ]
    p.details = [
        "shipped config.yaml, upstreams -> fake vendor, log level warning; a new proxy process "
        "per round (full bucket: rate_limit {rate: 50/m, burst: 50}, empty cache)",
        "per round: " + "; ".join(_calls_line(b) for b in proxied),
        f"proxy rate-limit decisions over the rounds: allowed "
        f"{sum(x['allowed'] for x in limits):.0f}, delayed {queued:.0f}, rejected {refused:.0f}; "
        f"vendor calls per proxied burst: {', '.join(map(str, vendor_per_proxy_burst))}",
        *_failures(proxied),
    ]

    rounds = list(zip(direct, proxied, strict=True))
    diff_p50 = [percentile(b.seconds(), 50) - percentile(a.seconds(), 50) for a, b in rounds]
    diff_p99 = [percentile(b.seconds(), 99) - percentile(a.seconds(), 99) for a, b in rounds]
    diff_max = [max(b.seconds()) - max(a.seconds()) for a, b in rounds]
    diff_wall = [b.wall - a.wall for a, b in rounds]
    all_d = [s for b in direct for s in b.seconds()]
    all_p = [s for b in proxied for s in b.seconds()]
    x = Scenario("burst/proxy-minus-direct")
    x.figures = [
        Figure("p50", f"{(percentile(all_p, 50) - percentile(all_d, 50)) * 1000:+.0f} ms"),
        Figure("p99", f"{(percentile(all_p, 99) - percentile(all_d, 99)) * 1000:+.0f} ms"),
        Figure("max", f"{(max(all_p) - max(all_d)) * 1000:+.0f} ms"),
        Figure("wall", f"{(median(p_walls) - median(d_walls)) * 1000:+.0f} ms"),
    ]
    x.details = [
        "per-round differences (proxy minus direct, same round), ms: "
        f"p50 {spread([v * 1000 for v in diff_p50], '{:+.0f}')}; "
        f"p99 {spread([v * 1000 for v in diff_p99], '{:+.0f}')}; "
        f"max {spread([v * 1000 for v in diff_max], '{:+.0f}')}; "
        f"wall {spread([v * 1000 for v in diff_wall], '{:+.0f}')}",
    ]
    return [d, p, x]


def back_to_back(pinning: Pinning, vendor_url: str) -> list[Scenario]:
    """A fresh proxy, one burst, then at once a second: the second meets an empty bucket."""
    with shipped_proxy(pinning, vendor_url) as (px_url, _):
        first = burst(f"{px_url}/tavily", _queries("b2b-r1"))
        first_done = time.perf_counter()
        after_first = _ratelimit(get_text(f"{px_url}/metrics"))
        before = _vendor_calls(vendor_url)
        gap = time.perf_counter() - first_done
        second = burst(f"{px_url}/tavily", _queries("b2b-r2"))
        vendor_calls = _vendor_calls(vendor_url) - before
        after = _ratelimit(get_text(f"{px_url}/metrics"))

    queued = after["delayed"] - after_first["delayed"]
    refused = after["rejected"] - after_first["rejected"]
    waited = after["wait_sum"] - after_first["wait_sum"]
    ok = second.seconds(answered_only=True)
    failed = [c for c in second.calls if not c.answered]
    s = Scenario("burst/back-to-back-round-2")
    s.figures = [
        Figure("answered", _answered_text(second.answered, CALLS)),
        Figure("queued", f"{queued:.0f}"),
        Figure("refused", f"{refused:.0f}"),
        Figure("longest answered call", _ms(max(ok)) if ok else "n/a"),
        Figure("wall", f"{second.wall:.1f} s"),
    ]
    s.details = [
        f"context only: a fresh proxy, round 1: {_calls_line(first)}; then round 2 at once "
        f"({gap * 1000:.0f} ms later), {CALLS} other searches into the empty bucket "
        "(rate 50/m: one token per 1.2 s; no max_wait, so a call queues up to its "
        "timeouts.total 30 s less 0.25 s)",
        f"round 2: {_calls_line(second)}; vendor calls {vendor_calls}",
        f"round 2 rate-limit decisions: delayed {queued:.0f} (waited {waited:.1f} s in all, "
        f"{waited / queued if queued else 0:.1f} s mean), rejected {refused:.0f}, allowed "
        f"{after['allowed'] - after_first['allowed']:.0f}",
    ]
    if ok:
        s.details.append(
            f"answered calls: p50 {_ms(percentile(ok, 50))}, the last answered after "
            f"{_ms(max(ok))} (about {max(ok) - LATENCY_S:.1f} s of it queued for a token)"
        )
    if failed:
        fs = [c.seconds for c in failed]
        s.details.append(
            f"{len(failed)} not answered, after p50 {_ms(percentile(fs, 50))} max "
            f"{_ms(max(fs))}; {_failures([second])[0]}"
        )
    return [s]


def _tavily_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tavily-python")
    except PackageNotFoundError:
        return "?"


SCENARIOS: tuple[Callable[[Pinning, str], list[Scenario]], ...] = (fresh_bucket, back_to_back)


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    """One fake vendor (300 ms per search) for every scenario; a proxy per round."""
    with fake_vendor(pinning, "--latency", str(LATENCY_S)) as vendor_url:
        for scenario in SCENARIOS:
            try:
                for s in scenario(pinning, vendor_url):
                    emit(s)
            except (StartError, ConfigError) as exc:
                emit(Scenario(f"burst/{scenario.__name__}", error=f"{type(exc).__name__}: {exc}"))

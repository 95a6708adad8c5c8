"""Hostile agents, round three (issue 26), in the hostile group: what request_timeout,
max_buffered_bytes and one-level failover hold against, measured on the proxy process.

- trickled-bodies: TRICKLED connections each send a request head and then one body byte every
  TRICKLE_EVERY_S (under body_timeout), never finishing; meanwhile a normal agent searches.
  Figures: connections cut by request_timeout (a 408, then closed) and when (target: all, none
  later than request_timeout + 1 s), normal searches answered (target: all).
- memory-burst: SLOW_READERS agents ask for a 7 MiB octet-stream answer with a Content-Length
  (the kind the proxy buffers) and read none of it, while BOMBS agents ask for gzip bombs (JSON
  inflating to 100 MiB). Figures: proxy RSS at baseline, its peak (VmHWM, target <= 150 MB) and
  once they left (target: within 20 MB of baseline), how each was answered.
- fallback-graph: 12 routes, each falling back to the next two (wrapping round), 3 attempts,
  every vendor call failing; one search to each route. Figure: the most vendor calls one
  request made (target <= 20; the report counted 480).

Loopback only; the agents run in this process; server limits are the defaults unless named.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp

from bench.client import run_load
from bench.hostile import hostile_proxy, memory_mb
from bench.procs import Pinning, bench_upstream, fake_vendor
from bench.report import Figure, Scenario, at_most, every, percentile
from testkit.procs import Child

TRICKLED = 1000
TRICKLE_EVERY_S = 1.0
REQUEST_TIMEOUT_S = 5.0
NORMAL_SEARCHES = 200
SLOW_READERS, BOMBS = 30, 30
SLOW_ANSWER = 7 * 1024 * 1024
BOMB_INFLATED = 100 * 1024 * 1024
RSS_PEAK_MB, RSS_RETURN_MB = 150.0, 20.0
SETTLE_S = 3.0
GRAPH_ROUTES, GRAPH_ATTEMPTS, GRAPH_CALLS = 12, 3, 20


def _search(i: int) -> dict[str, Any]:
    return {"query": f"hostile bench round three {i}", "max_results": 3}


# ------------------------------------------------------------------------- trickled bodies


async def _open(host: str, port: int, source: str) -> tuple[asyncio.StreamReader, Any] | None:
    sock = socket.socket()
    sock.setblocking(False)
    sock.bind((source, 0))
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), 5)
        return await asyncio.open_connection(sock=sock)
    except (OSError, TimeoutError):
        sock.close()
        return None


async def _trickle(pair: tuple[asyncio.StreamReader, Any], started: float) -> float | None:
    """Trickle a body until the proxy answers; seconds from the head to its 408 (None: none)."""
    reader, writer = pair
    writer.write(b"POST /v/tavily/search HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    while True:
        try:
            data = await asyncio.wait_for(reader.read(4096), TRICKLE_EVERY_S)
        except TimeoutError:
            with contextlib.suppress(ConnectionError):
                writer.write(b" ")
            continue
        except ConnectionError:
            return None
        writer.transport.abort()
        return time.perf_counter() - started if data.startswith(b"HTTP/1.1 408") else None


async def _trickled(url: str) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    opened = []
    for start in range(0, TRICKLED, 100):  # batches under the listen backlog
        batch = [_open(host, int(port), "127.0.0.2") for _ in range(min(100, TRICKLED - start))]
        opened += [p for p in await asyncio.gather(*batch) if p is not None]
    started = time.perf_counter()
    cuts = asyncio.ensure_future(asyncio.gather(*(_trickle(pair, started) for pair in opened)))
    rounds = []  # normal searches, a round after another, for as long as the trickle lasts
    while not cuts.done():
        rounds.append(await run_load(f"{url}/v/tavily/search", NORMAL_SEARCHES, 2, _search))
    return {"opened": len(opened), "cuts": await cuts, "normal": rounds}


def trickled_bodies(pinning: Pinning, vendor_url: str) -> list[Scenario]:
    server = {
        "request_timeout": f"{REQUEST_TIMEOUT_S:g}s",
        "body_timeout": "4s",  # longer than each gap: only the whole-request limit cuts
        "max_connections": 4000,
        "max_connections_per_peer": 4000,  # here the per-peer cap is not what is measured
    }
    with hostile_proxy(pinning, vendor_url, server) as (url, _):
        r = asyncio.run(_trickled(url))
    cut = [t for t in r["cuts"] if t is not None]
    rounds = r["normal"]
    answered, sent = sum(n.ok for n in rounds), sum(n.n for n in rounds)
    ms = [o.seconds * 1000 for n in rounds for o in n.outcomes]
    s = Scenario("hostile/trickled-bodies")
    s.figures = [
        every("cut by request_timeout", len(cut), TRICKLED),
        at_most("latest cut", max(cut, default=float("inf")), REQUEST_TIMEOUT_S + 1, "{:.1f} s"),
        every("normal searches answered", answered, sent),
    ]
    s.details = [
        f"{r['opened']} connections from 127.0.0.2, a body byte each every "
        f"{TRICKLE_EVERY_S:g} s (body_timeout 4 s, request_timeout {REQUEST_TIMEOUT_S:g} s); "
        f"cut after {min(cut, default=0):.1f}..{max(cut, default=0):.1f} s",
        f"normal searches meanwhile (2 at a time, until the last cut): {answered}/{sent} "
        f"answered, p50 {percentile(ms, 50):.1f} ms, p99 {percentile(ms, 99):.1f} ms, max "
        f"{max(ms, default=0):.0f} ms",
    ]
    return [s]


# --------------------------------------------------------------------------- memory burst


async def _slow_reader(host: str, port: int, path: str) -> Any:
    """Ask for `path` and read nothing; the writer, to close later."""
    sock = socket.socket()
    sock.setblocking(False)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    _, writer = await asyncio.open_connection(sock=sock, limit=4096)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return writer


async def _bomb(http: aiohttp.ClientSession, url: str) -> str:
    try:
        async with http.get(url) as r:
            await r.read()
            return f"{r.status} {r.headers.get('X-Proxy-Error', '')}".strip()
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def _burst(url: str, child: Child) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    await run_load(f"{url}/v/search", 200, 4, _search)  # warm up
    baseline = memory_mb(child.pid)["VmRSS"]
    readers = await asyncio.gather(
        *(_slow_reader(host, int(port), f"/v/bin/{SLOW_ANSWER}") for _ in range(SLOW_READERS))
    )
    async with aiohttp.ClientSession() as http:
        bombs = await asyncio.gather(
            *(_bomb(http, f"{url}/v/bomb/{BOMB_INFLATED}") for _ in range(BOMBS))
        )
        await asyncio.sleep(1.0)  # the readers' answers held while they do not read
        during = memory_mb(child.pid)
        metrics = await (await http.get(f"{url}/metrics")).text()
    for writer in readers:
        writer.transport.abort()
    await asyncio.sleep(SETTLE_S)
    after_load = await run_load(f"{url}/v/search", 100, 4, _search)
    await asyncio.sleep(SETTLE_S)
    return {
        "baseline": baseline,
        "peak": memory_mb(child.pid)["VmHWM"],
        "held": during["VmRSS"],
        "after": memory_mb(child.pid)["VmRSS"],
        "bombs": Counter(bombs),
        "after_load": after_load,
        "buffered": _metric(metrics, "search_proxy_buffered_bytes"),
        "refused": _metric(metrics, "search_proxy_memory_budget_refused_total"),
    }


def _metric(exposition: str, name: str) -> float:
    for line in exposition.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def memory_burst(pinning: Pinning, vendor_url: str) -> list[Scenario]:
    with (
        bench_upstream(pinning) as (upstream, _),
        hostile_proxy(pinning, upstream, {}) as (
            url,
            child,
        ),
    ):
        r = asyncio.run(_burst(url, child))
    s = Scenario("hostile/memory-burst")
    s.figures = [
        Figure("RSS baseline", f"{r['baseline']:.0f} MB"),
        at_most("peak", r["peak"], RSS_PEAK_MB, "{:.0f} MB"),
        at_most("after: +", r["after"] - r["baseline"], RSS_RETURN_MB, "{:.1f} MB"),
        every("served after", r["after_load"].ok, r["after_load"].n),
    ]
    s.details = [
        f"{SLOW_READERS} agents asked for {SLOW_ANSWER >> 20} MiB with a Content-Length and read "
        f"nothing; {BOMBS} asked for gzip bombs inflating to {BOMB_INFLATED >> 20} MiB: "
        f"{dict(r['bombs'])}",
        f"while held: RSS {r['held']:.0f} MB, search_proxy_buffered_bytes "
        f"{r['buffered'] / 2**20:.1f} MiB (max_buffered_bytes 32 MiB), "
        f"{r['refused']:.0f} bodies refused or passed through",
    ]
    return [s]


# -------------------------------------------------------------------------- fallback graph


def _graph_config(vendor_url: str) -> dict[str, Any]:
    names = [f"r{i}" for i in range(GRAPH_ROUTES)]
    retry = {"attempts": GRAPH_ATTEMPTS, "backoff": {"initial": "1ms", "max": "1ms"}}
    return {
        name: {
            "prefix": f"/{name}",
            "upstream": f"{vendor_url}/tavily",
            "search": {"vendor": "tavily"},
            "retry": {**retry, "budget": {"ratio": 1.0, "min_per_s": 1000}},
            "fallback": {"providers": [names[(i + 1) % len(names)], names[(i + 2) % len(names)]]},
        }
        for i, name in enumerate(names)
    }


def _vendor_calls(vendor_url: str) -> int:
    with urllib.request.urlopen(f"{vendor_url}/__fake__/stats", timeout=5) as r:
        return int(json.load(r)["total"])


def fallback_graph(pinning: Pinning, vendor_url: str) -> list[Scenario]:
    calls: list[int] = []
    with fake_vendor(pinning, "--down") as down:
        with hostile_proxy(pinning, down, {}, routes=_graph_config(down)) as (url, _):
            for i in range(GRAPH_ROUTES):
                before = _vendor_calls(down)
                body = json.dumps({"query": "a graph of fallbacks"}).encode()
                request = urllib.request.Request(f"{url}/r{i}/search", data=body, method="POST")
                with contextlib.suppress(urllib.error.HTTPError):
                    urllib.request.urlopen(request, timeout=30).close()
                calls.append(_vendor_calls(down) - before)
    s = Scenario("hostile/fallback-graph")
    s.figures = [at_most("worst vendor calls", max(calls), GRAPH_CALLS, "{:.0f}")]
    s.details = [
        f"{GRAPH_ROUTES} routes, each falling back to the next two, {GRAPH_ATTEMPTS} attempts, "
        f"every call failing; calls per request by route: {calls}"
    ]
    return [s]


SCENARIOS: tuple[Callable[[Pinning, str], list[Scenario]], ...] = (
    trickled_bodies,
    memory_burst,
    fallback_graph,
)

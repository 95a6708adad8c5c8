"""The proxy's own MCP server: a `web_search` tool call through /mcp against the same search
POSTed to /v1/search.

One proxy process with one search route (`tavily`, retry {attempts: 1}, no cache) in front of
the fake vendor (latency 0); the MCP server is on by default (`mcp_server`). Every query is
new. The load client runs in this process, pinned to the non-proxy CPU. Three ways to search:

- `v1`: POST /v1/search {"query", "max_results": 3} (aiohttp);
- `mcp-raw`: POST /mcp with the JSON-RPC `tools/call` of web_search (aiohttp, no MCP SDK): what
  the proxy's MCP layer costs (the stateless transport, JSON-RPC, the text rendering);
- `mcp-sdk`: `ClientSession.call_tool("web_search", ...)` of the official mcp client over
  `streamable_http_client`, one initialized session: what an agent sees, the client's own work
  (pydantic models, the output-schema check of every result) included.

Scenarios (then bench/mcpstop.py's: how long a call lives when every provider hangs):
- sequential: SEQ_CALLS searches each way, one at a time, interleaved query by query (so drift
  hits all alike); p50 / p99 each and the differences to v1. Target: mcp-raw p50 within
  RAW_ADDED_P50_TARGET_MS of v1 (the server side of MCP); mcp-sdk for context.
- concurrent: CONC_CALLS searches each way at concurrency CONCURRENCY (an agent's parallel tool
  calls), the ways in alternating blocks; p50 / p99 and throughput each. Target: every call
  answered with results.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import httpx
import jsonschema
import orjson
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from referencing import Registry

from bench import mcpstop
from bench.procs import Pinning, client_pinned, fake_vendor, get_json, proxy
from bench.report import Figure, Scenario, at_most, percentile
from bench.search import QUERIES
from testkit.procs import StartError

ROUTES_TIMEOUTS = {"connect": "1s", "per_try": "2s", "total": "10s"}
MAX_RESULTS = 3
SEQ_CALLS = 400  # per way
CONC_CALLS = 600  # per way
CONCURRENCY = 10
BLOCKS = 3
RAW_ADDED_P50_TARGET_MS = 2.0
WAYS = ("v1", "mcp-raw", "mcp-sdk")
MCP_HEADERS = {"Accept": "application/json, text/event-stream"}
SCHEMA_CHECK: list[float] = []  # ms per outputSchema check in the client, measured after a run

# A call: the query in, whether it came back with results out.
Call = Callable[[str], Awaitable[bool]]


def _query(tag: str, i: int) -> str:
    """A new query each time, worded like an agent's (the fake's results depend on it)."""
    return f"{QUERIES[i % len(QUERIES)]} {tag} {i}"


@contextlib.asynccontextmanager
async def _ways(px_url: str) -> AsyncIterator[dict[str, Call]]:
    """The three ways to search, each over its own connection(s)."""
    v1_url, mcp_url = f"{px_url}/v1/search", f"{px_url}/mcp"
    connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2)
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        httpx.AsyncClient(trust_env=False, timeout=30) as sdk_http,
        streamable_http_client(mcp_url, http_client=sdk_http) as (read, write, _),
        ClientSession(read, write) as sdk,
    ):
        await sdk.initialize()
        ids = iter(range(1, 10**9))
        last_answer: dict[str, Any] | None = None

        async def v1(q: str) -> bool:
            async with http.post(v1_url, json={"query": q, "max_results": MAX_RESULTS}) as r:
                body = await r.read()
            return r.status == 200 and bool(orjson.loads(body)["results"])

        async def mcp_raw(q: str) -> bool:
            message = {
                "jsonrpc": "2.0",
                "id": next(ids),
                "method": "tools/call",
                "params": {
                    "name": "web_search",
                    "arguments": {"query": q, "max_results": MAX_RESULTS},
                },
            }
            async with http.post(mcp_url, json=message, headers=MCP_HEADERS) as r:
                body = await r.read()
            if r.status != 200:
                return False
            result = orjson.loads(body).get("result", {})
            return not result.get("isError") and bool(result["structuredContent"]["results"])

        async def mcp_sdk(q: str) -> bool:
            nonlocal last_answer
            result = await sdk.call_tool("web_search", {"query": q, "max_results": MAX_RESULTS})
            content = result.structuredContent
            last_answer = content
            return not result.isError and content is not None and bool(content["results"])

        yield {"v1": v1, "mcp-raw": mcp_raw, "mcp-sdk": mcp_sdk}
        tool = (await sdk.list_tools()).tools[0]
        if tool.outputSchema is not None and last_answer is not None:
            SCHEMA_CHECK.append(_schema_check_ms(tool.outputSchema, last_answer))


def _schema_check_ms(schema: dict[str, Any], answer: dict[str, Any], n: int = 50) -> float:
    """What the client's check of one result costs: ClientSession.call_tool validates the
    structuredContent with jsonschema.validate, which checks the schema itself first."""
    started = time.perf_counter()
    for _ in range(n):
        jsonschema.validate(answer, schema, registry=Registry())
    return (time.perf_counter() - started) / n * 1000


async def _timed(call: Call, q: str) -> tuple[float, bool]:
    started = time.perf_counter()
    try:
        ok = await call(q)
    except Exception:
        ok = False
    return time.perf_counter() - started, ok


async def _sequential(ways: dict[str, Call]) -> dict[str, list[tuple[float, bool]]]:
    for name in WAYS:  # warm: connections, the client's tool cache
        await ways[name](f"warm up {name}")
    out: dict[str, list[tuple[float, bool]]] = {name: [] for name in WAYS}
    for i in range(SEQ_CALLS):
        order = WAYS[i % 3 :] + WAYS[: i % 3]  # no way always first
        for name in order:
            out[name].append(await _timed(ways[name], _query(f"seq {name}", i)))
    return out


async def _concurrent(
    ways: dict[str, Call],
) -> tuple[dict[str, list[tuple[float, bool]]], dict[str, float]]:
    out: dict[str, list[tuple[float, bool]]] = {name: [] for name in WAYS}
    wall = dict.fromkeys(WAYS, 0.0)
    per_block = CONC_CALLS // BLOCKS
    for block in range(BLOCKS):
        for name in WAYS:
            started = time.perf_counter()
            out[name] += await _at_once(ways[name], f"conc {name} {block}", per_block)
            wall[name] += time.perf_counter() - started
    return out, wall


async def _at_once(call: Call, tag: str, n: int) -> list[tuple[float, bool]]:
    """`n` calls, CONCURRENCY at a time."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> tuple[float, bool]:
        async with gate:
            return await _timed(call, _query(tag, i))

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _stats(samples: list[tuple[float, bool]]) -> tuple[float, float, int]:
    times = [s for s, _ in samples]
    return percentile(times, 50), percentile(times, 99), sum(1 for _, ok in samples if ok)


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    try:
        with client_pinned(pinning), fake_vendor(pinning) as vendor_url:
            routes = {
                "tavily": {
                    "prefix": "/tavily",
                    "upstream": f"{vendor_url}/tavily",
                    "timeouts": ROUTES_TIMEOUTS,
                    "retry": {"attempts": 1},
                    "search": {"vendor": "tavily"},
                }
            }
            with proxy(pinning, routes) as (px_url, _):

                async def measure() -> tuple[Any, Any]:
                    async with _ways(px_url) as ways:
                        return await _sequential(ways), await _concurrent(ways)

                sequential, (concurrent, wall) = asyncio.run(measure())
            calls = int(get_json(f"{vendor_url}/__fake__/stats")["total"])
    except StartError as exc:
        emit(Scenario("mcp/*", error=f"{type(exc).__name__}: {exc}"))
        return
    emit(_sequential_scenario(sequential))
    emit(_concurrent_scenario(concurrent, wall, calls))
    mcpstop.run(pinning, emit)


def _sequential_scenario(samples: dict[str, list[tuple[float, bool]]]) -> Scenario:
    stats = {name: _stats(samples[name]) for name in WAYS}
    v1_p50, v1_p99, _ = stats["v1"]
    raw_added = (stats["mcp-raw"][0] - v1_p50) * 1000
    sdk_added = (stats["mcp-sdk"][0] - v1_p50) * 1000
    answered = sum(ok for _, _, ok in stats.values())
    s = Scenario("mcp/sequential-tool-call-vs-v1-search")
    s.figures = [
        Figure("p50 v1", _ms(v1_p50)),
        Figure("mcp-raw", _ms(stats["mcp-raw"][0])),
        Figure("mcp-sdk", _ms(stats["mcp-sdk"][0])),
        at_most("mcp-raw added p50", raw_added, RAW_ADDED_P50_TARGET_MS, "{:.2f} ms"),
        Figure("mcp-sdk added p50", f"{sdk_added:.2f} ms"),
        Figure(
            "answered",
            f"{answered}/{len(WAYS) * SEQ_CALLS}",
            "all",
            answered == len(WAYS) * SEQ_CALLS,
        ),
    ]
    s.details = [
        f"{SEQ_CALLS} searches each way, one at a time, interleaved query by query; fake vendor "
        "latency 0, route tavily {retry: {attempts: 1}}, no cache, max_results 3",
        "p99: "
        + ", ".join(f"{name} {_ms(stats[name][1])}" for name in WAYS)
        + f"; p99 differences to v1: mcp-raw {(stats['mcp-raw'][1] - v1_p99) * 1000:+.2f} ms, "
        f"mcp-sdk {(stats['mcp-sdk'][1] - v1_p99) * 1000:+.2f} ms",
        "mcp-raw: the JSON-RPC tools/call POSTed as is (the proxy's side of MCP); mcp-sdk: the "
        "official client's call_tool, its own work included (pydantic models, the "
        "outputSchema check of each result)",
    ]
    if SCHEMA_CHECK:
        s.details.append(
            f"of mcp-sdk's added time, the client's outputSchema check of each result: "
            f"{SCHEMA_CHECK[-1]:.2f} ms (jsonschema.validate, which checks the schema against "
            "its metaschema on every call; measured in the bench process)"
        )
    return s


def _concurrent_scenario(
    samples: dict[str, list[tuple[float, bool]]], wall: dict[str, float], calls: int
) -> Scenario:
    stats = {name: _stats(samples[name]) for name in WAYS}
    total = sum(len(v) for v in samples.values())
    answered = sum(ok for _, _, ok in stats.values())
    s = Scenario(f"mcp/concurrent-{CONCURRENCY}-tool-calls-vs-v1-search")
    s.figures = [
        *(
            Figure(f"p50/p99 {name}", f"{_ms(stats[name][0])}/{_ms(stats[name][1])}")
            for name in WAYS
        ),
        Figure("answered", f"{answered}/{total}", "all", answered == total),
    ]
    v1_p50, v1_p99, _ = stats["v1"]
    s.details = [
        f"{CONC_CALLS} searches each way at concurrency {CONCURRENCY}, in {BLOCKS} alternating "
        f"blocks; vendor calls in the whole group (both scenarios, warm-up included): {calls}",
        "differences to v1: "
        + ", ".join(
            f"{name} p50 {(stats[name][0] - v1_p50) * 1000:+.2f} ms, "
            f"p99 {(stats[name][1] - v1_p99) * 1000:+.2f} ms"
            for name in WAYS[1:]
        ),
        "throughput: "
        + ", ".join(f"{name} {len(samples[name]) / wall[name]:.0f}/s" for name in WAYS),
    ]
    return s

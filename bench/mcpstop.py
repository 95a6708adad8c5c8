"""How long a `web_search` call on /mcp lives when every provider hangs (part of the `mcp` group).

One proxy process with two search routes (tavily, brave) in front of a fake vendor that answers
after HANG_S: per_try 2s, total 30s, 3 attempts each, so an unbounded call would run 2 providers
x 3 attempts x 2 s; `mcp_server.call_timeout` CALL_TIMEOUT. The clients are raw JSON-RPC POSTs
(aiohttp), pinned to the non-proxy CPU.

Scenarios:
- gone: TRIALS clients start a call, half of them leave (close the connection) after
  LEAVE_AFTER_S, the other half send notifications/cancelled on a POST of their own and read
  their call's answer. Figures: vendor calls made in the WINDOW_S after (target 0), and the
  time from a cancel to its call's answer (target within 1 s).
- hanging: TRIALS calls with every provider hanging, each to its end. Figure: the longest call
  (target: the deadline, CALL_TIMEOUT, with ANSWER_S to answer; HARD_STOP_S is the backstop
  for a policy that would not keep to it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from bench.procs import Pinning, client_pinned, fake_vendor, get_json, proxy
from bench.report import Scenario, at_most
from proxy.mcp_engine import HARD_STOP_S
from testkit.procs import StartError

HANG_S = 120.0
CALL_TIMEOUT = 5.0
TRIALS = 6
LEAVE_AFTER_S = 0.5
WINDOW_S = 3.0  # longer than per_try: an attempt still going would have started another
ANSWER_S = 0.25  # from the deadline to the answer on the client's side
ACCEPT = {"Accept": "application/json, text/event-stream"}
TIMEOUTS = {"connect": "1s", "per_try": "2s", "total": "30s"}
RETRY = {"attempts": 3, "backoff": {"initial": "100ms"}, "budget": {"ratio": 1.0, "min_per_s": 50}}


def _call(request_id: int, query: str) -> dict[str, Any]:
    arguments = {"query": query}
    params = {"name": "web_search", "arguments": arguments}
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}


async def _leave(url: str, i: int) -> None:
    """A call whose client closes its connection after LEAVE_AFTER_S."""
    timeout = aiohttp.ClientTimeout(total=LEAVE_AFTER_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        try:
            async with http.post(url, json=_call(1, f"left {i}"), headers=ACCEPT) as r:
                await r.read()
        except TimeoutError:
            pass  # the session closes: the connection goes


async def _cancel(url: str, i: int) -> float:
    """A call cancelled after LEAVE_AFTER_S; seconds from the cancel to the call's answer."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2)) as http:
        request_id = 100 + i  # each client its own id: an id two clients share stops neither
        pending = asyncio.ensure_future(
            http.post(url, json=_call(request_id, f"cancelled {i}"), headers=ACCEPT)
        )
        await asyncio.sleep(LEAVE_AFTER_S)
        cancel = {"method": "notifications/cancelled", "params": {"requestId": request_id}}
        sent = time.perf_counter()
        async with http.post(url, json={"jsonrpc": "2.0", **cancel}, headers=ACCEPT) as r:
            await r.read()
        response = await pending
        await response.read()
        response.release()
        return time.perf_counter() - sent


async def _gone(url: str, vendor_url: str) -> tuple[int, list[float]]:
    """Vendor calls in the WINDOW_S after every client left or cancelled (and the proxy had a
    second to notice), and the cancels' times to their answers."""
    half = TRIALS // 2
    left = [asyncio.ensure_future(_leave(url, i)) for i in range(half)]
    cancelled = [asyncio.ensure_future(_cancel(url, i)) for i in range(TRIALS - half)]
    await asyncio.sleep(LEAVE_AFTER_S + 1.0)
    before = _vendor_calls(vendor_url)
    await asyncio.sleep(WINDOW_S)
    after = _vendor_calls(vendor_url)
    await asyncio.gather(*left)
    return after - before, list(await asyncio.gather(*cancelled))


async def _hanging(url: str) -> list[float]:
    """Each call's time to its answer with every provider hanging."""

    async def one(i: int) -> float:
        started = time.perf_counter()
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json=_call(1, f"hanging {i}"), headers=ACCEPT) as r:
                await r.read()
        return time.perf_counter() - started

    return list(await asyncio.gather(*(one(i) for i in range(TRIALS))))


def _vendor_calls(vendor_url: str) -> int:
    return int(get_json(f"{vendor_url}/__fake__/stats")["total"])


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    try:
        with (
            client_pinned(pinning),
            fake_vendor(pinning, "--latency", str(HANG_S)) as vendor_url,
        ):
            routes = {
                name: {
                    "prefix": f"/{name}",
                    "upstream": f"{vendor_url}/{name}",
                    "timeouts": TIMEOUTS,
                    "retry": RETRY,
                    "search": {"vendor": name},
                }
                for name in ("tavily", "brave")
            }
            mcp_server = {"call_timeout": f"{CALL_TIMEOUT}s"}
            with proxy(pinning, routes, mcp_server=mcp_server) as (px_url, _):
                url = f"{px_url}/mcp"
                after, cancels = asyncio.run(_gone(url, vendor_url))
                longest = max(asyncio.run(_hanging(url)))
    except StartError as exc:
        emit(Scenario("mcp/calls-stop-*", error=f"{type(exc).__name__}: {exc}"))
        return
    gone = Scenario("mcp/vendor-calls-after-the-client-left-or-cancelled")
    gone.figures = [
        at_most("vendor calls after", after, 0, "{:.0f}"),
        at_most("cancel to answer, max", max(cancels), 1.0, "{:.2f} s"),
    ]
    gone.details = [
        f"{TRIALS} web_search calls with both providers hanging: {TRIALS // 2} clients closed "
        f"their connection after {LEAVE_AFTER_S} s, {TRIALS - TRIALS // 2} sent "
        f"notifications/cancelled; vendor calls counted over the {WINDOW_S} s after (per_try "
        "2s: a call still running would have started another attempt)",
    ]
    hanging = Scenario("mcp/longest-call-every-provider-hanging")
    hanging.figures = [at_most("longest call", longest, CALL_TIMEOUT + ANSWER_S, "{:.2f} s")]
    hanging.details = [
        f"{TRIALS} calls at once; mcp_server.call_timeout {CALL_TIMEOUT:g}s (the target, with "
        f"{ANSWER_S} s to answer; a {HARD_STOP_S:g} s backstop cancels a call past it); "
        "unbounded, 2 providers x 3 attempts x per_try 2s would take about 12 s",
    ]
    emit(gone)
    emit(hanging)

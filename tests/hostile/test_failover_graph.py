"""A graph of fallbacks cannot multiply one request, against a real proxy process: failover is
one level deep (a route standing in for another does not follow its own fallbacks), and every
vendor route has a per-request vendor-call cap (max_calls_per_request) that retries, variants
and failovers spend together. Calls are counted at the fake vendor, which fails every one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from testkit.fakevendor import FakeVendor
from testkit.proxyprocess import ProxyProcess
from testkit.waiting import wait_until
from tests.conftest import route

ROUTES = 12
ATTEMPTS = 3
CAPPED = 5
# Retries the budget never holds back, so that only the graph and the cap count.
RETRY = {
    "attempts": ATTEMPTS,
    "backoff": {"initial": "1ms", "max": "1ms", "jitter": "none"},
    "budget": {"ratio": 1.0, "min_per_s": 1000},
}


def graph(vendor_url: str) -> dict[str, Any]:
    """The report's graph: route i falls back to routes i+1 and i+2 (wrapping round), each with
    3 attempts; plus `capped`, falling back to all twelve with a cap of 5 calls."""
    names = [f"r{i}" for i in range(ROUTES)]
    routes = {
        name: route(
            # r0 at the vendor's /tavily paths, the others at its bare ones (also Tavily's).
            f"{vendor_url}/tavily" if i == 0 else vendor_url,
            f"/{name}",
            search={"vendor": "tavily", "on_empty": "pass"},
            retry=RETRY,
            fallback={"providers": [names[(i + 1) % ROUTES], names[(i + 2) % ROUTES]]},
        )
        for i, name in enumerate(names)
    }
    routes["capped"] = route(
        f"{vendor_url}/tavily",
        "/capped",
        search={"vendor": "tavily", "on_empty": "pass"},
        retry=RETRY,
        fallback={"providers": names},
        max_calls_per_request=CAPPED,
    )
    routes["small"] = route(
        vendor_url, "/small", search={"vendor": "tavily"}, retry=RETRY, max_calls_per_request=2
    )
    return {"routes": routes}


@pytest.fixture(scope="module")
def proxy(fake: FakeVendor) -> Iterator[ProxyProcess]:
    process = ProxyProcess(graph(fake.url)).start()  # type: ignore[attr-defined]
    yield process
    process.stop()


async def failing(
    proxy: ProxyProcess, fake: FakeVendor, path: str, down: str | None = None
) -> tuple[int, dict[str, str], Any, int]:
    """One search to `path` while the vendor fails (`down`: only its paths under that prefix):
    the status, headers and body, and how many calls reached the vendor."""
    fake.down(path_prefix=down)
    try:
        before = fake.count()
        async with aiohttp.ClientSession() as http:
            r = await http.post(proxy.url + path, json={"query": "graph of fallbacks"})
            body = await r.json()
        return r.status, dict(r.headers), body, fake.count() - before
    finally:
        fake.up()


async def test_a_twelve_route_graph_costs_one_level_of_fallbacks(
    proxy: ProxyProcess, fake: FakeVendor
) -> None:
    status, _, _, calls = await failing(proxy, fake, "/r0/search")
    assert status == 503
    # r0's 3 attempts, then r1's and r2's 3 each; neither asks its own fallbacks (the report
    # counted 480 calls for this graph).
    assert calls == 3 * ATTEMPTS
    line = wait_until(lambda: [e for e in proxy.events("request") if e["route"] == "r0"], 5)
    assert line[-1]["status"] == 503


async def test_the_route_cap_bounds_retries_and_failovers_together(
    proxy: ProxyProcess, fake: FakeVendor
) -> None:
    status, _, _, calls = await failing(proxy, fake, "/capped/search")
    assert calls == CAPPED  # 3 of its own, then 2 of r0's: the twelve fallbacks stop there
    assert status == 503  # the vendor's own answer: every fallback's part was refused


async def test_a_fallback_still_answers_within_the_cap(
    proxy: ProxyProcess, fake: FakeVendor
) -> None:
    # Only r0 fails: the other routes reach the vendor's bare paths.
    status, headers, body, calls = await failing(proxy, fake, "/r0/search", down="/tavily")
    assert status == 200 and body["results"]
    assert headers["X-Search-Provider"] == "r1"
    assert calls == ATTEMPTS + 1


async def test_retries_past_the_cap_are_not_sent_and_the_answer_names_the_key(
    proxy: ProxyProcess, fake: FakeVendor
) -> None:
    status, headers, body, calls = await failing(proxy, fake, "/small/search")
    assert calls == 2  # of 3 attempts
    assert status == 503 and headers["X-Proxy-Error"] == "call_budget_spent"
    assert "routes.small.max_calls_per_request" in body["detail"]["error"]

"""A latency objective for failover (`fallback.wait_at_most`): while a fallback can answer, the
primary's policies hold no request longer than that (a Retry-After, the limiter's queue), and a
pause the vendor imposed on the route sends the next requests straight to the fallback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from policies.core.clock import ManualClock
from testkit.fakevendor import FakeVendor, Fault
from tests.conftest import route

RETRY = {"attempts": 3, "backoff": {"initial": "10ms", "max": "20ms"}}


def config(vendor: FakeVendor, *, fallback: bool = True, **extra: Any) -> dict[str, Any]:
    routes: dict[str, Any] = {
        "tavily": route(
            f"{vendor.url}/tavily",
            "/tavily",
            search={"vendor": "tavily"},
            retry=RETRY,
            headers={"set": {"Authorization": "Bearer tavily-key"}},
            **({"fallback": {"providers": ["exa", "brave"]}} if fallback else {}),
            **extra,
        )
    }
    for name in ("exa", "brave"):
        routes[name] = route(
            f"{vendor.url}/{name}",
            f"/{name}",
            search={"vendor": name},
            headers={"set": {"Authorization": f"Bearer {name}-key"}},
        )
    return {"routes": routes}


async def search(client: Any, query: str) -> Any:
    return await client.post("/tavily/search", json={"query": query})


async def test_a_vendor_pause_goes_to_the_fallback_now_and_for_as_long_as_it_lasts(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    clock = ManualClock()
    client = await start_proxy(config(vendor), clock=clock)
    vendor.fault_for_key("tavily-key", Fault.status(429, retry_after=2))
    first = await search(client, "storm 0")
    assert first.status == 200 and first.headers["X-Search-Provider"] == "exa"
    assert first.headers["X-Search-Failover"] == "tavily failed: upstream 429"
    assert 2.0 not in clock.sleeps  # nobody waited for the Retry-After
    for i in range(1, 6):
        r = await search(client, f"storm {i}")
        assert r.headers["X-Search-Provider"] == "exa"
        assert r.headers["X-Search-Failover"].startswith("tavily failed: paused by the vendor")
    assert vendor.count("/tavily") == 1  # no call to a vendor that said "not now"
    vendor.fault_for_key("tavily-key", None)
    clock.advance(2.1)  # the pause is over
    back = await search(client, "after the storm")
    assert back.status == 200 and "X-Search-Provider" not in back.headers
    assert vendor.count("/tavily") == 2


def without_fallback(raw: dict[str, Any]) -> None:
    del raw["routes"]["tavily"]["fallback"]


def with_a_longer_objective(raw: dict[str, Any]) -> None:
    raw["routes"]["tavily"]["fallback"]["wait_at_most"] = "3s"


def with_fallbacks_that_have_no_key(raw: dict[str, Any]) -> None:
    for name in ("exa", "brave"):
        raw["routes"][name]["headers"] = {"set": {"Authorization": "Bearer ${UNSET:-}"}}


@pytest.mark.parametrize(
    "change", [without_fallback, with_a_longer_objective, with_fallbacks_that_have_no_key]
)
async def test_the_retry_after_is_waited_out_when_no_fallback_answers_sooner(
    vendor: FakeVendor, start_proxy: Any, change: Callable[[dict[str, Any]], None]
) -> None:
    clock = ManualClock()
    raw = config(vendor)
    change(raw)
    client = await start_proxy(raw, clock=clock, env={})
    vendor.script(Fault.status(429, retry_after=2), path_prefix="/tavily")
    r = await search(client, "one pause")
    assert r.status == 200 and "X-Search-Provider" not in r.headers
    assert 2.0 in clock.sleeps


async def test_a_limiter_queue_longer_than_wait_at_most_goes_to_the_fallback(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    clock = ManualClock()
    client = await start_proxy(config(vendor, rate_limit={"rate": "1/m", "burst": 1}), clock=clock)
    assert "X-Search-Provider" not in (await search(client, "takes the token")).headers
    r = await search(client, "would queue a minute")
    assert r.status == 200 and r.headers["X-Search-Provider"] == "exa"
    assert r.headers["X-Search-Failover"] == "tavily failed: rate_limited"
    assert clock.sleeps == [] and vendor.count("/tavily") == 1


async def test_a_failed_attempt_spends_the_objective_like_a_wait(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    """A 503 that took 300 ms already held the request longer than wait_at_most (250 ms): the
    fallback answers instead of a retry."""
    client = await start_proxy(config(vendor))
    vendor.fault_for_key("tavily-key", Fault.status(503))
    vendor.latency(0.3)
    r = await search(client, "slow failure")
    assert r.status == 200 and r.headers["X-Search-Provider"] == "exa"
    assert r.headers["X-Proxy-Attempts"] == "1" and vendor.count("/tavily") == 1


async def test_a_benched_route_still_answers_from_its_cache_without_a_call(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    clock = ManualClock()
    client = await start_proxy(config(vendor, cache={"ttl": "10m"}), clock=clock)
    cached = await search(client, "asked before the storm")
    assert cached.status == 200 and "X-Search-Provider" not in cached.headers
    vendor.fault_for_key("tavily-key", Fault.status(429, retry_after=30))
    assert (await search(client, "benches the route")).headers["X-Search-Provider"] == "exa"
    calls = vendor.count()
    again = await search(client, "asked before the storm")
    assert again.status == 200 and again.headers["X-Cache"] == "HIT"
    assert "X-Search-Provider" not in again.headers
    assert vendor.count() == calls  # neither the paused vendor nor a fallback was asked
    miss = await search(client, "new while benched")
    assert miss.headers["X-Search-Provider"] == "exa" and vendor.count("/tavily") == 2

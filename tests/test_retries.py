"""Retries end to end: which failures are retried, how long the proxy waits, the deadline and
the budget, counted at the fake vendor."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from multidict import CIMultiDict

from policies.core.clock import ManualClock
from policies.core.errors import UpstreamUnreachable
from policies.core.events import NullEvents
from policies.core.flow import Flow, compose
from policies.retry import Retry
from proxy.config import parse_config
from proxy.forward import Upstream
from proxy.outbound import VendorPool
from testkit.fakevendor import Fault
from tests.conftest import route

RETRY = {
    "attempts": 3,
    "on": [429, "5xx", "timeout", "connect_error", "reset", "malformed"],
    "backoff": {"initial": "10ms", "max": "50ms"},
}


def tavily(vendor, retry=None, timeouts=None, **extra):
    body = route(vendor.url + "/tavily", "/tavily", retry=retry or RETRY, **extra)
    if timeouts:
        body["timeouts"] = timeouts
    return {"routes": {"tavily": body}}


async def search(client, query="retry me"):
    return await client.post("/tavily/search", json={"query": query})


async def test_two_503s_then_success(vendor, start_proxy):
    client = await start_proxy(tavily(vendor))
    vendor.script(Fault.status(503), Fault.status(503))
    r = await search(client)
    assert r.status == 200
    assert (await r.json())["results"]
    assert vendor.count() == 3
    assert r.headers["X-Proxy-Attempts"] == "3"
    assert [rec.body for rec in vendor.requests] == [vendor.requests[0].body] * 3  # replayed


async def test_400_and_401_are_never_retried(vendor, start_proxy):
    client = await start_proxy(tavily(vendor))
    for status in (400, 401, 403, 404, 422):
        vendor.reset()
        vendor.script(Fault.status(status))
        r = await search(client)
        assert r.status == status
        assert vendor.count() == 1, status


async def test_vendor_quota_exhaustion_is_terminal(vendor, start_proxy):
    listed = {**RETRY, "on": [429, "5xx", 432]}
    client = await start_proxy(tavily(vendor, retry=listed))
    vendor.script(Fault.status(432))
    r = await search(client)
    assert r.status == 200 and vendor.count() == 2  # no profile, 432 listed: retried
    search_cfg = {"vendor": "tavily", "on_empty": "pass", "loop_guard": "0s"}
    client = await start_proxy(tavily(vendor, retry=listed, search=search_cfg))
    vendor.reset()
    vendor.script(Fault.status(432))
    r = await search(client)
    assert r.status == 432 and vendor.count() == 1  # the Tavily profile: 432 is terminal


async def test_retry_after_is_honoured(vendor, start_proxy):
    clock = ManualClock()
    client = await start_proxy(tavily(vendor), clock=clock)
    vendor.script(Fault.status(429, retry_after=1))
    r = await search(client)
    assert r.status == 200 and vendor.count() == 2
    assert clock.sleeps == [1.0]  # the vendor's Retry-After, not the 10-50 ms backoff


async def test_retry_after_longer_than_max_wait_fails_now(vendor, start_proxy):
    retry = {**RETRY, "retry_after": {"honor": True, "max_wait": "2s"}}
    clock = ManualClock()
    client = await start_proxy(tavily(vendor, retry=retry), clock=clock)
    vendor.script(Fault.status(429, retry_after=30))
    r = await search(client)
    assert clock.sleeps == []  # failed at once, without waiting
    assert r.status == 429
    err = (await r.json())["error"]
    assert err["type"] == "upstream_rate_limited"
    assert err["retry_after_s"] == 30 and err["upstream_status"] == 429
    assert r.headers["Retry-After"] == "30"
    assert vendor.count() == 1


async def test_hanging_vendor_times_out_then_next_attempt_succeeds(vendor, start_proxy):
    timeouts = {"connect": "1s", "per_try": "200ms", "total": "3s"}
    client = await start_proxy(tavily(vendor, timeouts=timeouts))
    vendor.script(Fault.hang(5))
    r = await search(client)
    assert r.status == 200 and r.headers["X-Proxy-Attempts"] == "2"
    assert vendor.count() == 2
    # The first attempt timed out while the vendor was still in its 5 s hang.
    (hang,) = vendor.pauses
    assert hang.cause == "hang" and hang.ended != "slept"
    text = await (await client.get("/metrics")).text()
    assert 'search_proxy_upstream_attempts_total{outcome="timeout",route="tavily"} 1.0' in text


async def test_attempt_that_cannot_finish_before_deadline_is_not_started(vendor, start_proxy):
    timeouts = {"connect": "1s", "per_try": "500ms", "total": "1s"}
    clock = ManualClock()
    client = await start_proxy(tavily(vendor, timeouts=timeouts), clock=clock)
    vendor.script(Fault.status(503, retry_after=2))  # waiting 2s would pass the 1s deadline
    r = await search(client)
    assert clock.sleeps == []  # no sleeping past the deadline
    assert r.status == 503
    assert vendor.count() == 1


async def test_connection_reset_on_post_is_retried(vendor, start_proxy):
    client = await start_proxy(tavily(vendor))
    vendor.script(Fault.reset())
    r = await search(client)
    assert r.status == 200
    assert vendor.count() == 2


async def test_malformed_body_is_retried_and_finally_a_502(vendor, start_proxy):
    search_cfg = {"vendor": "tavily", "on_empty": "pass"}
    client = await start_proxy(tavily(vendor, search=search_cfg))
    vendor.script(Fault.malformed())
    r = await search(client)
    assert r.status == 200 and vendor.count() == 2
    vendor.reset()
    vendor.set_default(Fault.malformed())
    r = await search(client)
    assert r.status == 502
    body = await r.json()
    err = body["search_proxy"]  # the proxy's fields beside Tavily's own error shape
    assert body["detail"]["error"] == err["message"]
    assert err["type"] == "upstream_malformed" and err["attempts"] == 3
    assert vendor.count() == 3


async def test_exhausted_retries_pass_the_vendor_answer_through(vendor, start_proxy):
    client = await start_proxy(tavily(vendor))
    vendor.set_default(Fault.status(503))
    r = await search(client)
    assert r.status == 503
    assert r.headers["X-Proxy-Attempts"] == "3"
    assert "detail" in await r.json()  # the vendor's own body


async def test_budget_stops_retries_during_an_outage(vendor, start_proxy):
    retry = {**RETRY, "budget": {"ratio": 0.0, "min_per_s": 2}}
    client = await start_proxy(tavily(vendor, retry=retry))
    vendor.set_default(Fault.status(503))
    for _ in range(20):
        assert (await search(client)).status == 503
    # Without a budget: 60 vendor calls. With ratio 0, only the floor of 2 retries a second.
    assert vendor.count() <= 20 + 2 * 2
    metrics = await (await client.get("/metrics")).text()
    exhausted = [
        line
        for line in metrics.splitlines()
        if line.startswith('search_proxy_retry_budget_exhausted_total{route="tavily"}')
    ]
    assert exhausted and float(exhausted[0].split()[-1]) >= 15


async def test_attempt_and_retry_metrics(vendor, start_proxy):
    client = await start_proxy(tavily(vendor))
    vendor.script(Fault.status(503), Fault.status(429))
    assert (await search(client)).status == 200
    text = await (await client.get("/metrics")).text()
    assert 'search_proxy_retries_total{reason="5xx",route="tavily"} 1.0' in text
    assert 'search_proxy_retries_total{reason="429",route="tavily"} 1.0' in text
    assert 'search_proxy_upstream_attempts_total{outcome="ok",route="tavily"} 1.0' in text


async def test_methods_not_listed_are_not_retried(vendor, start_proxy):
    client = await start_proxy(tavily(vendor, retry={**RETRY, "methods": ["GET"]}))
    vendor.script(Fault.status(503))
    r = await search(client)
    assert r.status == 503 and vendor.count() == 1


async def _no_such_host(host: str, port: int) -> list[Any]:
    """A resolver that knows no host, as DNS answers for a mistyped upstream."""
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


async def test_a_host_that_does_not_resolve_is_not_retried_and_says_why():
    config = parse_config(
        {
            "routes": {
                "tavily": {
                    "prefix": "/tavily",
                    "upstream": "https://api.tavily.example",
                    "retry": {"attempts": 3, "on": ["5xx", "connect_error"]},
                }
            }
        },
        {},
    )
    cfg = config.routes["tavily"]
    assert cfg.section("retry") is not None
    clock = ManualClock()
    vendors = VendorPool(8, 8, 15.0, resolve=_no_such_host)
    try:
        retry = Retry("tavily", cfg.section("retry"), per_try=1.0, clock=clock, events=NullEvents())
        handler = compose([retry], Upstream(cfg, vendors, clock))
        flow = Flow.new(
            route="tavily",
            method="POST",
            path="/search",
            query_string="",
            headers=CIMultiDict(),
            body=b"{}",
            request_id="r",
            client="",
            deadline=clock.now() + 10,
            started=clock.now(),
        )
        with pytest.raises(UpstreamUnreachable) as caught:
            await handler(flow)
    finally:
        vendors.close()
    err = caught.value
    assert err.transient is False and flow.trace.attempts == 1 and clock.sleeps == []
    assert err.message.startswith(
        "tavily: the upstream's host name does not resolve (Name or service not known)"
    )
    assert "api.tavily.example" not in err.message  # the route's name says which
    assert "retrying will not help" in err.message

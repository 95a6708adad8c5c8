"""Cross-vendor failover on a vendor's own route: with the primary down (or out of credits) and a
cold cache, the agent's own SDK, pointed at the primary's route, gets another vendor's results
in the primary's answer shape."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from policies.core.clock import ManualClock
from policies.profiles import BUILTIN_PROFILES, SearchResult, extract_results, render_answer
from policies.providers import Answer, all_failed, translated
from proxy.errors import ProvidersExhausted
from testkit.fakevendor import FakeVendor, Fault, expected_urls
from testkit.procs import free_port
from tests.conftest import route
from tests.test_sdks import SDKS

FAST_RETRY = {"attempts": 2, "backoff": {"initial": "10ms", "max": "20ms"}}
QUERY = "failover keeps agents searching"


def failover_config(
    primary: str, upstream: str, vendor: FakeVendor, fallbacks: list[str], **extra: Any
) -> dict[str, Any]:
    """The primary route at `upstream`; each fallback route at the fake vendor, with its own
    configured key."""
    routes: dict[str, Any] = {
        primary: route(
            upstream,
            f"/{primary}",
            search={"vendor": primary},
            retry=FAST_RETRY,
            fallback={"providers": fallbacks, **extra.pop("fallback", {})},
            **extra,
        )
    }
    for name in fallbacks:
        routes[name] = route(
            f"{vendor.url}/{name}",
            f"/{name}",
            search={"vendor": name},
            headers={"set": {"Authorization": f"Bearer {name}-proxy-key"}},
        )
    return {"routes": routes}


PRIMARIES = [pytest.param(sdk, mode, id=f"{sdk.name}-{mode}") for sdk in SDKS for mode in sdk.calls]
PRIMARIES = [p for p in PRIMARIES if p.values[0].name in ("tavily", "exa", "brave")]


@pytest.mark.parametrize(("sdk", "mode"), PRIMARIES)
async def test_sdk_gets_another_vendors_results_when_its_vendor_is_down(
    sdk: Any, mode: str, vendor: FakeVendor, start_proxy: Any
) -> None:
    fallback = "serper" if sdk.name != "serper" else "tavily"
    dead = f"http://127.0.0.1:{free_port()}"
    client = await start_proxy(failover_config(sdk.name, dead, vendor, [fallback]))
    base = str(client.make_url(f"/{sdk.name}"))
    fn = sdk.calls[mode]
    hits = await (fn(base, QUERY, 2) if mode == "async" else asyncio.to_thread(fn, base, QUERY, 2))
    assert [url for url, _, _ in hits] == expected_urls(QUERY, 2)
    assert all(title and snippet for _, title, snippet in hits)
    sent = vendor.last
    assert sent.path == f"/{fallback}/search"
    # The fallback gets its own configured key, never the agent's key for the primary.
    assert sent.headers.get("Authorization") == f"Bearer {fallback}-proxy-key"


async def test_answer_says_where_it_came_from_and_is_not_cached_as_the_primarys(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    raw = failover_config(
        "tavily", dead, vendor, ["exa", "brave"], cache={"ttl": "10m", "stale_ttl": "1h"}
    )
    client = await start_proxy(raw)
    vendor.script(Fault.status(503), Fault.status(503), path_prefix="/exa")
    r = await client.post("/tavily/search", json={"query": QUERY, "max_results": 2})
    assert r.status == 200
    assert r.headers["X-Search-Provider"] == "brave"
    assert r.headers["X-Search-Failover"].startswith("tavily failed: upstream_unreachable")
    body = await r.json()
    assert [x["url"] for x in body["results"]] == expected_urls(QUERY, 2)
    again = await client.post("/tavily/search", json={"query": QUERY, "max_results": 2})
    assert again.headers["X-Search-Provider"] == "brave"
    assert again.headers.get("X-Cache") != "HIT"  # another vendor's answer is not stored
    metrics = await (await client.get("/metrics")).text()
    assert 'search_proxy_failovers_total{provider="exa",result="failed",route="tavily"}' in metrics
    assert 'search_proxy_failovers_total{provider="brave",result="answered",route="tavily"}' in (
        metrics
    )


async def test_a_fallbacks_answer_carries_a_note_naming_who_answered(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    client = await start_proxy(failover_config("tavily", dead, vendor, ["exa"]))
    r = await client.post("/tavily/search", json={"query": QUERY, "max_results": 2})
    assert r.status == 200
    body = await r.json()
    assert body["search_proxy"] == {
        "provider": "exa",
        "why": "tavily failed: upstream_unreachable",
    }
    assert [x["url"] for x in body["results"]] == expected_urls(QUERY, 2)  # as tavily's SDK reads


def test_a_shape_without_room_for_a_field_gets_no_note() -> None:
    listed = dataclasses.replace(BUILTIN_PROFILES["tavily"], results_paths=((),))  # a bare list
    answer = Answer("exa", "results", QUERY, results=(SearchResult("https://a.example", "A", "a"),))
    body = json.loads(translated(listed, answer, 5, "tavily failed").body)
    assert isinstance(body, list) and len(body) == 1


async def test_when_every_fallback_fails_too_the_error_names_each_provider_without_addresses(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    """What the agent (and the LLM behind it) reads: every provider, in the order tried, with
    what it answered, and when to retry; no internal address."""
    port = free_port()
    raw = failover_config("tavily", f"http://127.0.0.1:{port}", vendor, ["exa", "brave"])
    client = await start_proxy(raw)
    vendor.script(Fault.status(503, retry_after=30), path_prefix="/exa")
    vendor.script(Fault.status(502), path_prefix="/brave")
    r = await client.post("/tavily/search", json={"query": QUERY})
    assert r.status == 502 and r.headers["X-Proxy-Error"] == "upstream_unreachable"
    message = (await r.json())["detail"]["error"]  # tavily's own error shape, for its SDK
    assert message == (
        "All 3 providers failed: tavily unreachable after 2 attempts, exa 503 (retry after 30s), "
        "brave 502. Retry in 30s."
    )
    assert "127.0.0.1" not in message and str(port) not in message
    assert r.headers["Retry-After"] == "30"


async def test_a_vendors_own_error_passes_through_saying_its_fallbacks_failed_too(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    raw = failover_config("tavily", f"{vendor.url}/tavily", vendor, ["exa"])
    client = await start_proxy(raw)
    vendor.script(*[Fault.status(503)] * 4, path_prefix="/tavily")
    vendor.script(Fault.status(500), path_prefix="/exa")
    r = await client.post("/tavily/search", json={"query": QUERY})
    assert r.status == 503 and "X-Proxy-Error" not in r.headers  # the vendor's answer
    failed = "tavily failed: upstream 503; its fallbacks too: exa 500"
    assert r.headers["X-Search-Failover"] == failed


def test_the_wait_an_agent_is_told_is_never_zero() -> None:
    parts = [
        Answer("tavily", "skipped", QUERY, reason="circuit open", retry_after_s=0.0),
        Answer("exa", "failed", QUERY, reason="503 (retry after 30s)", retry_after_s=30.0),
    ]
    message, retry_in = all_failed(parts)
    assert message == (
        "All 2 providers failed: tavily circuit open, exa 503 (retry after 30s). Retry in 1s."
    )
    assert retry_in == 1.0
    err = ProvidersExhausted(message, retry_after_s=0.0)
    assert err.response_headers()["Retry-After"] == "1"
    assert "0ms" not in message


async def test_prefer_stale_serves_the_primarys_stale_entry_before_a_fallback(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    clock = ManualClock()
    primary = FakeVendor()
    raw = failover_config(
        "tavily",
        f"{vendor.url}/tavily",
        vendor,
        ["exa"],
        cache={"ttl": "1m", "stale_ttl": "1h"},
        fallback={"prefer": "stale"},
    )
    del primary
    client = await start_proxy(raw, clock=clock)
    first = await client.post("/tavily/search", json={"query": QUERY})
    assert first.status == 200 and "X-Search-Provider" not in first.headers
    clock.advance(120)
    vendor.script(Fault.status(503), Fault.status(503), path_prefix="/tavily")
    r = await client.post("/tavily/search", json={"query": QUERY})
    assert r.headers["X-Cache"] == "STALE" and "X-Search-Provider" not in r.headers
    assert vendor.count("/exa") == 0


async def test_prefer_fresh_asks_a_fallback_before_serving_stale(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    clock = ManualClock()
    raw = failover_config(
        "tavily",
        f"{vendor.url}/tavily",
        vendor,
        ["exa"],
        cache={"ttl": "1m", "stale_ttl": "1h"},
        fallback={"prefer": "fresh"},
    )
    client = await start_proxy(raw, clock=clock)
    await client.post("/tavily/search", json={"query": QUERY})
    clock.advance(120)
    vendor.script(Fault.status(503), Fault.status(503), path_prefix="/tavily")
    r = await client.post("/tavily/search", json={"query": QUERY})
    assert r.headers["X-Search-Provider"] == "exa" and vendor.count("/exa") == 1
    # Fallbacks failing too: the stale entry still answers.
    vendor.set_default(Fault.status(503))
    r = await client.post("/tavily/search", json={"query": QUERY})
    assert r.status == 200 and r.headers["X-Cache"] == "STALE"


async def test_out_of_credits_benches_the_vendor_for_every_replica(
    vendor: FakeVendor, start_proxy: Any, redis_server: Any
) -> None:
    """After the first 432, neither replica calls the primary again until the reset."""
    clock = ManualClock()
    raw = failover_config(
        "tavily",
        f"{vendor.url}/tavily",
        vendor,
        ["exa"],
        headers={"set": {"Authorization": "Bearer operator-key"}},
        fallback={"exhausted_for": "10m"},
    )
    raw["redis"] = {"url": redis_server.url, "key_prefix": "failover-test"}
    a = await start_proxy(raw, clock=clock)
    b = await start_proxy(raw, clock=clock)
    vendor.script(Fault.status(432), path_prefix="/tavily")
    r = await a.post("/tavily/search", json={"query": QUERY})
    assert r.status == 200 and r.headers["X-Search-Provider"] == "exa"
    assert vendor.count("/tavily") == 1
    for client in (a, b, b):
        r = await client.post("/tavily/search", json={"query": f"{QUERY} again"})
        assert r.status == 200 and r.headers["X-Search-Provider"] == "exa"
        assert r.headers["X-Search-Failover"].startswith("tavily failed: plan exhausted")
    assert vendor.count("/tavily") == 1  # no call to the spent plan from either replica
    clock.advance(11 * 60)
    r = await b.post("/tavily/search", json={"query": QUERY})
    assert "X-Search-Provider" not in r.headers and vendor.count("/tavily") == 2


async def test_a_client_error_is_not_failed_over(vendor: FakeVendor, start_proxy: Any) -> None:
    raw = failover_config("tavily", f"{vendor.url}/tavily", vendor, ["exa"])
    raw["routes"]["tavily"]["search"]["max_query_chars"] = 10
    client = await start_proxy(raw)
    r = await client.post("/tavily/search", json={"query": "a query that is far too long"})
    assert r.status == 400 and vendor.count() == 0


@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_every_vendor_reads_back_the_answer_rendered_in_its_shape(name: str) -> None:
    """Each built-in vendor can be a primary: results rendered in its shape are read back by its
    own profile unchanged."""
    profile = BUILTIN_PROFILES[name]
    results = [SearchResult(f"Title {i}", f"https://example.com/{i}", f"Snip {i}") for i in (1, 2)]
    assert extract_results(profile, render_answer(profile, results, "q")) == results


async def test_the_agents_options_reach_the_fallback_in_its_own_fields(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    client = await start_proxy(failover_config("tavily", dead, vendor, ["exa"]))
    ask = {"query": QUERY, "max_results": 2, "include_domains": ["example.com"], "topic": "news"}
    r = await client.post("/tavily/search", json=ask)
    assert r.status == 200 and r.headers["X-Search-Provider"] == "exa"
    sent = vendor.last.json()
    assert sent["numResults"] == 2 and sent["includeDomains"] == ["example.com"]
    assert sent["category"] == "news"
    assert "X-Search-Dropped-Options" not in r.headers


async def test_options_the_fallback_cannot_honour_are_named(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    client = await start_proxy(failover_config("tavily", dead, vendor, ["linkup"]))
    r = await client.post("/tavily/search", json={"query": QUERY, "country": "germany"})
    assert r.status == 200 and r.headers["X-Search-Provider"] == "linkup"
    assert r.headers["X-Search-Dropped-Options"] == "country"
    assert "country" not in vendor.last.json()


async def test_a_fallback_answered_from_its_own_cache_says_so(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    raw = failover_config("tavily", dead, vendor, ["exa"])
    raw["routes"]["exa"]["cache"] = {"ttl": "10m", "stale_ttl": "1h"}
    client = await start_proxy(raw)
    first = await client.post("/tavily/search", json={"query": QUERY, "max_results": 2})
    assert first.headers["Cache-Status"].startswith("search-proxy; fwd=uri-miss")
    second = await client.post("/tavily/search", json={"query": QUERY, "max_results": 2})
    assert second.headers["X-Search-Provider"] == "exa"
    assert second.headers["X-Cache"] == "HIT" and vendor.count("/exa") == 1


async def test_an_agents_own_spent_key_benches_only_that_agent(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    """With the route's configured key left empty, agents bring their own keys: one agent's
    exhausted plan must not send everyone else to a fallback."""
    raw = failover_config(
        "tavily",
        f"{vendor.url}/tavily",
        vendor,
        ["exa"],
        headers={"set": {"Authorization": "Bearer ${TAVILY_API_KEY:-}"}},
    )
    client = await start_proxy(raw, env={})
    vendor.script(Fault.status(432), path_prefix="/tavily")
    spent = {"Authorization": "Bearer spent-key"}
    r = await client.post("/tavily/search", json={"query": QUERY}, headers=spent)
    assert r.headers["X-Search-Provider"] == "exa"
    other = {"Authorization": "Bearer working-key"}
    r = await client.post("/tavily/search", json={"query": QUERY}, headers=other)
    assert r.status == 200 and "X-Search-Provider" not in r.headers
    assert vendor.count("/tavily") == 2


async def test_only_the_search_endpoint_fails_over(vendor: FakeVendor, start_proxy: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    client = await start_proxy(failover_config("exa", dead, vendor, ["tavily"]))
    r = await client.post("/exa/answer", json={"query": QUERY})  # Exa's answer API, not search
    assert r.status == 502 and "X-Search-Provider" not in r.headers
    assert vendor.count("/tavily") == 0


async def test_fallbacks_may_name_each_other_and_are_followed_one_level(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    """tavily and exa fall back to each other: a failing tavily asks exa once, and exa, standing
    in for it, does not ask tavily (or anyone) again."""

    def search_route(name: str, fallback: str) -> dict[str, Any]:
        return route(
            f"{vendor.url}/{name}",
            f"/{name}",
            search={"vendor": name},
            retry=FAST_RETRY,
            fallback={"providers": [fallback]},
        )

    routes = {"tavily": search_route("tavily", "exa"), "exa": search_route("exa", "tavily")}
    client = await start_proxy({"routes": routes})
    vendor.down()
    r = await client.post("/tavily/search", json={"query": QUERY})
    assert r.status == 503
    attempts = FAST_RETRY["attempts"]
    assert vendor.count("/tavily") == attempts and vendor.count("/exa") == attempts
    vendor.up().down(path_prefix="/tavily")
    r = await client.post("/tavily/search", json={"query": QUERY})
    assert r.status == 200 and r.headers["X-Search-Provider"] == "exa"

"""Search-aware recovery end to end: simplified queries on empty results, query validation, the
loop guard, and /v1/search falling back across vendors."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
import structlog

from policies.core.clock import ManualClock
from policies.search import LOOP_GUARD_BYTES, SearchGuard
from policies.simplify import simplify_query
from proxy.state import STATE
from testkit.fakevendor import FakeVendor, Fault, expected_urls
from tests.conftest import route

RETRY = {"attempts": 2, "backoff": {"initial": "10ms", "max": "20ms"}}


def provider(vendor_url: str, name: str, **extra):
    extra.setdefault("search", {"vendor": name})
    extra.setdefault("retry", RETRY)
    return route(f"{vendor_url}/{name}", f"/{name}", **extra)


async def test_empty_results_are_retried_with_simpler_queries(vendor, start_proxy):
    client = await start_proxy({"routes": {"tavily": provider(vendor.url, "tavily")}})
    vendor.empty_when_words_over(3)
    query = 'what is the "best" python web framework in 2024'
    r = await client.post("/tavily/search", json={"query": query, "max_results": 3})
    assert r.status == 200
    used = unquote(r.headers["X-Search-Query-Used"])
    assert len(used.split()) <= 3
    body = await r.json()
    assert [x["url"] for x in body["results"]] == expected_urls(used)
    assert 2 <= vendor.count() <= 4  # the original and at most max_variants (3) variants
    sent = [rec.json()["query"] for rec in vendor.requests]
    assert sent[0] == query and sent[-1] == used
    assert all(rec.json()["max_results"] == 3 for rec in vendor.requests)  # rest unchanged


async def test_empty_results_pass_through_when_nothing_helps(vendor, start_proxy):
    client = await start_proxy({"routes": {"tavily": provider(vendor.url, "tavily")}})
    vendor.set_default(Fault.empty())
    query = "how to configure retries for python web clients quickly"
    r = await client.post("/tavily/search", json={"query": query})
    assert r.status == 200
    assert (await r.json())["results"] == []
    assert "X-Search-Query-Used" not in r.headers
    variants = simplify_query(query, 3)
    assert len(variants) == 3
    assert [rec.json()["query"] for rec in vendor.requests] == [query, *variants]


async def test_brave_query_parameter_is_simplified(vendor, start_proxy):
    client = await start_proxy({"routes": {"brave": provider(vendor.url, "brave")}})
    vendor.empty_when_words_over(3)
    r = await client.get("/brave/res/v1/web/search", params={"q": "rust async runtime comparison"})
    assert r.status == 200
    assert (await r.json())["web"]["results"]
    assert vendor.last.query["q"] == "rust async runtime"
    assert unquote(r.headers["X-Search-Query-Used"]) == "rust async runtime"


async def test_bad_queries_are_refused_without_a_vendor_call(vendor, start_proxy):
    routes = {
        "tavily": provider(vendor.url, "tavily", search={"vendor": "tavily", "max_query_chars": 50})
    }
    client = await start_proxy({"routes": routes})
    for body, needle in (
        ({"query": "   "}, "is empty"),
        ({"query": 42}, "must be text"),
        ({"query": "x" * 51}, "over the limit of 50"),
    ):
        r = await client.post("/tavily/search", json=body)
        assert r.status == 400
        body = await r.json()
        err = body["search_proxy"]
        assert body["detail"]["error"] == err["message"]  # Tavily's shape, for its SDK
        assert err["type"] == "bad_request" and needle in err["message"]
        assert "(query)" in err["message"]
    assert vendor.count() == 0


async def test_loop_guard_replays_a_terminal_failure(vendor, start_proxy):
    client = await start_proxy({"routes": {"tavily": provider(vendor.url, "tavily")}})
    vendor.set_default(Fault.status(401))
    key = {"Authorization": "Bearer bad-key"}
    first = await client.post("/tavily/search", json={"query": "q"}, headers=key)
    assert first.status == 401 and "X-Loop-Guard" not in first.headers
    for _ in range(3):  # an SDK retrying blindly
        again = await client.post("/tavily/search", json={"query": "q"}, headers=key)
        assert again.status == 401
        assert again.headers["X-Loop-Guard"] == "replayed"
        assert await again.json() == await first.json()
    assert vendor.count() == 1
    other = await client.post(
        "/tavily/search", json={"query": "q"}, headers={"Authorization": "Bearer other"}
    )
    assert other.status == 401 and vendor.count() == 2  # another caller is not replayed


@pytest.mark.parametrize(
    ("name", "fault", "send"),
    [  # a terminal status of the vendor's own, and a terminal code on a status that is not
        ("tavily", Fault.status(432), ("POST", "/tavily/search", {"json": {"query": "q"}})),
        (
            "linkup",
            Fault.status(429, error_code="INSUFFICIENT_FUNDS_CREDITS"),
            ("POST", "/linkup/v1/search", {"json": {"q": "q"}}),
        ),
    ],
)
async def test_loop_guard_replays_the_vendors_own_terminal_answers(
    vendor, start_proxy, name, fault, send
):
    client = await start_proxy({"routes": {name: provider(vendor.url, name)}})
    vendor.set_default(fault)
    method, path, kwargs = send
    first = await client.request(method, path, **kwargs)
    assert first.status == fault.code and "X-Loop-Guard" not in first.headers
    again = await client.request(method, path, **kwargs)
    assert again.status == fault.code and again.headers["X-Loop-Guard"] == "replayed"
    assert vendor.count() == 1


async def test_loop_guard_holds_a_bounded_share_of_the_failures_it_replays(vendor, start_proxy):
    """A vendor echoing a bad input into a large error body: the guard keeps the latest within
    LOOP_GUARD_BYTES (it kept 10,000 of any size, past their time, outside the memory budget)."""
    clock = ManualClock()
    client = await start_proxy({"routes": {"tavily": provider(vendor.url, "tavily")}}, clock=clock)
    (guard,) = [p for p in client.app[STATE].routes["tavily"].policies if type(p) is SearchGuard]
    size = LOOP_GUARD_BYTES // 4 + 1  # three fit, four do not
    vendor.set_default(Fault.status(400, {"detail": {"error": "x" * size}}))

    async def ask(i: int) -> str | None:
        r = await client.post("/tavily/search", json={"query": f"bad input {i}"})
        assert r.status == 400 and len(await r.read()) > size
        return r.headers.get("X-Loop-Guard")

    assert [await ask(i) for i in range(6)] == [None] * 6
    assert [await ask(i) for i in (5, 4, 3)] == ["replayed"] * 3 and vendor.count() == 6
    assert await ask(0) is None and vendor.count() == 7  # the oldest were let go
    assert guard._bytes <= LOOP_GUARD_BYTES
    clock.advance(31)  # past loop_guard: all forgotten as the next failure is kept
    assert await ask(1) is None
    assert len(guard._failures) == 1 and guard._bytes < LOOP_GUARD_BYTES // 3


async def test_loop_guard_leaves_a_passing_failure_alone(vendor, start_proxy):
    """A 429 without a terminal code is worth sending again later: it is never replayed."""
    routes = {"linkup": provider(vendor.url, "linkup", retry={"attempts": 1})}
    client = await start_proxy({"routes": routes})
    vendor.set_default(Fault.status(429))
    for _ in range(2):
        r = await client.post("/linkup/v1/search", json={"q": "q"})
        assert r.status == 429 and "X-Loop-Guard" not in r.headers
    assert vendor.count() == 2


async def two_vendors(aiohttp_server):
    first, second = FakeVendor(), FakeVendor()
    urls = []
    for fake in (first, second):
        server = await aiohttp_server(fake.make_app())
        urls.append(str(server.make_url("")).rstrip("/"))
    return first, second, urls


async def test_v1_search_uses_the_first_provider_with_results(aiohttp_server, start_proxy):
    _first, second, (u1, u2) = await two_vendors(aiohttp_server)
    client = await start_proxy(
        {"routes": {"tavily": provider(u1, "tavily"), "brave": provider(u2, "brave")}}
    )
    r = await client.post("/v1/search", json={"query": "circuit breakers", "max_results": 2})
    assert r.status == 200
    body = await r.json()
    assert body["provider"] == "tavily" and body["query_used"] == "circuit breakers"
    assert [x["url"] for x in body["results"]] == expected_urls("circuit breakers", 2)
    assert set(body["results"][0]) == {
        *("title", "url", "snippet", "date", "last_updated"),  # LiteLLM's / Perplexity's
        *("score", "published_date", "position", "provider"),
    }
    assert [a["provider"] for a in body["attempts"]] == ["tavily"]
    assert second.count() == 0


async def test_v1_search_falls_back_when_the_first_provider_is_down(aiohttp_server, start_proxy):
    first, _second, (u1, u2) = await two_vendors(aiohttp_server)
    first.down()
    client = await start_proxy(
        {"routes": {"tavily": provider(u1, "tavily"), "brave": provider(u2, "brave")}}
    )
    r = await client.post("/v1/search", json={"query": "fallback please"})
    assert r.status == 200
    body = await r.json()
    assert body["provider"] == "brave"
    assert [(a["provider"], a["outcome"], a["status"]) for a in body["attempts"]] == [
        ("tavily", "failed", 503),
        ("brave", "results", 200),
    ]
    assert first.count() == 2  # its own route's retries
    providers = await client.post(
        "/v1/search", json={"query": "only brave", "providers": ["brave"]}
    )
    assert (await providers.json())["provider"] == "brave"


async def test_v1_search_moves_on_from_a_cached_empty_answer(aiohttp_server, start_proxy):
    """A hit carries how its answer was read when stored: an empty one is still empty."""
    first, second, (u1, u2) = await two_vendors(aiohttp_server)
    first.set_default(Fault.empty())
    empty_tavily = provider(u1, "tavily", search={"vendor": "tavily", "on_empty": "pass"})
    empty_tavily["cache"] = {"ttl": "10m"}
    client = await start_proxy({"routes": {"tavily": empty_tavily, "brave": provider(u2, "brave")}})
    for _ in range(2):
        r = await client.post("/v1/search", json={"query": "nothing here yet"})
        body = await r.json()
        assert r.status == 200 and body["provider"] == "brave"
        assert [(a["provider"], a["outcome"]) for a in body["attempts"]] == [
            ("tavily", "empty"),
            ("brave", "results"),
        ]
    assert first.count() == 1 and second.count() == 2  # the second empty answer was the cache's


async def test_v1_search_all_providers_failing_says_what_was_tried(aiohttp_server, start_proxy):
    first, second, (u1, u2) = await two_vendors(aiohttp_server)
    first.down()
    second.set_default(Fault.status(429, retry_after=30))
    client = await start_proxy(
        {"routes": {"tavily": provider(u1, "tavily"), "brave": provider(u2, "brave")}}
    )
    r = await client.post("/v1/search", json={"query": "nothing works"})
    assert r.status == 503
    err = (await r.json())["error"]
    assert err["type"] == "all_providers_failed"
    assert err["message"] == (
        "All 2 providers failed: tavily 503, brave 429 (retry after 30s). Retry in 30s."
    )
    assert err["retry_after_s"] == 30 and err["upstream_status"] == 503
    assert r.headers["X-Proxy-Error"] == "all_providers_failed"


async def test_v1_search_providers_refusing_for_good_say_do_not_retry(aiohttp_server, start_proxy):
    """A bad key and an exhausted plan are not outages: the agent is told not to retry, with
    each provider's own words."""
    first, second, (u1, u2) = await two_vendors(aiohttp_server)
    first.set_default(Fault.status(432, {"detail": {"error": "This request exceeds your plan"}}))
    second.set_default(Fault.status(401, {"error": "Invalid API key"}))
    client = await start_proxy(
        {"routes": {"tavily": provider(u1, "tavily"), "exa": provider(u2, "exa")}}
    )
    r = await client.post("/v1/search", json={"query": "out of credits"})
    assert r.status == 502
    err = (await r.json())["error"]
    assert err["type"] == "all_providers_refused"
    assert err["message"] == (
        "All 2 providers refused the request: tavily 432 (This request exceeds your plan), "
        "exa 401 (Invalid API key). Retrying will not help: check each provider's API key and "
        "plan, or send providers that have one."
    )
    assert err["upstream_status"] == 432 and err["retry_after_s"] is None
    assert "Retry-After" not in r.headers
    assert first.count() == 1 and second.count() == 1  # terminal answers are not retried


async def test_v1_search_skips_a_provider_whose_key_is_not_set(aiohttp_server, start_proxy):
    first, _second, (u1, u2) = await two_vendors(aiohttp_server)
    keyed = {"set": {"Authorization": "Bearer ${TAVILY_API_KEY:-}"}}
    client = await start_proxy(
        {
            "routes": {
                "tavily": provider(u1, "tavily", headers=keyed),
                "brave": provider(u2, "brave"),
            }
        },
        env={},
    )
    r = await client.post("/v1/search", json={"query": "keys from the environment"})
    assert r.status == 200
    body = await r.json()
    assert body["provider"] == "brave"
    assert body["attempts"][0]["outcome"] == "skipped" and first.count() == 0
    only = await client.post("/v1/search", json={"query": "keys", "providers": ["tavily"]})
    err = (await only.json())["error"]
    assert only.status == 502 and err["type"] == "all_providers_refused"
    assert (
        "tavily has no API key: TAVILY_API_KEY is not set (routes.tavily.headers.set.Authorization"
        " reads it); export TAVILY_API_KEY before starting the proxy (or, on /v1/search, send"
        " credentials.tavily)"
    ) in err["message"]


async def test_a_key_configured_empty_names_the_header_to_set(aiohttp_server, start_proxy):
    first, _second, (u1, _u2) = await two_vendors(aiohttp_server)
    empty = {"set": {"Authorization": "Bearer "}}  # no variable to name
    client = await start_proxy({"routes": {"tavily": provider(u1, "tavily", headers=empty)}})
    r = await client.post("/v1/search", json={"query": "keys"})
    assert r.status == 502 and first.count() == 0
    assert (
        "tavily has no API key configured (routes.tavily.headers.set.Authorization is empty): "
        "set it (or, on /v1/search, send credentials.tavily)"
    ) in (await r.json())["error"]["message"]


async def test_start_up_warns_once_naming_the_variable_each_keyless_provider_needs(
    aiohttp_server, start_proxy
):
    _first, _second, (u1, u2) = await two_vendors(aiohttp_server)
    routes = {
        "tavily": provider(u1, "tavily", headers={"set": {"Authorization": "Bearer ${TK:-}"}}),
        "brave": provider(u2, "brave", headers={"set": {"X-Subscription-Token": "${BK:-}"}}),
        "exa": provider(u2, "exa", headers={"set": {"x-api-key": "${EK:-}"}}),
        "searxng": provider(u2, "searxng"),  # takes no key: nothing to say
    }
    with structlog.testing.capture_logs() as logs:
        await start_proxy({"routes": routes}, env={"EK": "exa-key"})
    warnings = [e for e in logs if e["event"] == "providers_without_key"]
    assert len(warnings) == 1
    assert warnings[0]["log_level"] == "warning"
    assert warnings[0]["providers"] == {"tavily": "TK", "brave": "BK"}
    assert "export each variable before starting the proxy" in warnings[0]["hint"]

    with structlog.testing.capture_logs() as logs:
        await start_proxy({"routes": routes}, env={"TK": "t", "BK": "b", "EK": "e"})
    assert not [e for e in logs if e["event"] == "providers_without_key"]


async def test_v1_search_answers_other_methods_with_405(aiohttp_server, start_proxy):
    _first, _second, (u1, _u2) = await two_vendors(aiohttp_server)
    client = await start_proxy({"routes": {"tavily": provider(u1, "tavily")}})
    r = await client.get("/v1/search")
    assert r.status == 405 and r.headers["Allow"] == "POST"
    err = (await r.json())["error"]
    assert err["type"] == "method_not_allowed" and "send POST" in err["message"]


async def test_v1_search_filters_and_dedupes(aiohttp_server, start_proxy):
    _first, _, (u1, _) = await two_vendors(aiohttp_server)
    raw = {
        "routes": {"tavily": provider(u1, "tavily")},
        "search_api": {"blocked_domains": ["example.org"], "max_results": 2},
    }
    client = await start_proxy(raw)
    body = await (await client.post("/v1/search", json={"query": "dedupe me"})).json()
    assert len(body["results"]) == 2  # the configured default max_results
    assert all("example.org" not in x["url"] for x in body["results"])


async def test_v1_search_batch_answers_in_order(aiohttp_server, start_proxy):
    first, _, (u1, _) = await two_vendors(aiohttp_server)
    client = await start_proxy({"routes": {"tavily": provider(u1, "tavily")}})
    queries = ["alpha query", "beta query", "gamma query"]
    r = await client.post("/v1/search", json={"queries": queries, "max_results": 1})
    assert r.status == 200
    answers = (await r.json())["responses"]
    assert [a["query"] for a in answers] == queries
    assert [a["results"][0]["url"] for a in answers] == [expected_urls(q, 1)[0] for q in queries]
    assert first.count() == 3


async def test_v1_search_validates_its_body(aiohttp_server, start_proxy):
    first, _, (u1, _) = await two_vendors(aiohttp_server)
    client = await start_proxy({"routes": {"tavily": provider(u1, "tavily")}})
    for body, field in (
        ({"query": ""}, "query"),
        ({"query": "x", "max_results": 0}, "max_results"),
        ({"query": "x", "providers": ["altavista"]}, "providers[0]"),
        ({"queries": "not a list"}, "queries"),
        ({"q": "x"}, "q"),
    ):
        r = await client.post("/v1/search", json=body)
        assert r.status == 400, body
        assert f"/v1/search: {field} " in (await r.json())["error"]["message"]
    assert first.count() == 0


async def test_v1_search_skips_a_provider_whose_breaker_is_open(aiohttp_server, start_proxy):
    first, second, (u1, u2) = await two_vendors(aiohttp_server)
    breaker = {"fail_max": 2, "reset_timeout": "30s"}
    client = await start_proxy(
        {
            "routes": {
                "tavily": provider(u1, "tavily", breaker=breaker),
                "brave": provider(u2, "brave"),
            }
        }
    )
    first.down()
    for _ in range(2):  # two failed searches open tavily's breaker
        assert (await client.post("/tavily/search", json={"query": "trip"})).status == 503
    calls = first.count()
    r = await client.post("/v1/search", json={"query": "skip the broken one"})
    assert r.status == 200
    body = await r.json()
    assert body["provider"] == "brave"
    assert body["attempts"][0]["provider"] == "tavily"
    assert body["attempts"][0]["outcome"] == "skipped"
    assert first.count() == calls  # skipped without a call
    second.down()
    r = await client.post("/v1/search", json={"query": "all broken"})
    err = (await r.json())["error"]
    assert err["message"].startswith("All 2 providers failed: tavily circuit open (retry in ")
    assert err["message"].endswith("brave 503. Retry in 30s.")


async def test_v1_search_reads_retry_after_as_an_http_date(aiohttp_server, start_proxy):
    from email.utils import formatdate

    clock = ManualClock()
    first, _, (u1, _) = await two_vendors(aiohttp_server)
    first.set_default(Fault.status(429, headers={"Retry-After": formatdate(clock.wall() + 60)}))
    retry = {"attempts": 1}
    raw = {"routes": {"tavily": provider(u1, "tavily", retry=retry)}}
    client = await start_proxy(raw, clock=clock)
    r = await client.post("/v1/search", json={"query": "dated"})
    err = (await r.json())["error"]
    assert r.status == 503
    assert err["retry_after_s"] == 60
    assert "tavily 429 (retry after " in err["message"]


async def test_an_empty_configured_key_lets_the_agents_own_key_through(vendor, start_proxy):
    """headers.set with an unset ${VAR:-} sends nothing, so an SDK's own key still works; once
    the variable is set, the configured key replaces the agent's."""
    keyed = {"set": {"Authorization": "Bearer ${TAVILY_API_KEY:-}"}}
    raw = {"routes": {"tavily": provider(vendor.url, "tavily", headers=keyed)}}
    agent = {"Authorization": "Bearer agent-key"}
    client = await start_proxy(raw, env={})
    r = await client.post("/tavily/search", json={"query": "own key"}, headers=agent)
    assert r.status == 200 and vendor.last.headers["Authorization"] == "Bearer agent-key"
    client = await start_proxy(raw, env={"TAVILY_API_KEY": "proxy-key"})
    r = await client.post("/tavily/search", json={"query": "configured key"}, headers=agent)
    assert r.status == 200 and vendor.last.headers["Authorization"] == "Bearer proxy-key"


async def test_a_custom_profile_extending_a_vendor_answers_errors_in_its_shape(vendor, start_proxy):
    raw = {
        "profiles": {"my-tavily": {"extends": "tavily", "max_results_cap": 5}},
        "routes": {
            "tavily": provider(
                vendor.url, "tavily", search={"vendor": "my-tavily", "max_query_chars": 10}
            )
        },
    }
    client = await start_proxy(raw)
    r = await client.post("/tavily/search", json={"query": "far too long a query"})
    body = await r.json()
    assert r.status == 400 and "over the limit of 10" in body["detail"]["error"]


async def test_a_vendor_message_with_control_bytes_still_gets_an_answer(
    aiohttp_server, start_proxy
):
    """The vendor's own words go into the reason phrase: bytes the status line refuses must
    not cost the agent its answer."""
    first, _second, (u1, _u2) = await two_vendors(aiohttp_server)
    first.set_default(Fault.status(401, {"detail": {"error": "bad\u0000key\u001b[31m here"}}))
    client = await start_proxy({"routes": {"tavily": provider(u1, "tavily")}})
    r = await client.post("/v1/search", json={"query": "control bytes"})
    assert r.status == 502
    assert all(" " <= c <= "~" for c in r.reason)
    assert "bad key [31m here" in (await r.json())["error"]["message"]


async def test_a_head_request_on_a_search_route_goes_by_its_status(vendor, start_proxy):
    # A HEAD's answer has no body: read as a search answer, every one was malformed (a 502, a
    # vendor failure counted by the breaker).
    serper = route(
        f"{vendor.url}/serper",
        "/serper",
        search={"vendor": "serper"},
        breaker={"fail_max": 1, "reset_timeout": "1h"},
        retry={"attempts": 2, "on": ["malformed"], "backoff": {"initial": "1ms", "max": "1ms"}},
    )
    client = await start_proxy({"routes": {"serper": serper}})
    for _ in range(3):
        r = await client.head("/serper/search", params={"q": "head"})
        assert r.status == 200 and "X-Proxy-Error" not in r.headers
        assert r.headers["X-Proxy-Attempts"] == "1"
    assert vendor.count() == 3  # the breaker stayed closed: each reached the vendor, once

"""Key pools (`routes.<name>.keys`): several keys of one vendor on one route, a key out of
credits or paused benched on its own (fleet-wide through Redis), failover only once every key is
benched, and keys never shown: metrics and logs name them by a short hash."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import yaml

from policies.core.benched import MAX_BENCHED, REFRESH_S, Benched
from policies.core.clock import ManualClock
from policies.keypool import key_id
from proxy.config import ConfigErrors, parse_config, redacted, secret_values
from proxy.logs import Redactor
from testkit.fakevendor import FakeVendor, Fault, expected_urls
from testkit.waiting import eventually
from tests.conftest import route
from tests.test_breaker_recovery import SteppedClock

KEYS = ["tvly-pool-key-one", "tvly-pool-key-two"]
FAST_RETRY = {"attempts": 2, "backoff": {"initial": "10ms", "max": "20ms"}}


def pool_config(vendor: FakeVendor, keys: list[str] = KEYS, **extra: Any) -> dict[str, Any]:
    """A tavily route holding `keys`, and an exa route (its own key) as its fallback."""
    routes: dict[str, Any] = {
        "tavily": route(
            f"{vendor.url}/tavily",
            "/tavily",
            search={"vendor": "tavily"},
            retry=FAST_RETRY,
            keys=keys,
            **extra,
        ),
        "exa": route(
            f"{vendor.url}/exa",
            "/exa",
            search={"vendor": "exa"},
            headers={"set": {"x-api-key": "exa-proxy-key"}},
        ),
    }
    return {"routes": routes}


def calls_with(vendor: FakeVendor, key: str) -> int:
    return sum(1 for r in vendor.requests if r.headers.get("Authorization") == f"Bearer {key}")


async def search(client: Any, query: str, **headers: str) -> Any:
    return await client.post("/tavily/search", json={"query": query}, headers=headers)


async def test_a_key_out_of_credits_is_called_once_and_every_search_answered(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    vendor.fault_for_key(KEYS[0], Fault.status(432))
    client = await start_proxy(pool_config(vendor))
    for i in range(20):
        r = await search(client, f"pooled search {i}")
        assert r.status == 200, await r.text()
        assert [x["url"] for x in (await r.json())["results"]] == expected_urls(
            f"pooled search {i}", 3
        )
        assert r.headers["X-Proxy-Attempts"] == "1"  # the re-send is the same attempt
    assert calls_with(vendor, KEYS[0]) == 1
    assert calls_with(vendor, KEYS[1]) == 20
    assert vendor.count("/exa") == 0


async def test_two_replicas_share_which_key_is_spent(
    vendor: FakeVendor, start_proxy: Any, redis_server: Any
) -> None:
    vendor.fault_for_key(KEYS[0], Fault.status(432))
    raw = pool_config(vendor)
    raw["redis"] = {"url": redis_server.url, "key_prefix": "keypool-test"}
    replicas = [await start_proxy(raw), await start_proxy(raw)]
    for i in range(20):
        r = await search(replicas[i % 2], f"two replicas {i}")
        assert r.status == 200
    assert calls_with(vendor, KEYS[0]) == 1  # the second replica learnt it from Redis


async def test_every_key_out_of_credits_fails_over_without_calling_them_again(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    for key in KEYS:
        vendor.fault_for_key(key, Fault.status(432))
    client = await start_proxy(pool_config(vendor, fallback={"providers": ["exa"]}))
    for i in range(5):
        r = await search(client, f"spent pool {i}")
        assert r.status == 200 and r.headers["X-Search-Provider"] == "exa"
        why = "upstream 432" if i == 0 else "plan exhausted"
        assert r.headers["X-Search-Failover"].startswith(f"tavily failed: {why}")
    assert vendor.count("/tavily") == 2  # each key once; then straight to the fallback


async def test_every_key_benched_without_a_fallback_is_a_rate_limit_naming_no_key(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    for key in KEYS:
        vendor.fault_for_key(key, Fault.status(432))
    client = await start_proxy(pool_config(vendor))
    r = await search(client, "no fallback")
    assert r.status == 432  # the vendor's own answer, once each key said so
    r = await search(client, "no fallback again")
    assert r.status == 429 and r.headers["X-Proxy-Error"] == "keys_benched"
    body = await r.text()
    assert "every one of the route's 2 API keys is benched (2 out of credits" in body
    assert not any(key in body for key in KEYS)
    assert int(r.headers["Retry-After"]) >= 599  # exhausted_for: 10m without a reset hint
    assert vendor.count("/tavily") == 2
    metrics = await (await client.get("/metrics")).text()
    assert 'search_proxy_keys_benched_total{route="tavily"} 1.0' in metrics


async def test_a_paused_key_is_benched_for_its_retry_after_only(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    clock = ManualClock()
    vendor.fault_for_key(KEYS[0], Fault.status(429, retry_after=2))
    client = await start_proxy(pool_config(vendor), clock=clock)
    for i in range(4):
        assert (await search(client, f"paused {i}")).status == 200
    assert calls_with(vendor, KEYS[0]) == 1
    vendor.fault_for_key(KEYS[0], None)
    clock.advance(2.5)  # the pause is over: the key is in turn again
    for i in range(4):
        assert (await search(client, f"resumed {i}")).status == 200
    assert calls_with(vendor, KEYS[0]) == 3
    metrics = await (await client.get("/metrics")).text()
    one, two = key_id(KEYS[0]), key_id(KEYS[1])
    assert (
        f'search_proxy_key_calls_total{{key="{one}",result="rate_limited",route="tavily"}} 1.0'
        in (metrics)
    )
    assert f'key="{one}",result="used"' in metrics and f'key="{two}",result="used"' in metrics
    assert f'key="{one}",result="rate_limited"' in metrics
    assert not any(key in metrics for key in KEYS)


async def test_requests_spread_over_the_keys(vendor: FakeVendor, start_proxy: Any) -> None:
    client = await start_proxy(pool_config(vendor))
    for i in range(6):
        assert (await search(client, f"spread {i}")).status == 200
    assert calls_with(vendor, KEYS[0]) == calls_with(vendor, KEYS[1]) == 3


async def test_the_pools_key_replaces_the_agents_but_v1_search_credentials_stay(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(pool_config(vendor))
    r = await search(client, "whose key", Authorization="Bearer agent-own-key")
    assert r.status == 200 and vendor.last.headers["Authorization"] == f"Bearer {KEYS[0]}"
    own = {"query": "my key", "providers": ["tavily"], "credentials": {"tavily": "tvly-mine"}}
    r = await client.post("/v1/search", json=own)
    assert r.status == 200 and vendor.last.headers["Authorization"] == "Bearer tvly-mine"
    r = await client.post("/v1/search", json={"query": "the pool's", "providers": ["tavily"]})
    assert r.status == 200 and vendor.last.headers["Authorization"].startswith("Bearer tvly-pool")


async def test_a_pool_whose_keys_are_all_unset_lets_v1_search_skip_it(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    raw = pool_config(vendor, keys=["${TAVILY_KEY_1:-}", "${TAVILY_KEY_2:-}"])
    client = await start_proxy(raw, env={})
    r = await client.post("/v1/search", json={"query": "unset", "providers": ["tavily"]})
    assert r.status == 502 and "has no API key configured" in await r.text()
    assert vendor.count("/tavily") == 0


async def test_serpapi_keys_go_in_its_query_parameter(vendor: FakeVendor, start_proxy: Any) -> None:
    raw = {
        "routes": {
            "serpapi": route(
                f"{vendor.url}/serpapi",
                "/serpapi",
                search={"vendor": "serpapi"},
                keys=["serp-key-one"],
            )
        }
    }
    client = await start_proxy(raw)
    r = await client.get("/serpapi/search.json", params={"q": "pool", "api_key": "agents"})
    assert r.status == 200
    assert vendor.last.query.getall("api_key") == ["serp-key-one"]


async def test_the_breaker_probes_the_vendors_free_call_with_a_pool_key(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    """Tavily's usage call is the default active probe of a route with its own key: an open
    circuit closes a second after the vendor's recovery, and no search is spent on it."""
    clock = SteppedClock()  # the probe loop waits for `advance`, as in real time
    raw = pool_config(vendor, breaker={"fail_max": 1, "reset_timeout": "30s"})
    raw["routes"]["tavily"]["retry"] = {"attempts": 1}
    client = await start_proxy(raw, clock=clock)
    vendor.down(503)
    assert (await search(client, "trip it")).status == 503
    r = await search(client, "while open")
    assert r.status == 503 and r.headers["X-Circuit"] == "open"
    vendor.up()
    searches = vendor.count("/tavily/search")
    clock.advance(1.0)  # the probe's interval: it asks the free call, which answers 200
    await vendor.wait_for_requests(1, "/tavily/usage")
    probe = next(r for r in vendor.requests if r.path == "/tavily/usage")
    assert probe.method == "GET" and probe.headers["Authorization"] in (f"Bearer {k}" for k in KEYS)

    async def answered() -> bool:
        return (await search(client, "after the probe")).status == 200

    await eventually(answered, within=2.0)  # closed 29 s before half-open was due
    assert vendor.count("/tavily/search") == searches + 1  # the probe spent no search


@pytest.mark.parametrize(
    ("keys", "probe"), [(["${UNSET:-}"], None), (KEYS, False)], ids=["no-key", "probe-false"]
)
async def test_no_vendor_probe_without_the_routes_own_key_or_when_turned_off(
    vendor: FakeVendor, start_proxy: Any, keys: list[str], probe: Any
) -> None:
    breaker: dict[str, Any] = {"fail_max": 1, "reset_timeout": "30s"}
    if probe is not None:
        breaker["probe"] = probe
    raw = pool_config(vendor, keys=keys, breaker=breaker)
    raw["routes"]["tavily"]["retry"] = {"attempts": 1}
    # A ManualClock's sleeps return at once: a probe loop would call many times meanwhile.
    client = await start_proxy(raw, clock=ManualClock(), env={})
    vendor.down(503)
    await search(client, "trip it", Authorization="Bearer agents-key")
    r = await search(client, "open", Authorization="Bearer agents-key")
    assert r.headers.get("X-Circuit") == "open"
    await asyncio.sleep(0.05)
    assert vendor.count("/tavily/usage") == 0


# --- config ----------------------------------------------------------------------------------


def test_keys_print_redacted_and_are_secrets_for_the_logs(vendor: FakeVendor) -> None:
    config = parse_config(pool_config(vendor), {})
    shown = yaml.safe_dump(redacted(config))
    assert not any(key in shown for key in KEYS)
    assert redacted(config)["routes"]["tavily"]["keys"] == ["<redacted>#1", "<redacted>#2"]
    assert parse_config(redacted(config), {}).routes["tavily"].section("keys").keys == (
        "<redacted>#1",
        "<redacted>#2",
    )
    assert set(KEYS) <= set(secret_values(config))
    line = Redactor(secret_values(config))(None, "info", {"event": f"oops {KEYS[1]} leaked"})
    assert KEYS[1] not in str(line) and "<redacted>" in line["event"]


@pytest.mark.parametrize(
    ("keys", "extra", "error"),
    [
        (["a-key", "a-key"], {}, "routes.tavily.keys[1]: repeats keys[0]: list each key once"),
        (["two words"], {}, "routes.tavily.keys[0]: expected an API key: one word of text"),
        ("one-key", {}, "routes.tavily.keys: expected a list of API keys"),
        (
            ["a-key"],
            {"headers": {"set": {"Authorization": "Bearer other"}}},
            "routes.tavily.keys: headers.set also sets Authorization, where the keys go",
        ),
    ],
)
def test_bad_keys_are_refused_naming_the_path_never_the_key(
    vendor: FakeVendor, keys: Any, extra: dict[str, Any], error: str
) -> None:
    with pytest.raises(ConfigErrors) as info:
        parse_config(pool_config(vendor, keys=keys, **extra), {})
    assert str(info.value).startswith(error)
    assert "a-key" not in str(info.value)


def test_keys_need_a_vendor_that_takes_one(vendor: FakeVendor) -> None:
    raw = {"routes": {"sx": route(vendor.url, "/sx", search={"vendor": "searxng"}, keys=["k"])}}
    with pytest.raises(ConfigErrors, match=r"routes.sx.keys: searxng takes no API key"):
        parse_config(raw, {})
    raw = {"routes": {"plain": route(vendor.url, "/plain", keys=["k"])}}
    with pytest.raises(ConfigErrors, match=r"routes.plain.keys: needs the route's search section"):
        parse_config(raw, {})


# ---------------------------------------------------------------------------------------------
# What benching holds: one name per caller on a route that passes its agents' own keys


async def test_names_benched_are_bounded_and_let_go_once_past() -> None:
    clock = ManualClock()
    benched = Benched(clock)
    await benched.mark("route|key:0", 600.0, "exhausted")  # the route's own: a configured few
    await benched.mark("route", 3600.0, "spent")
    await benched.mark("route|gone", 1.0, "paused", caller=True)
    await benched.mark("route|again", 60.0, "paused", caller=True)
    clock.advance(2.0)
    for i in range(MAX_BENCHED - 1):  # as many callers' own keys paused by the vendor
        await benched.mark(f"route|caller-{i}", 60.0, "paused", caller=True)
        if i == 1:
            await benched.mark("route|again", 60.0, "paused again", caller=True)  # anew
    assert len(benched._until) == len(benched._why) == MAX_BENCHED
    assert "route|gone" not in benched._until  # past its time: the first to go
    assert await benched.remaining("route|caller-0") == 0.0  # then the caller benched first
    assert await benched.remaining("route|caller-1") == 0.0  # and the next
    assert await benched.remaining("route|again") == 60.0  # benched anew after caller-1 was
    assert benched.why("route|again") == "paused again"
    assert await benched.remaining(f"route|caller-{MAX_BENCHED - 2}") == 60.0
    assert benched.why(f"route|caller-{MAX_BENCHED - 2}") == "paused"
    assert await benched.remaining("route|key:0") == 598.0  # never a configured name
    assert await benched.remaining("route") == 3598.0
    clock.advance(61.0)
    assert await benched.remaining("route|caller-9", caller=True) == 0.0
    assert "route|caller-9" not in benched._until  # past: gone once asked about


async def test_only_the_last_second_of_redis_reads_is_remembered(links: Any) -> None:
    clock = ManualClock()
    benched = Benched(clock, links[0])
    for i in range(50):  # callers whose keys nothing benched: each read from Redis once a second
        assert await benched.remaining(f"route|caller-{i}") == 0.0
    assert len(benched._asked) == 50
    clock.advance(REFRESH_S)
    assert await benched.remaining("route|caller-0") == 0.0
    assert list(benched._asked) == ["route|caller-0"]  # it grew by one per caller, for good
    await Benched(clock, links[1]).mark("route|caller-7", 30.0, "spent")  # another replica
    clock.advance(REFRESH_S)
    assert await benched.remaining("route|caller-7") == 30.0 - REFRESH_S

"""Fresh cache hits answered again to identical requests by the front, without the route's chain
(proxy/replay.py): the same answer a hit gives, counted and logged as a hit, and never when the
chain could answer otherwise (the entry replaced or past fresh, request directives, other
credentials, a guard replaying a failure, a client gate)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import structlog

from policies.core.clock import ManualClock
from proxy.replay import MAX_REPLAY_BYTES, MAX_REPLAYS, PER_REQUEST, Replays
from proxy.state import STATE
from testkit.fakevendor import Fault
from tests.conftest import route
from tests.test_front import Raw, post

CACHE = {"ttl": "10m", "stale_ttl": "1h"}


def cached(vendor: Any, **extra: Any) -> dict[str, Any]:
    extra.setdefault("cache", CACHE)
    extra.setdefault("search", {"vendor": "tavily", "on_empty": "pass"})
    return {"routes": {"tavily": route(vendor.url + "/tavily", "/tavily", **extra)}}


async def search(client: Any, query: str = "replay me", key: str = "Bearer k1", **headers: str):
    return await client.post(
        "/tavily/search", json={"query": query}, headers={"Authorization": key, **headers}
    )


def replays_of(client: Any) -> Replays:
    replays = client.app[STATE].routes["tavily"].replays
    assert replays is not None
    return replays


def remembered(client: Any) -> int:
    return len(replays_of(client)._memo)


def hits(client: Any) -> float:
    registry = client.app[STATE].metrics.registry
    found = registry.get_sample_value(
        "search_proxy_cache_total", {"route": "tavily", "result": "hit"}
    )
    return found or 0.0


def static(headers: Any) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.items() if k.lower() not in PER_REQUEST]


async def test_a_replay_answers_as_the_hit_did_and_counts_as_one(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    miss = await search(client)
    hit = await search(client)  # the chain's hit: remembered as written
    assert hit.headers["X-Cache"] == "HIT" and remembered(client) == 1
    counted = hits(client)
    again = await search(client, **{"X-Request-Id": "agent-7"})
    assert static(again.headers) == static(hit.headers)
    assert await again.read() == await hit.read() == await miss.read()
    assert again.headers["X-Request-Id"] == "agent-7"  # per request, not the hit's
    assert again.headers["Age"] == "0" and again.headers["Cache-Status"].startswith(
        "search-proxy; hit; ttl="
    )
    assert hits(client) == counted + 1
    assert vendor.count() == 1


async def test_a_replay_logs_the_access_line_of_a_hit(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    await search(client)
    with structlog.testing.capture_logs() as logs:
        await search(client)  # the chain
        await search(client)  # the replay
    chain, replay = [e for e in logs if e["event"] == "request"]
    for line in (chain, replay):
        del line["request_id"], line["duration_ms"]
    assert replay == chain and replay["cache"] == "hit"


async def test_age_and_ttl_are_the_entrys_now(vendor, start_proxy):
    clock = ManualClock()
    client = await start_proxy(cached(vendor), clock=clock)
    await search(client)
    await search(client)
    clock.advance(125)
    r = await search(client)
    assert r.headers["Age"] == "125"
    assert r.headers["Cache-Status"] == "search-proxy; hit; ttl=475"
    assert vendor.count() == 1


async def test_an_entry_past_fresh_is_never_replayed(vendor, start_proxy):
    clock = ManualClock()
    client = await start_proxy(cached(vendor), clock=clock)
    await search(client)
    await search(client)
    assert remembered(client) == 1
    clock.advance(11 * 60)  # past the ttl: the chain refreshes it from the vendor
    r = await search(client)
    assert r.headers["X-Cache"] == "MISS" and vendor.count() == 2
    assert remembered(client) == 0


async def test_a_replaced_entry_is_answered_anew(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    await search(client)
    await search(client)
    vendor.script(Fault.status(200, {"results": [{"url": "https://new.example", "title": "n"}]}))
    fresh = await search(client, **{"Cache-Control": "no-cache"})  # refetched and stored
    assert fresh.headers["X-Cache"] == "MISS" and vendor.count() == 2
    r = await search(client)
    assert await r.read() == await fresh.read()  # not the answer remembered before
    assert vendor.count() == 2


@pytest.mark.parametrize("header", ["Cache-Control", "Pragma"])
async def test_request_directives_go_through_the_chain(vendor, start_proxy, header):
    client = await start_proxy(cached(vendor))
    await search(client)
    await search(client)
    r = await search(client, **{header: "no-cache"})
    assert r.headers["X-Cache"] == "MISS" and vendor.count() == 2


async def test_other_credentials_are_other_requests(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    await search(client, key="Bearer alice")
    await search(client, key="Bearer alice")
    r = await search(client, key="Bearer bob")
    assert r.headers["X-Cache"] == "MISS" and vendor.count() == 2


async def test_a_guard_replaying_a_failure_stops_the_replays(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    await search(client)
    await search(client)
    replays = replays_of(client)
    key = next(iter(replays._memo))
    assert replays.find(key) is not None
    vendor.script(Fault.status(401, {"detail": {"error": "Unauthorized: bad key"}}))
    assert (await search(client, query="other", key="Bearer wrong")).status == 401
    assert replays.guard is not None and replays.guard.remembers_failures
    assert replays.find(key) is None  # the chain answers while the guard remembers one
    assert (await search(client)).headers["X-Cache"] == "HIT"  # as the chain decides


async def test_routes_with_a_client_gate_are_never_replayed(vendor, start_proxy):
    raw = cached(vendor)
    token = "3f9c2a7e51b84d06a9e1c7f2b5d8e04a"
    raw["clients"] = {"agent": {"token": token, "daily_requests": 3}}
    client = await start_proxy(raw)
    headers = {"Authorization": f"Bearer {token}"}
    statuses = []
    for _ in range(4):
        r = await client.post("/tavily/search", json={"query": "q"}, headers=headers)
        statuses.append(r.status)
    assert statuses[:3] == [200, 200, 200] and statuses[3] == 429  # every one counted
    assert vendor.count() == 1


async def test_pipelined_identical_requests_are_replayed_in_order(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    body = b'{"query": "pipelined"}'
    raw = await Raw.to(client)
    await raw.send(post("/tavily/search", body, "Authorization: Bearer k1"))
    await raw.send(post("/tavily/search", body, "Authorization: Bearer k1"))
    first, second = await raw.answer(), await raw.answer()
    ids = [f"p{i}" for i in range(5)]
    await raw.send(
        b"".join(post("/tavily/search", body, "Authorization: Bearer k1", f"X-Request-Id: {i}")
                 for i in ids)
    )  # fmt: skip
    answers = [await raw.answer() for _ in ids]
    assert [a[1]["x-request-id"] for a in answers] == ids
    assert all(a[2] == second[2] == first[2] for a in answers)
    assert vendor.count() == 1
    raw.close()


async def test_remembered_requests_are_bounded(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    for i in range(MAX_REPLAYS + 5):
        await search(client, query=f"q{i}")
        await search(client, query=f"q{i}")
    assert remembered(client) == MAX_REPLAYS


async def test_an_agent_not_reading_replays_waits_within_send_timeout(vendor, start_proxy):
    # Replays written to an agent that reads nothing fill its window; the connection is
    # dropped once send_timeout passes, as for any answer.
    raw_cfg = cached(vendor)
    raw_cfg["server"] = {"send_timeout": "300ms"}
    client = await start_proxy(raw_cfg)
    await search(client)
    await search(client)
    raw = await Raw.to(client)
    one = post("/tavily/search", b'{"query": "replay me"}', "Authorization: Bearer k1")
    try:
        async with asyncio.timeout(5):
            while True:  # until the proxy drops the connection
                raw.writer.write(one * 50)
                await raw.writer.drain()
    except (ConnectionError, TimeoutError) as exc:
        assert not isinstance(exc, TimeoutError), "the connection was never dropped"
    finally:
        raw.close()


# ---------------------------------------------------------------------------------------------
# After review: a replay is the only answer its request gets, and answers only what the chain
# would.

AUTH = "Authorization: Bearer k1"
BODY = b'{"query": "replay me"}'


async def primed(client: Any) -> Raw:
    """A connection on which the request has been a miss, then the chain's hit (remembered)."""
    raw = await Raw.to(client)
    for _ in range(2):
        await raw.send(post("/tavily/search", BODY, AUTH))
        await raw.answer()
    assert remembered(client) == 1
    return raw


async def test_a_replay_on_a_closing_connection_runs_no_handler_after_it(vendor, start_proxy):
    client = await start_proxy(cached(vendor))
    raw = await primed(client)
    counted = hits(client)
    with structlog.testing.capture_logs() as logs:
        await raw.send(post("/tavily/search", BODY, AUTH, "Connection: close"))
        status, headers, _ = await raw.answer()
        assert await raw.closed()
        await asyncio.sleep(0)
    assert status == 200 and headers["x-cache"] == "HIT" and headers["connection"] == "close"
    assert [e["cache"] for e in logs if e["event"] == "request"] == ["hit"]  # one line
    assert hits(client) == counted + 1
    guard = client.server.runner.guarded
    assert not guard.in_flight  # no handler left waiting for a body that was the replay's
    registry = client.app[STATE].metrics.registry
    assert registry.get_sample_value("search_proxy_in_flight_requests", {"route": "tavily"}) == 0


async def test_replays_to_an_agent_not_reading_are_each_answered_once_in_order(vendor, start_proxy):
    # Answers large enough that replaying the pipelined requests fills the agent's window: the
    # front waits for it to read before the next, never serves one request twice.
    big = {
        "results": [
            {"url": f"https://e.example/{i}", "title": "t" * 100, "content": "c" * 1500}
            for i in range(60)
        ]
    }
    vendor.script(Fault.status(200, big))
    client = await start_proxy(cached(vendor))
    (await primed(client)).close()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((client.host, client.port))
    raw = Raw(*await asyncio.open_connection(sock=sock))
    ids = [f"r{i}" for i in range(30)]
    await raw.send(b"".join(post("/tavily/search", BODY, AUTH, f"X-Request-Id: {i}") for i in ids))
    await asyncio.sleep(0.3)  # nothing read meanwhile: the replays' writes pause
    answers = [await raw.answer() for _ in ids]
    assert [a[1]["x-request-id"] for a in answers] == ids
    assert {a[1]["x-cache"] for a in answers} == {"HIT"} and vendor.count() == 1
    raw.close()


@pytest.mark.parametrize(
    ("header", "cache"),
    [
        # Naming `authorization` drops the key before the cache keys on it: another request.
        ("Connection: keep-alive, authorization", "MISS"),
        ("Mcp-Session-Id: s1", "BYPASS"),  # one client's session: the cache leaves it alone
    ],
)
async def test_headers_the_cache_reads_its_own_way_go_through_the_chain(
    vendor, start_proxy, header: str, cache: str
):
    client = await start_proxy(cached(vendor))
    await primed(client)
    raw = await Raw.to(client)
    await raw.send(post("/tavily/search", BODY, AUTH, header))
    _, headers, _ = await raw.answer()
    assert headers["x-cache"] == cache and vendor.count() == 2
    raw.close()


@pytest.mark.parametrize("vary", ["X-Forwarded-For", "X-Forwarded-Host", "X-Request-Id"])
async def test_a_cache_varying_on_what_the_proxy_writes_is_never_replayed(
    vendor, start_proxy, vary
):
    client = await start_proxy(cached(vendor, cache={**CACHE, "vary": [vary]}))
    assert client.app[STATE].routes["tavily"].replays is None


async def test_a_request_id_holding_a_secret_is_redacted_as_the_chain_does(vendor, start_proxy):
    secret = "tvly-0123456789abcdef0123"
    client = await start_proxy(
        cached(vendor, headers={"set": {"Authorization": f"Bearer {secret}"}})
    )
    await primed(client)
    raw = await Raw.to(client)
    await raw.send(post("/tavily/search", BODY, AUTH, f"X-Request-Id: {secret}"))
    _, headers, _ = await raw.answer()
    assert secret not in headers["x-request-id"] and headers["x-cache"] == "HIT"
    raw.close()


async def test_remembered_answers_are_bounded_in_bytes(vendor, start_proxy):
    # Answers of ~160 KB: far fewer than MAX_REPLAYS fit the route's byte bound.
    big = {"results": [{"url": "https://e.example", "content": "c" * 160_000}]}
    vendor.script(*[Fault.status(200, big)] * 60)
    client = await start_proxy(cached(vendor))
    for i in range(60):
        await search(client, query=f"big {i}")
        await search(client, query=f"big {i}")
    replays = replays_of(client)
    assert 0 < remembered(client) < 60 and replays._bytes <= MAX_REPLAY_BYTES


async def test_a_failure_the_guard_remembered_stops_replays_only_while_it_is_remembered(
    vendor, start_proxy
):
    clock = ManualClock()
    client = await start_proxy(
        cached(vendor, search={"vendor": "tavily", "on_empty": "pass", "loop_guard": "30s"}),
        clock=clock,
    )
    await search(client)
    await search(client)
    replays = replays_of(client)
    key = next(iter(replays._memo))
    vendor.script(Fault.status(401, {"detail": {"error": "Unauthorized: bad key"}}))
    await search(client, query="other", key="Bearer wrong")
    assert replays.find(key) is None
    clock.advance(31)  # the failure is forgotten: replays answer again (the entry still fresh)
    assert replays.find(key) is not None

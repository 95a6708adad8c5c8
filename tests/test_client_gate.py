"""Who is calling and what it may spend, without a server: the client gate (tokens where each
vendor's SDK sends its key, scrubbed before the vendor), the daily quota with its in-process and
Redis stores, and the bound on per-client rate-limit buckets under a flood of made-up callers."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time

import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from redis.asyncio import Redis

from policies.core.clock import ManualClock
from policies.core.errors import QuotaExceeded, RateLimited
from policies.core.events import NullEvents
from policies.core.flow import Flow, Reply
from policies.core.redislink import RedisLink
from policies.profiles import BUILTIN_PROFILES
from policies.quota import (
    DAY,
    DailyQuota,
    MemoryQuotas,
    RedisQuotas,
    Usage,
    day_window,
    until_text,
)
from policies.ratelimit import MemoryBuckets, RateLimit, RateLimitConfig
from proxy.clients import ClientGate, is_loopback_host, token_problem, without_param
from proxy.config import ClientConfig, ConfigError, as_document, parse_config, redacted
from proxy.errors import Unauthorized
from proxy.metrics import Metrics
from testkit.redisserver import RedisServer

A_TOKEN = "agent-a-7f3c9e1b5d2a8f46"
B_TOKEN = "agent-b-c41d8e2f9a0b7e35"
MIDNIGHT = 1_700_006_400.0  # 2023-11-15T00:00:00Z


class RecordingEvents(NullEvents):
    def __init__(self) -> None:
        self.held: list[int] = []
        self.evicted = 0

    def buckets(self, route: str, held: int, evicted: int) -> None:
        self.held.append(held)
        self.evicted += evicted


def gate(**limits: int) -> ClientGate:
    clients = {
        "agent-a": ClientConfig("agent-a", A_TOKEN, limits.get("agent_a")),
        "agent-b": ClientConfig("agent-b", B_TOKEN),
    }
    quota = DailyQuota(
        {"agent-a": limits["agent_a"]} if "agent_a" in limits else {}, MemoryQuotas(ManualClock())
    )
    return ClientGate(clients, quota, Metrics())


def headers(**values: str) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict({k.replace("_", "-"): v for k, v in values.items()}))


def flow_of(hdrs: CIMultiDictProxy[str], query_string: str = "", client: str = "") -> Flow:
    return Flow.new(
        route="r",
        method="POST",
        path="/search",
        query_string=query_string,
        headers=CIMultiDict(hdrs),
        body=b"{}",
        request_id="rid",
        client=client,
        deadline=60.0,
        started=0.0,
    )


# --- the gate ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vendor", "sent", "query"),
    [
        ("tavily", {"Authorization": f"Bearer {A_TOKEN}"}, ""),  # TavilyClient(api_key=...)
        ("tavily", {"Authorization": f"bearer  {A_TOKEN} "}, ""),  # any case, any spacing
        ("exa", {"x-api-key": A_TOKEN}, ""),  # Exa(api_key=...)
        ("brave", {"X-Subscription-Token": A_TOKEN}, ""),
        ("serper", {"X-API-KEY": A_TOKEN}, ""),
        ("serpapi", {}, f"q=coffee&api_key={A_TOKEN}&engine=google"),  # a query parameter
        ("exa", {"Authorization": f"Bearer {A_TOKEN}"}, ""),  # the bearer form works everywhere
        (None, {"Authorization": f"Bearer {A_TOKEN}"}, ""),  # a route without a profile
    ],
)
def test_the_token_is_found_where_the_vendors_sdk_sends_its_key_and_scrubbed(
    vendor: str | None, sent: dict[str, str], query: str
) -> None:
    profile = BUILTIN_PROFILES[vendor] if vendor else None
    sent_headers = CIMultiDictProxy(CIMultiDict({**sent, "Content-Type": "application/json"}))
    caller = gate().identify(profile, sent_headers, query)
    assert caller.name == "agent-a"
    flow = flow_of(sent_headers, query)
    flow = flow.with_request(caller.scrub(flow.request))
    assert A_TOKEN not in str(dict(flow.request.headers)) + flow.request.query_string
    assert flow.request.headers["Content-Type"] == "application/json"
    if query:
        assert flow.request.query_string == "q=coffee&engine=google"


def test_scrubbing_keeps_the_key_the_route_set_in_the_same_header() -> None:
    sent = headers(Authorization=f"Bearer {A_TOKEN}")
    caller = gate().identify(BUILTIN_PROFILES["tavily"], sent, "")
    flow = flow_of(sent)
    flow.request.headers["Authorization"] = "Bearer tvly-route-key"  # headers.set, applied before
    flow = flow.with_request(caller.scrub(flow.request))
    assert flow.request.headers.getall("Authorization") == ["Bearer tvly-route-key"]


@pytest.mark.parametrize(
    "sent",
    [
        {},
        {"Authorization": "Bearer tvly-a-real-vendor-key"},  # a vendor key is not a client token
        {"Authorization": A_TOKEN},  # no scheme where the SDK sends one
        {"x-api-key": A_TOKEN},  # not where Tavily's SDK sends its key
        {"Authorization": f"Bearer {A_TOKEN[:-1]}"},
    ],
)
def test_without_a_known_token_the_caller_is_refused_and_the_token_never_quoted(
    sent: dict[str, str],
) -> None:
    with pytest.raises(Unauthorized) as caught:
        gate().identify(BUILTIN_PROFILES["tavily"], headers(**sent), "")
    err = caught.value
    assert err.status == 401 and err.headers["WWW-Authenticate"].startswith("Bearer")
    assert "Authorization: Bearer <token>" in err.message
    for value in sent.values():
        assert value not in err.message


def test_weak_placeholder_or_shared_tokens_are_refused_at_start_up() -> None:
    quota = DailyQuota({}, MemoryQuotas(ManualClock()))
    with pytest.raises(ConfigError) as caught:
        ClientGate(
            {
                "a": ClientConfig("a", "change-me"),
                "b": ClientConfig("b", "<redacted>"),
                "c": ClientConfig("c", A_TOKEN),
                "d": ClientConfig("d", A_TOKEN),
            },
            quota,
            Metrics(),
        )
    lines = str(caught.value).splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "clients.a.token",
        "clients.b.token",
        "clients.d.token",
    ]
    assert "is client 'c''s token too" in lines[2]
    assert A_TOKEN not in str(caught.value) and "change-me" not in str(caught.value)


def test_token_rules() -> None:
    assert token_problem(A_TOKEN) is None
    for weak in ("short", "x" * 15, "has spaces in it ok?", "tab\tseparated-0123456", "é" * 20):
        assert token_problem(weak) is not None
    # Long enough, and still guessable: the report's, and their like.
    for weak in (
        "password12345678",  # a word and a number
        "sunshine12345678",
        "aaaaaaaaaaaaaaaaaaaaaaaa",  # one character
        "abababababababab",  # two
        "0123456789abcdef0123",  # a sequence
        "REPLACE_ME_REPLACE_ME",  # a placeholder
        "local-admin-token",  # the compose file's old default
        "Your-Secret-Here-1",
    ):
        problem = token_problem(weak)
        assert problem is not None and problem.endswith("`openssl rand -hex 32`"), weak
        assert weak not in problem
    # Generated ones pass, whatever the generator.
    for _ in range(200):
        for generated in (secrets.token_hex(32), secrets.token_urlsafe(32), secrets.token_hex(12)):
            assert token_problem(generated) is None, generated
    assert is_loopback_host("127.0.0.1") and is_loopback_host("::1")
    assert is_loopback_host("localhost") and is_loopback_host("127.3.4.5")
    assert not any(map(is_loopback_host, ("0.0.0.0", "::", "10.1.2.3", "proxy.local")))
    assert without_param("a=1&api_key=t%2Bk&b=2&api_key=other", "api_key", "t+k") == (
        "a=1&b=2&api_key=other"
    )


def test_clients_config_short_and_long_forms_and_its_mistakes() -> None:
    route = {"prefix": "/t", "upstream": "http://127.0.0.1:9"}
    config = parse_config(
        {
            "clients": {"a": "${A}", "b": {"token": "${B}", "daily_requests": "500"}},
            "routes": {"t": route},
        },
        {"A": A_TOKEN, "B": B_TOKEN},
    )
    assert config.clients["a"] == ClientConfig("a", A_TOKEN, None)
    assert config.clients["b"] == ClientConfig("b", B_TOKEN, 500)
    assert A_TOKEN not in repr(config)
    limited = {**route, "rate_limit": {"rate": "1/s", "burst": 1, "key": "client",
                                        "client_header": "X-Agent"}}  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        parse_config(
            {
                "clients": {"Bad Name": "x", "c": {"token": "x", "daily_requests": 0}, "d": {}},
                "routes": {"t": limited},
            },
            {},
        )
    text = str(caught.value)
    assert "clients.Bad Name: a client name is" in text
    assert "clients.c.daily_requests: expected a whole number >= 1, got 0" in text
    assert "clients.d.token: required key is missing" in text
    assert "routes.t.rate_limit.client_header: with clients configured" in text


def test_the_effective_config_shows_clients_and_never_their_tokens() -> None:
    raw = {
        "clients": {"a": A_TOKEN, "b": {"token": B_TOKEN, "daily_requests": 9}},
        "routes": {"t": {"prefix": "/t", "upstream": "http://127.0.0.1:9"}},
    }
    config = parse_config(raw, {})
    assert parse_config(as_document(config), {}) == config
    shown = redacted(config)
    assert shown["clients"] == {
        "a": {"token": "<redacted>"},
        "b": {"token": "<redacted>", "daily_requests": 9},
    }
    assert A_TOKEN not in str(shown) and B_TOKEN not in str(shown)


# --- the daily quota --------------------------------------------------------------------------


def test_day_window_and_the_wait_an_agent_reads() -> None:
    assert day_window(MIDNIGHT) == (MIDNIGHT // DAY, DAY)
    assert day_window(MIDNIGHT - 1) == (MIDNIGHT // DAY - 1, 1)
    assert [until_text(s) for s in (0.2, 40, 723, 18_720, DAY)] == [
        "1s",
        "40s",
        "12m 3s",
        "5h 12m",
        "24h 0m",
    ]


async def test_quota_refuses_past_the_limit_until_the_utc_day_ends() -> None:
    clock = ManualClock(wall_start=MIDNIGHT - 3600)  # 23:00 UTC
    quota = DailyQuota({"agent-a": 2}, MemoryQuotas(clock))
    assert await quota.spend("agent-a") == Usage(1, 3600)
    assert await quota.spend("agent-a") == Usage(2, 3600)
    clock.advance(1800)
    with pytest.raises(QuotaExceeded) as caught:
        await quota.spend("agent-a")
    err = caught.value
    assert isinstance(err, RateLimited) and err.status == 429 and err.type == "quota_exceeded"
    assert err.retry_after_s == 1800 and err.response_headers()["Retry-After"] == "1800"
    assert err.message == (
        "client 'agent-a' has used its daily quota of 2 requests (search-proxy's quota for this "
        "client, not the vendor's plan); it resets at 00:00 UTC, in 30m 0s; retry then"
    )
    assert await quota.spend("agent-b") is None  # no quota: not even counted
    clock.advance(1800)  # midnight
    assert await quota.spend("agent-a") == Usage(1, DAY)


async def test_replicas_count_one_clients_day_together_through_redis(
    links: tuple[RedisLink, RedisLink], raw
) -> None:
    a, b = (DailyQuota({"agent-a": 3}, RedisQuotas(link, ManualClock())) for link in links)
    assert [(await q.spend("agent-a")).used for q in (a, b, a)] == [1, 2, 3]  # type: ignore[union-attr]
    with pytest.raises(QuotaExceeded) as caught:
        await b.spend("agent-a")
    # Redis's own clock decides the day: the reset is the next UTC midnight by Redis TIME.
    seconds, _ = await raw.time()
    left = (seconds // DAY + 1) * DAY - seconds
    assert caught.value.retry_after_s == pytest.approx(left, abs=2)
    ttl = await raw.ttl("test:quota:agent-a")
    assert 0 < ttl <= left + 1


async def test_while_redis_is_down_the_count_goes_on_from_the_last_shared_one(
    killable_redis: RedisServer,
) -> None:
    link = RedisLink(killable_redis.url, "test", timeout=0.05)
    store = RedisQuotas(link, ManualClock(wall_start=time.time()))
    try:
        assert [(await store.spend("agent-a", 1)).used for _ in range(3)] == [1, 2, 3]
        killable_redis.stop()
        assert (await store.spend("agent-a", 1)).used == 4  # in-process, from 3
        assert not link.up
    finally:
        await link.close()


async def test_what_replicas_counted_while_redis_stalled_is_added_once_when_it_answers(
    killable_redis: RedisServer,
) -> None:
    links = [RedisLink(killable_redis.url, "test", timeout=0.05, retry_interval=0.05) for _ in "ab"]
    a, b = (RedisQuotas(link, ManualClock(wall_start=time.time())) for link in links)
    raw = Redis.from_url(killable_redis.url)
    assert killable_redis.proc is not None
    try:
        # Connect and load the script first: a cold machine's first round trip can pass 50 ms.
        for q, link in zip((a, b), links, strict=True):
            for _ in range(40):
                await q.spend("warm-up", 1)
                if link.up:
                    break
                await asyncio.sleep(0.05)
            assert link.up
        assert [(await q.spend("agent-a", 1)).used for q in (a, b, a)] == [1, 2, 3]
        os.kill(killable_redis.proc.pid, signal.SIGSTOP)  # data kept, commands pile up
        try:
            assert [(await q.spend("agent-a", 1)).used for q in (a, a, b)] == [4, 5, 3]
            await asyncio.sleep(0.3)  # past the deadline the piled-up scripts carry
        finally:
            os.kill(killable_redis.proc.pid, signal.SIGCONT)
        await asyncio.sleep(0.1)  # both links' retry_interval
        # Each replica's next request brings what it counted alone: 3 + 2 + 1 + 1 + 1.
        assert (await a.spend("agent-a", 1)).used == 6
        assert (await b.spend("agent-a", 1)).used == 8
        assert await raw.hget("test:quota:agent-a", "used") == b"8"
    finally:
        await raw.aclose()
        for link in links:
            await link.close()


# --- per-client buckets stay bounded ----------------------------------------------------------


async def test_a_flood_of_100000_made_up_credentials_leaves_the_bucket_count_flat() -> None:
    clock = ManualClock()
    events = RecordingEvents()
    config = RateLimitConfig(rate=1 / 60, burst=1, key="client", max_wait=0.0, max_clients=1000)
    store = MemoryBuckets(
        config.rate, config.burst, clock, max_keys=config.max_clients, route="t", events=events
    )
    policy = RateLimit("t", config, store, clock, NullEvents())
    ok = Reply(200, CIMultiDict())

    async def upstream(flow: Flow) -> Reply:
        return ok

    started = time.monotonic()
    for i in range(100_000):
        flow = flow_of(headers(), client=f"made-up-credential-{i}")
        await policy.handle(flow, upstream)
    assert time.monotonic() - started < 20
    assert len(store) == 1000 and max(events.held) == 1000
    assert events.evicted == 99_000 == store.evicted
    # The most recent callers keep their buckets (and their limits): LRU, not random.
    latest = flow_of(headers(), client="made-up-credential-99999")
    with pytest.raises(RateLimited):
        await policy.handle(latest, upstream)

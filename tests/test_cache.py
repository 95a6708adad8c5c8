"""Tests for the stale-while-error cache: the pure key and freshness rules, the stores, the policy
on a ManualClock, and two replicas sharing entries and fetch locks through a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import orjson
import pytest
from multidict import CIMultiDict
from redis.asyncio import Redis

from policies.cache import (
    CacheConfig,
    Cleared,
    Directives,
    Entry,
    Found,
    Freshness,
    KnownCredentials,
    Lease,
    LockState,
    MemoryStore,
    StaleCache,
    build_store,
    cache_key,
    default_storable,
    entry_from_reply,
    freshness,
    known_credentials,
    request_directives,
)
from policies.cache import entry as entry_module
from policies.cache import key as key_module
from policies.cache.key import (
    MAX_CANONICAL_DEPTH,
    MEMO_BODY_BYTES,
    MEMO_ENTRIES,
    MISSING,
    _canonical,
    _plain_canonical,
)
from policies.core.clock import SYSTEM_CLOCK, Clock, ManualClock
from policies.core.errors import (
    BadRequest,
    CircuitOpen,
    DeadlineExceeded,
    ProxyError,
    RateLimited,
    UpstreamMalformed,
    UpstreamRetryAfterTooLong,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from policies.core.events import NullEvents
from policies.core.flow import Flow, Reply
from policies.core.outcome import Outcome
from policies.core.redislink import RedisLink
from policies.profiles.reading import load_json
from proxy.config import parse_config
from proxy.errors import NotFound, Unauthorized
from testkit.redisserver import RedisServer
from testkit.waiting import eventually

ROUTE = "tavily"
CFG = CacheConfig(ttl=60.0, stale_ttl=600.0)
QUERY = b'{"query": "rust async", "max_results": 5}'
# Odd spacing and an escape: a cached answer must carry these exact bytes, not a re-encoding.
BODY = b'{"results": [ {"title": "caf\\u00e9"} ],\n  "took" :1}'


class RecordingEvents(NullEvents):
    def __init__(self) -> None:
        self.results: list[str] = []
        self.coalesced_count = 0

    def cache(self, route: str, result: str) -> None:
        self.results.append(result)

    def coalesced(self, route: str) -> None:
        self.coalesced_count += 1


Answer = Reply | ProxyError


class Vendor:
    """The end of the chain: gives its answers in order (the last one repeats), counting calls.

    With `gate`, every call waits for it first; with `hang_first`, the first call never ends.
    """

    def __init__(
        self, *answers: Answer, gate: asyncio.Event | None = None, hang_first: bool = False
    ) -> None:
        self.answers = list(answers) or [ok()]
        self.calls = 0
        self.gate = gate
        self.hang_first = hang_first
        self.released = 0
        self.active = 0
        self.peak = 0  # most calls in progress at once

    async def __call__(self, flow: Flow) -> Reply:
        self.calls += 1
        if self.hang_first and self.calls == 1:
            await asyncio.Event().wait()
        self.active += 1
        self.peak = max(self.peak, self.active)
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)  # let a concurrent call start, so `peak` sees overlap
        self.active -= 1
        answer = self.answers[min(self.calls, len(self.answers)) - 1]
        if isinstance(answer, ProxyError):
            raise answer
        return Reply(
            answer.status,
            CIMultiDict(answer.headers),
            answer.body,
            stream=answer.stream,
            release=self._release,
        )

    def _release(self) -> None:
        self.released += 1


def ok(body: bytes = BODY, status: int = 200, **headers: str) -> Reply:
    h = CIMultiDict({"Content-Type": "application/json"})
    h.update({k.replace("_", "-"): v for k, v in headers.items()})
    return Reply(status, h, body)


def failing(status: int) -> Reply:
    return Reply(status, CIMultiDict({"Content-Type": "application/json"}), b'{"error":"x"}')


def make_flow(
    clock: Clock,
    body: bytes = QUERY,
    *,
    method: str = "POST",
    query: str = "",
    headers: dict[str, str] | None = None,
    client: str = "",
    deadline_in: float = 30.0,
) -> Flow:
    return Flow.new(
        route=ROUTE,
        method=method,
        path="/search",
        query_string=query,
        headers=CIMultiDict(headers or {}),
        body=body,
        request_id="req-1",
        client=client,
        deadline=clock.now() + deadline_in,
        started=clock.now(),
    )


def make_cache(
    clock: ManualClock,
    cfg: CacheConfig = CFG,
    events: RecordingEvents | None = None,
    storable: Callable[[Reply], bool] = default_storable,
) -> StaleCache:
    return StaleCache(ROUTE, cfg, build_store(cfg, None, clock), clock, events, storable)


def key(
    body: bytes = b"",
    *,
    query: str = "",
    headers: dict[str, str] | None = None,
    cfg: CacheConfig = CFG,
    method: str = "POST",
    path: str = "/search",
    route: str = ROUTE,
    client: str = "",
    known: KnownCredentials | None = None,
) -> str:
    return cache_key(
        route, method, path, query, body, CIMultiDict(headers or {}), cfg, client,
        known or KnownCredentials(),
    )  # fmt: skip


class RecordingClock:
    """The real clock, keeping every sleep asked of it (a follower's polls, in real time)."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def now(self) -> float:
        return SYSTEM_CLOCK.now()

    def wall(self) -> float:
        return SYSTEM_CLOCK.wall()

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await SYSTEM_CLOCK.sleep(seconds)


# --- the cache key ----------------------------------------------------------------------------


def test_key_is_the_route_and_a_sha256_hex_digest() -> None:
    route, _, digest = key(QUERY).partition(":")
    assert route == ROUTE
    assert len(digest) == 64 and int(digest, 16) >= 0


def test_json_key_order_and_formatting_do_not_change_the_key() -> None:
    assert key(b'{"query":"x","max_results":5}') == key(b'{ "max_results" : 5,\n "query" : "x" }')


def test_nested_key_order_does_not_change_the_key() -> None:
    nested = key(b'{"f":{"a":1,"b":[1,{"y":2,"x":3}]}}')
    assert nested == key(b'{"f":{"b":[1,{"x":3,"y":2}],"a":1}}')


def test_unicode_is_compared_in_nfc() -> None:
    composed = '{"query": "caf\u00e9"}'.encode()
    decomposed = '{"query": "cafe\u0301"}'.encode()
    escaped = b'{"query": "cafe\\u0301"}'
    assert key(composed) == key(decomposed) == key(escaped)


def test_whitespace_runs_in_query_fields_collapse() -> None:
    assert key(b'{"query": "rust async"}') == key(b'{"query": "  rust \\t\\n  async "}')
    assert key(b'{"q": "rust async"}') == key(b'{"q": "rust\\u00a0 async"}')
    assert key(query="q=rust+async") == key(query="q=+rust%20%20async+")


def test_whitespace_in_other_fields_still_counts() -> None:
    assert key(b'{"query": "x", "topic": "a b"}') != key(b'{"query": "x", "topic": "a  b"}')


def test_different_queries_and_values_get_different_keys() -> None:
    assert key(b'{"query": "rust"}') != key(b'{"query": "Rust"}')
    assert key(b'{"query": "x", "max_results": 5}') != key(b'{"query": "x", "max_results": 6}')


def test_ignored_body_fields_do_not_change_the_key() -> None:
    cfg = replace(CFG, ignore_body_fields=("request_id", "user"))
    plain = key(b'{"query": "x"}', cfg=cfg)
    assert key(b'{"query": "x", "request_id": "r-1", "user": "u"}', cfg=cfg) == plain
    assert key(b'{"query": "x", "request_id": "r-2"}', cfg=cfg) == plain
    assert key(b'{"query": "x", "request_id": "r-1"}') != key(b'{"query": "x"}')


def test_the_same_bytes_asked_again_are_keyed_as_the_first_time() -> None:
    # A body's part of the key is remembered by its bytes (a hit sends the same ones again):
    # what it remembers must still depend on everything else that shapes that part.
    body = b'{"query": "again", "sk": "one", "request_id": "r-1"}'
    known = KnownCredentials(params=frozenset({"sk"}))
    ignoring = replace(CFG, ignore_body_fields=("request_id",))
    first = [key(body), key(body, known=known), key(body, cfg=ignoring)]
    assert len(set(first)) == 3  # the credential and the ignored field each change it
    assert [key(body), key(body, known=known), key(body, cfg=ignoring)] == first
    other_key = b'{"query": "again", "sk": "two", "request_id": "r-1"}'
    assert key(other_key, known=known) != first[1]  # a body credential still counts
    assert key(other_key, known=known, cfg=replace(CFG, shared=True)) == key(
        body, known=known, cfg=replace(CFG, shared=True)
    )


def test_a_body_past_the_memos_size_is_keyed_all_the_same() -> None:
    padding = "p" * MEMO_BODY_BYTES
    big = f'{{"query": "x", "padding": "{padding}"}}'.encode()
    assert key(big) == key(big.replace(b", ", b",  "))  # formatting still does not count
    assert key(big) != key(big.replace(b'"x"', b'"y"'))


def test_the_memo_holds_at_most_its_entries() -> None:
    for i in range(MEMO_ENTRIES + 10):
        key(b'{"query": "memo %d"}' % i)
    assert len(key_module._MEMO) == MEMO_ENTRIES


def test_query_parameters_are_sorted_but_repeats_keep_their_order() -> None:
    assert key(query="q=x&count=5") == key(query="count=5&q=x")
    assert key(query="a=1&a=2") != key(query="a=2&a=1")


def test_route_method_and_path_are_part_of_the_key() -> None:
    base = key(QUERY)
    assert key(QUERY, route="serper") != base
    assert key(QUERY, method="PUT") != base
    assert key(QUERY, path="/extract") != base


def test_a_non_json_body_counts_byte_for_byte() -> None:
    assert key(b"q=rust async") == key(b"q=rust async")
    assert key(b"q=rust async") != key(b"q=rust  async")
    assert key(b"not json") != key(b"")


def test_an_invalid_utf8_query_string_does_not_collide_with_another() -> None:
    assert key(query="q=%FF") != key(query="q=%FE")


@pytest.mark.parametrize("depth", [MAX_CANONICAL_DEPTH + 1, 300, 5000, 200_000])
def test_json_nested_past_the_canonical_depth_counts_byte_for_byte(depth: int) -> None:
    body = b'{"query": "x", "a": ' + b"[" * depth + b"]" * depth + b"}"
    assert key(body) == key(body)
    assert key(body) != key(body.replace(b'"x"', b'"y"'))
    assert key(body) != key(body.replace(b", ", b","))  # no canonical form this deep


@pytest.mark.parametrize(
    "body",
    [
        b'{"query": "rust   async", "max_results": 5, "include_domains": ["a.com"]}',
        b'{"q": "  spaced out ", "num": 10}',
        b'{"query": "x", "q": "y  z", "n": null, "f": 1.5, "t": true}',
        b'[1, 2, {"a": "b"}]',
        b'{"nested": {"deep": ["plain", 1]}}',
        b'"just a string"',
        # Each of these the short way refuses and the walk reads (the same either way):
        b'{"query": "caf\\u00e9  au lait"}',
        '{"query": "café  au lait"}'.encode(),
        b'{"outer": {"query": "nested   query"}}',
        b'{"query": ["a  b", "c"]}',
        b'{"field": "q", "query": "x  y"}',
        b'{"query": 5}',
    ],
)
def test_the_short_canonical_form_is_the_walks(body: bytes) -> None:
    short = _plain_canonical(body)
    walked = _canonical(orjson.loads(body))
    assert short is MISSING or short == walked
    if body.isascii() and b"\\u" not in body and b"query" not in body and b'"q"' not in body:
        assert short is not MISSING  # the usual body takes the short way
    assert key(body) == key(orjson.dumps(walked))  # and keys as its canonical form does


@pytest.mark.parametrize(
    "body",
    [
        b'{"query": "rust   async", "api_key": "k", "max_results": 5}',
        b'{"query": "caf\\u00e9  au lait", "token": "t", "n": {"q": "a  b"}}',
        b'{"api_key": "k", "max_results": 5}',
    ],
)
def test_the_key_leaves_the_policies_shared_parse_of_the_body_as_it_was(body: bytes) -> None:
    # The guard and failover parse the body first (load_json); the key reads that parse.
    shared = load_json(body)
    as_parsed = orjson.loads(body)
    first = key(body)
    assert load_json(body) is shared and shared == as_parsed  # credentials, spaces all kept
    assert key(body) == first


def test_json_at_the_canonical_depth_is_still_canonical() -> None:
    depth = MAX_CANONICAL_DEPTH - 1  # the top-level object is the first level
    inner = b"[" * depth + b"]" * depth
    assert key(b'{"query": "x", "a": ' + inner + b"}") == key(b'{"a":' + inner + b',"query":"x"}')


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"headers": {"Authorization": "Bearer a"}}, {"headers": {"Authorization": "Bearer b"}}),
        ({"headers": {"X-API-KEY": "a"}}, {"headers": {"X-API-KEY": "b"}}),
        ({"headers": {"x-api-key": "a"}}, {"headers": {"X-Api-Key": "b"}}),
        ({"headers": {"X-Subscription-Token": "a"}}, {"headers": {"X-Subscription-Token": "b"}}),
        ({"body": b'{"query": "x", "api_key": "a"}'}, {"body": b'{"query": "x", "api_key": "b"}'}),
        ({"query": "q=x&api_key=a"}, {"query": "q=x&api_key=b"}),
        ({"client": "hash-a"}, {"client": "hash-b"}),
        ({}, {"headers": {"Authorization": "Bearer b"}}),
    ],
)
def test_callers_with_different_credentials_never_share_a_key(first: dict, second: dict) -> None:
    assert key(**first) != key(**second)
    shared = replace(CFG, shared=True)
    assert key(**first, cfg=shared) == key(**second, cfg=shared)


def test_the_same_credential_gives_the_same_key() -> None:
    body = b'{"query": "x", "api_key": "a"}'
    assert key(body) == key(b'{"api_key": "a", "query": "x"}')
    assert key(headers={"Authorization": "Bearer a"}) == key(headers={"authorization": "Bearer a"})


def test_credentials_leave_the_body_and_query_part_of_the_key() -> None:
    # Shared: a key in the body or query must not split the cache between callers.
    shared = replace(CFG, shared=True)
    assert key(b'{"query": "x", "api_key": "a"}', cfg=shared) == key(b'{"query": "x"}', cfg=shared)
    assert key(query="q=x&api_key=a", cfg=shared) == key(query="q=x", cfg=shared)


def test_the_credential_never_appears_in_the_key() -> None:
    k = key(b'{"query": "x", "api_key": "tvly-SECRET"}', headers={"Authorization": "Bearer S2"})
    assert "SECRET" not in k and "S2" not in k


@pytest.mark.parametrize(
    "name",
    [
        "X-Goog-Api-Key",
        "Cookie",
        "Ocp-Apim-Subscription-Key",
        "X-Access-Token",
        "Jina-Key",
        "Proxy-Authorization",
        "X-Amz-Security-Token",
    ],
)
def test_every_header_named_like_a_credential_keeps_callers_apart(name: str) -> None:
    assert key(headers={name: "KEY-A"}) != key(headers={name: "KEY-B"})
    assert key(headers={name: "KEY-A"}) == key(headers={name.lower(): "KEY-A"})
    assert key(headers={name: "KEY-A"}) != key()
    shared = replace(CFG, shared=True)
    assert key(headers={name: "KEY-A"}, cfg=shared) == key(headers={name: "KEY-B"}, cfg=shared)


def test_a_header_the_route_knows_carries_a_key_keeps_callers_apart_whatever_its_name() -> None:
    known = KnownCredentials(headers=frozenset({"x-plan"}))
    assert key(headers={"X-Plan": "a"}) == key(headers={"X-Plan": "b"})  # not a credential name
    assert key(headers={"X-Plan": "a"}, known=known) != key(headers={"X-Plan": "b"}, known=known)


def test_the_parameter_a_vendor_reads_its_key_from_leaves_a_shared_key() -> None:
    known = KnownCredentials(params=frozenset({"sk"}))
    shared = replace(CFG, shared=True)
    assert key(query="q=x&sk=a", cfg=shared) != key(query="q=x&sk=b", cfg=shared)
    assert key(query="q=x&sk=a", cfg=shared, known=known) == key(query="q=x", cfg=shared)
    assert key(query="q=x&sk=a", known=known) != key(query="q=x&sk=b", known=known)


def test_parameters_only_named_like_credentials_stay_in_a_shared_key() -> None:
    # `keywords` and `author` match the naming rule, but are search terms: dropping them from a
    # shared key would answer one search with another's results.
    shared = replace(CFG, shared=True)
    assert key(query="q=x&keywords=rust", cfg=shared) != key(query="q=x&keywords=go", cfg=shared)
    assert key(b'{"query": "x", "author": "a"}', cfg=shared) != key(
        b'{"query": "x", "author": "b"}', cfg=shared
    )


def test_an_ignored_body_field_never_takes_a_credential_out_of_the_key() -> None:
    cfg = replace(CFG, ignore_body_fields=("api_key", "token"))
    assert key(b'{"query": "x", "api_key": "a"}', cfg=cfg) != key(
        b'{"query": "x", "api_key": "b"}', cfg=cfg
    )
    assert key(b'{"query": "x", "token": "a"}', cfg=cfg) != key(b'{"query": "x"}', cfg=cfg)


def test_vary_headers_split_entries_even_when_shared() -> None:
    cfg = replace(CFG, shared=True, vary=("X-Tenant",))
    assert key(headers={"X-Tenant": "a"}, cfg=cfg) != key(headers={"X-Tenant": "b"}, cfg=cfg)
    assert key(headers={"x-tenant": "a"}, cfg=cfg) == key(headers={"X-Tenant": "a"}, cfg=cfg)
    assert key(headers={"X-Tenant": "a"}) == key(headers={"X-Tenant": "b"})  # not varied


def test_an_sdk_idempotency_key_does_not_split_the_cache() -> None:
    assert key(headers={"Idempotency-Key": "1"}) == key(headers={"Idempotency-Key": "2"})


def test_a_route_knows_its_set_headers_its_profile_headers_and_its_vendor_key_slot() -> None:
    raw = {
        "routes": {
            "g": {
                "prefix": "/g",
                "upstream": "https://g.example",
                "headers": {"set": {"X-Plan": "pro"}},
                "search": {"vendor": "goog"},
            },
            "s": {"prefix": "/s", "upstream": "https://s.example", "search": {"vendor": "serpapi"}},
        },
        "profiles": {"goog": {"extends": "serper", "search_headers": {"X-Tenant-Id": "t"}}},
    }
    config = parse_config(raw, {})
    g = known_credentials(config.routes["g"], config.profiles["goog"])
    assert g.headers == {"x-plan", "x-tenant-id", "x-api-key"} and not g.params
    s = known_credentials(config.routes["s"], config.profiles["serpapi"])
    assert s.params == {"api_key"} and not s.headers


# --- freshness and directives -----------------------------------------------------------------


def test_freshness_boundaries() -> None:
    clock = ManualClock()
    stored = clock.wall()

    def at(seconds: float) -> tuple[Freshness, float]:
        return freshness(stored, stored + seconds, ttl=10.0, stale_ttl=20.0)

    assert at(0) == (Freshness.FRESH, 0.0)
    assert at(9.999)[0] is Freshness.FRESH
    assert at(10.0) == (Freshness.STALE, 10.0)
    assert at(29.999)[0] is Freshness.STALE
    assert at(30.0) == (Freshness.EXPIRED, 30.0)


def test_an_entry_from_a_clock_slightly_ahead_has_age_zero() -> None:
    assert freshness(1000.5, 1000.0, ttl=10.0, stale_ttl=0.0) == (Freshness.FRESH, 0.0)


def test_zero_stale_ttl_expires_at_ttl() -> None:
    assert freshness(0.0, 10.0, ttl=10.0, stale_ttl=0.0)[0] is Freshness.EXPIRED


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, Directives(no_cache=False, no_store=False)),
        ({"Cache-Control": "no-cache"}, Directives(no_cache=True, no_store=False)),
        ({"Cache-Control": "No-Store"}, Directives(no_cache=False, no_store=True)),
        ({"Cache-Control": "max-age=0"}, Directives(no_cache=True, no_store=False)),
        ({"Cache-Control": "max-age=60"}, Directives(no_cache=False, no_store=False)),
        ({"Cache-Control": 'foo="a,b", no-cache , no-store'}, Directives(True, True)),
        ({"Pragma": "no-cache"}, Directives(no_cache=True, no_store=False)),
        ({"Pragma": "no-cache", "Cache-Control": "max-age=60"}, Directives(False, False)),
    ],
)
def test_request_directives(headers: dict[str, str], expected: Directives) -> None:
    assert request_directives(CIMultiDict(headers)) == expected


# --- entries and the in-process store ---------------------------------------------------------


def test_entry_round_trips_through_bytes() -> None:
    entry = Entry(203, (("Content-Type", "application/json"), ("ETag", '"v1"')), BODY, 1.7e9 + 0.25)
    assert Entry.from_bytes(entry.to_bytes()) == entry
    empty = Entry(204, (), b"", 1.0)
    assert Entry.from_bytes(empty.to_bytes()) == empty


def test_a_hit_carries_what_the_route_read_in_the_answer_when_stored() -> None:
    """So the policies above the cache (failover, /v1/search) do not parse the body again; an
    entry read from Redis carries nothing and is read again, by this replica's profile."""
    for outcome in (Outcome.OK, Outcome.EMPTY):
        answer = Reply(200, CIMultiDict({"Content-Type": "application/json"}), BODY)
        answer.outcome = outcome
        entry = entry_from_reply(answer, 1.0)
        assert entry.reply().outcome is outcome
        assert Entry.from_bytes(entry.to_bytes()).reply().outcome is None


@pytest.mark.parametrize("data", [b"", b"\x01abc", b"\x02" + bytes(14), b"\x01" + bytes(10)])
def test_garbage_is_not_an_entry(data: bytes) -> None:
    with pytest.raises(ValueError):
        Entry.from_bytes(data)


def test_only_headers_worth_replaying_are_kept() -> None:
    reply = ok(
        Set_Cookie="s=1",
        Date="Tue, 14 Nov 2023 22:13:20 GMT",
        Content_Length="52",
        Content_Encoding="gzip",
        Connection="close",
        Transfer_Encoding="chunked",
        X_RateLimit_Remaining="3",
        ETag='"v1"',
    )
    entry = entry_from_reply(reply, 1.0)
    assert entry.headers == (("Content-Type", "application/json"), ("ETag", '"v1"'))
    assert entry.body == BODY


def test_entries_share_the_headers_a_vendor_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    """10,000 entries of one vendor keep one copy of its Content-Type, not 10,000."""
    monkeypatch.setattr(entry_module, "_shared", {})
    first = entry_from_reply(ok(), 1.0)
    second = entry_from_reply(ok(), 2.0)
    assert first.headers == (("Content-Type", "application/json"),)
    assert second.headers is first.headers
    stored = Entry.from_bytes(first.to_bytes())  # an entry read back from Redis too
    assert stored.headers is first.headers
    # An ETag is the answer's own: never shared, and the table does not fill with them.
    tagged = [entry_from_reply(ok(ETag=f'"v{n}"'), 1.0) for n in range(3)]
    assert [e.headers[1] for e in tagged] == [("ETag", f'"v{n}"') for n in range(3)]
    assert entry_module._shared == {first.headers: first.headers}


def test_the_shared_headers_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vendor that sends a new Content-Type every time fills the table once; later sets are
    kept as they come."""
    monkeypatch.setattr(entry_module, "_shared", {})
    made = [
        entry_from_reply(ok(Content_Type=f"application/x-{n}"), 1.0)
        for n in range(entry_module._SHARED_MAX + 5)
    ]
    assert len(entry_module._shared) == entry_module._SHARED_MAX
    late = made[-1].headers
    assert late == (("Content-Type", f"application/x-{entry_module._SHARED_MAX + 4}"),)
    assert entry_from_reply(ok(Content_Type=late[0][1]), 2.0).headers is not late


def test_the_store_counts_entries_with_headers_back_to_zero() -> None:
    """Sizes are read again on removal: every way out gives back what keeping took."""
    clock = ManualClock()
    store = MemoryStore(retain=30.0, max_entries=3, max_bytes=10**6, clock=clock)
    made = [entry_from_reply(ok(b"x" * n, ETag=f'"v{n}"'), clock.wall()) for n in range(5)]
    for n, kept in enumerate(made):
        store.keep(f"t:{n}", kept)  # t:0 and t:1 are evicted
    assert store.nbytes == made[2].size + made[3].size + made[4].size
    store.keep("t:4", made[0])  # replaced
    assert store.nbytes == made[2].size + made[3].size + made[0].size
    clock.advance(30.0)
    assert store.peek("t:2") is None  # past retention
    assert store.nbytes == made[3].size + made[0].size
    for key in ("t:3", "t:4"):
        assert store.peek(key) is None
    assert store.nbytes == 0 and len(store) == 0


def entry(size: int, stored_at: float = 1_700_000_000.0) -> Entry:
    return Entry(200, (), b"x" * size, stored_at)


def test_memory_store_evicts_the_least_recently_used_beyond_max_entries() -> None:
    store = MemoryStore(retain=100.0, max_entries=2, max_bytes=10**9, clock=ManualClock())
    store.keep("t:a", entry(1))
    store.keep("t:b", entry(1))
    assert store.peek("t:a") is not None  # now b is the least recently used
    store.keep("t:c", entry(1))
    assert store.peek("t:b") is None
    assert store.peek("t:a") is not None and store.peek("t:c") is not None
    assert len(store) == 2


def test_memory_store_evicts_beyond_max_bytes() -> None:
    one = entry(1000).size
    store = MemoryStore(retain=100.0, max_entries=100, max_bytes=3 * one, clock=ManualClock())
    for name in "abcd":
        store.keep(f"t:{name}", entry(1000))
    assert [store.peek(f"t:{n}") is not None for n in "abcd"] == [False, True, True, True]
    assert store.nbytes == 3 * one
    store.keep("t:big", entry(2000))  # needs two slots' worth
    assert len(store) == 2 and store.nbytes <= 3 * one


def test_memory_store_refuses_an_entry_larger_than_its_byte_bound() -> None:
    store = MemoryStore(retain=100.0, max_entries=100, max_bytes=500, clock=ManualClock())
    store.keep("t:a", entry(10))
    store.keep("t:huge", entry(1000))
    assert store.peek("t:huge") is None and store.peek("t:a") is not None


def test_replacing_an_entry_counts_its_bytes_once() -> None:
    store = MemoryStore(retain=100.0, max_entries=100, max_bytes=10**6, clock=ManualClock())
    store.keep("t:a", entry(100))
    store.keep("t:a", entry(300))
    assert len(store) == 1 and store.nbytes == entry(300).size


def test_memory_store_drops_entries_past_ttl_plus_stale_ttl() -> None:
    clock = ManualClock()
    store = MemoryStore(retain=30.0, max_entries=10, max_bytes=10**6, clock=clock)
    store.keep("t:a", entry(10, stored_at=clock.wall()))
    clock.advance(29.9)
    assert store.peek("t:a") is not None
    clock.advance(0.1)
    assert store.peek("t:a") is None and store.nbytes == 0


async def test_memory_store_clears_only_the_given_route() -> None:
    store = MemoryStore(retain=100.0, max_entries=10, max_bytes=10**6, clock=ManualClock())
    store.keep("tavily:1", entry(1))
    store.keep("tavily:2", entry(1))
    store.keep("tavily-eu:1", entry(1))
    assert await store.clear("tavily") == Cleared(local=2, shared=None)
    assert store.peek("tavily-eu:1") is not None and len(store) == 1


# --- the policy: hit, miss, bypass ------------------------------------------------------------


async def test_a_miss_is_stored_and_the_next_request_is_a_hit_without_a_vendor_call() -> None:
    clock, events = ManualClock(), RecordingEvents()
    cache = make_cache(clock, events=events)
    vendor = Vendor(ok(X_RateLimit_Remaining="3", Date="x"))
    first_flow = make_flow(clock)
    first = await cache.handle(first_flow, vendor)
    assert first.headers["X-Cache"] == "MISS"
    assert first.headers["Cache-Status"] == "search-proxy; fwd=uri-miss; stored"
    assert first_flow.trace.cache == "miss"

    clock.advance(5.4)
    flow = make_flow(clock)
    hit = await cache.handle(flow, vendor)
    assert vendor.calls == 1
    assert hit.status == 200 and hit.body == BODY
    assert hit.headers["X-Cache"] == "HIT"
    assert hit.headers["Age"] == "5"
    assert hit.headers["Cache-Status"] == "search-proxy; hit; ttl=54"
    assert hit.headers["Content-Type"] == "application/json"
    assert "X-RateLimit-Remaining" not in hit.headers and "Date" not in hit.headers
    assert flow.trace.cache == "hit"
    assert events.results == ["store", "miss", "hit"]


async def test_an_entry_is_fresh_until_exactly_ttl() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    vendor = Vendor(ok(b'{"v":1}'), ok(b'{"v":2}'))
    await cache.handle(make_flow(clock), vendor)
    clock.advance(CFG.ttl - 0.001)
    assert (await cache.handle(make_flow(clock), vendor)).body == b'{"v":1}'
    clock.advance(0.001)
    refreshed = await cache.handle(make_flow(clock), vendor)
    assert refreshed.body == b'{"v":2}' and vendor.calls == 2
    assert refreshed.headers["Cache-Status"] == "search-proxy; fwd=stale; stored"
    assert (await cache.handle(make_flow(clock), vendor)).body == b'{"v":2}'


async def test_callers_with_different_keys_do_not_see_each_others_entries() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    vendor = Vendor(ok(b'{"for":"a"}'), ok(b'{"for":"b"}'))
    a = await cache.handle(make_flow(clock, headers={"Authorization": "Bearer a"}), vendor)
    b = await cache.handle(make_flow(clock, headers={"Authorization": "Bearer b"}), vendor)
    assert (a.body, b.body, vendor.calls) == (b'{"for":"a"}', b'{"for":"b"}', 2)


async def test_shared_cache_serves_one_callers_entry_to_another() -> None:
    clock = ManualClock()
    cache = make_cache(clock, cfg=replace(CFG, shared=True))
    vendor = Vendor(ok())
    await cache.handle(make_flow(clock, headers={"Authorization": "Bearer a"}), vendor)
    hit = await cache.handle(make_flow(clock, headers={"Authorization": "Bearer b"}), vendor)
    assert hit.headers["X-Cache"] == "HIT" and vendor.calls == 1


async def test_a_method_outside_the_configured_methods_bypasses_the_cache() -> None:
    clock, events = ManualClock(), RecordingEvents()
    cache = make_cache(clock, cfg=replace(CFG, methods=frozenset({"POST"})), events=events)
    vendor = Vendor(ok())
    for _ in range(2):
        flow = make_flow(clock, method="GET", query="q=x", body=b"")
        reply = await cache.handle(flow, vendor)
        assert reply.headers["X-Cache"] == "BYPASS" and flow.trace.cache == "bypass"
    assert vendor.calls == 2
    assert events.results == ["bypass", "bypass"]


async def test_no_store_neither_reads_nor_writes() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    vendor = Vendor(ok(b'{"v":1}'), ok(b'{"v":2}'), ok(b'{"v":3}'))
    no_store = {"Cache-Control": "no-store"}
    assert (await cache.handle(make_flow(clock, headers=no_store), vendor)).body == b'{"v":1}'
    # Nothing was written: a plain request misses and stores v2.
    assert (await cache.handle(make_flow(clock), vendor)).body == b'{"v":2}'
    # Nothing is read: a fresh v2 is there, yet no-store goes to the vendor.
    assert (await cache.handle(make_flow(clock, headers=no_store), vendor)).body == b'{"v":3}'
    assert (await cache.handle(make_flow(clock), vendor)).body == b'{"v":2}'
    assert vendor.calls == 3


async def test_no_cache_skips_the_fresh_hit_but_stores_the_new_answer() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    vendor = Vendor(ok(b'{"v":1}'), ok(b'{"v":2}'))
    await cache.handle(make_flow(clock), vendor)
    flow = make_flow(clock, headers={"Cache-Control": "no-cache"})
    reply = await cache.handle(flow, vendor)
    assert reply.body == b'{"v":2}' and vendor.calls == 2
    assert reply.headers["Cache-Status"] == "search-proxy; fwd=request; stored"
    assert (await cache.handle(make_flow(clock), vendor)).body == b'{"v":2}'


async def test_no_cache_still_falls_back_to_the_entry_when_the_vendor_fails() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    await cache.handle(make_flow(clock), Vendor(ok()))
    flow = make_flow(clock, headers={"Cache-Control": "no-cache"})
    reply = await cache.handle(flow, Vendor(failing(503)))
    assert (
        reply.body == BODY and reply.headers["X-Cache"] == "STALE" and flow.trace.cache == "stale"
    )


# --- what is never stored ---------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 500, 502, 503, 400, 404])
async def test_error_replies_are_never_stored(status: int) -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    vendor = Vendor(failing(status), ok())
    first = await cache.handle(make_flow(clock), vendor)
    assert first.status == status and first.headers["X-Cache"] == "MISS"
    assert "stored" not in first.headers["Cache-Status"]
    second = await cache.handle(make_flow(clock), vendor)
    assert second.status == 200 and vendor.calls == 2


async def test_an_unparseable_json_body_is_not_stored_but_other_types_are_not_parsed() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    broken = Vendor(ok(b'{"results": ['))
    await cache.handle(make_flow(clock), broken)
    await cache.handle(make_flow(clock), broken)
    assert broken.calls == 2
    text = Vendor(ok(b"plain {", Content_Type="text/plain"))
    await cache.handle(make_flow(clock, body=b'{"query": "other"}'), text)
    await cache.handle(make_flow(clock, body=b'{"query": "other"}'), text)
    assert text.calls == 1


async def test_the_route_can_declare_a_2xx_body_unusable() -> None:
    clock, seen = ManualClock(), []

    def storable(reply: Reply) -> bool:
        seen.append(reply.body)
        return b"results" in reply.body

    cache = make_cache(clock, storable=storable)
    vendor = Vendor(ok(b'{"answer": null}'))
    await cache.handle(make_flow(clock), vendor)
    await cache.handle(make_flow(clock), vendor)
    assert vendor.calls == 2 and seen == [b'{"answer": null}'] * 2


async def test_a_body_over_max_entry_bytes_is_not_stored() -> None:
    clock = ManualClock()
    cache = make_cache(clock, cfg=replace(CFG, max_entry_bytes=len(BODY) - 1))
    vendor = Vendor(ok())
    first = await cache.handle(make_flow(clock), vendor)
    await cache.handle(make_flow(clock), vendor)
    assert vendor.calls == 2 and first.body == BODY


async def test_a_streamed_reply_is_passed_through_and_never_stored_or_inspected() -> None:
    clock, seen = ManualClock(), []

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"

    streamed = Reply(200, CIMultiDict({"Content-Type": "text/event-stream"}), stream=chunks())
    cache = make_cache(clock, storable=lambda r: seen.append(r) or True)
    vendor = Vendor(streamed)
    first = await cache.handle(make_flow(clock), vendor)
    await cache.handle(make_flow(clock), vendor)
    assert first.stream is streamed.stream
    assert vendor.calls == 2 and seen == []


# --- stale while error ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "how", "detail"),
    [
        (failing(500), "fwd=stale; fwd-status=500", "upstream_error"),
        (failing(503), "fwd=stale; fwd-status=503", "upstream_error"),
        (failing(429), "fwd=stale; fwd-status=429", "upstream_rate_limited"),
        # Nothing was forwarded: RFC 9211 calls serving the stored entry a hit.
        (CircuitOpen("tavily: circuit open; retry in 27s", route=ROUTE), "hit", "circuit_open"),
        (RateLimited("tavily: rate limited"), "hit", "rate_limited"),
        # Forwarded, and no status came back.
        (UpstreamTimeout("tavily: timed out"), "fwd=stale", "upstream_timeout"),
        (DeadlineExceeded("tavily: out of time"), "fwd=stale", "deadline_exceeded"),
        (UpstreamUnreachable("tavily: refused"), "fwd=stale", "upstream_unreachable"),
        (
            UpstreamMalformed("tavily: bad body", upstream_status=200),
            "fwd=stale; fwd-status=200",
            "upstream_malformed",
        ),
        (
            UpstreamRetryAfterTooLong("wait 1h", upstream_status=429),
            "fwd=stale; fwd-status=429",
            "upstream_rate_limited",
        ),
    ],
)
async def test_a_failing_vendor_gets_the_stale_entry_after_ttl(
    failure: Answer, how: str, detail: str
) -> None:
    clock, events = ManualClock(), RecordingEvents()
    cache = make_cache(clock, events=events)
    await cache.handle(make_flow(clock), Vendor(ok()))
    clock.advance(CFG.ttl + 30)
    flow = make_flow(clock)
    vendor = Vendor(failure)
    reply = await cache.handle(flow, vendor)
    assert vendor.calls == 1
    assert (reply.status, reply.body) == (200, BODY)
    assert reply.headers["X-Cache"] == "STALE"
    assert reply.headers["Age"] == "90"
    assert reply.headers["Cache-Status"] == f"search-proxy; {how}; ttl=-30; detail={detail}"
    assert "Warning" not in reply.headers
    assert flow.trace.cache == "stale" and events.results[-1] == "stale"
    if isinstance(failure, Reply):
        assert vendor.released == 1  # the failed reply's connection is given back


async def test_an_expired_entry_is_not_served() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    await cache.handle(make_flow(clock), Vendor(ok()))
    clock.advance(CFG.ttl + CFG.stale_ttl)
    reply = await cache.handle(make_flow(clock), Vendor(failing(503)))
    assert reply.status == 503 and reply.body == b'{"error":"x"}'
    assert reply.headers["Cache-Status"] == "search-proxy; fwd=uri-miss; fwd-status=503"
    with pytest.raises(CircuitOpen):
        await cache.handle(make_flow(clock), Vendor(CircuitOpen("open")))


async def test_without_an_entry_the_failure_reaches_the_agent() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    error = UpstreamTimeout("tavily: timed out after 10s")
    with pytest.raises(UpstreamTimeout) as raised:
        await cache.handle(make_flow(clock), Vendor(error))
    assert raised.value is error


async def test_the_stale_window_is_checked_again_after_a_slow_vendor_call() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    await cache.handle(make_flow(clock), Vendor(ok()))
    clock.advance(CFG.ttl + CFG.stale_ttl - 1)

    async def slow_failure(flow: Flow) -> Reply:
        clock.advance(2)
        raise UpstreamTimeout("tavily: timed out")

    with pytest.raises(UpstreamTimeout):
        await cache.handle(make_flow(clock), slow_failure)


@pytest.mark.parametrize(
    "failure",
    [BadRequest("bad"), Unauthorized("who"), NotFound("no route"), failing(400), failing(404)],
)
async def test_client_errors_are_not_hidden_behind_stale_data(failure: Answer) -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    await cache.handle(make_flow(clock), Vendor(ok()))
    clock.advance(CFG.ttl + 1)
    if isinstance(failure, ProxyError):
        with pytest.raises(type(failure)):
            await cache.handle(make_flow(clock), Vendor(failure))
    else:
        reply = await cache.handle(make_flow(clock), Vendor(failure))
        assert reply.status == failure.status and reply.headers["X-Cache"] == "MISS"


@pytest.mark.parametrize("header", ["Mcp-Session-Id", "Set-Cookie"])
async def test_an_answer_that_opens_a_session_is_never_stored(header: str) -> None:
    """Like nginx's and Varnish's caches: the next caller would get a session not its own."""
    clock, events = ManualClock(), RecordingEvents()
    cache = make_cache(clock, events=events)
    vendor = Vendor(ok(**{header.replace("-", "_"): "s-1"}))
    for _ in range(2):
        reply = await cache.handle(make_flow(clock), vendor)
        assert reply.headers[header] == "s-1" and reply.headers["X-Cache"] == "MISS"
    assert vendor.calls == 2 and "store" not in events.results


INITIALIZE = b'{"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {}}'


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (INITIALIZE, {}),
        (b"[" + INITIALIZE + b"]", {}),  # a batch
        (b'{"jsonrpc":"2.0","method":"notifications/initialized"}', {}),
        (QUERY, {"Mcp-Session-Id": "s-1"}),
    ],
)
async def test_session_traffic_on_a_plain_route_is_neither_read_stored_nor_coalesced(
    body: bytes, headers: dict[str, str]
) -> None:
    clock, events = ManualClock(), RecordingEvents()
    cache = make_cache(clock, events=events)
    gate = asyncio.Event()
    vendor = Vendor(ok(body=b'{"jsonrpc":"2.0","id":0,"result":{}}'), gate=gate)
    pending = [
        asyncio.create_task(cache.handle(make_flow(clock, body, headers=headers), vendor))
        for _ in range(2)
    ]
    await eventually(lambda: vendor.active == 2)  # both reached the vendor: not coalesced
    gate.set()
    replies = await asyncio.gather(*pending)
    assert all(r.headers["X-Cache"] == "BYPASS" for r in replies)
    await cache.handle(make_flow(clock, body, headers=headers), vendor)
    assert vendor.calls == 3 and events.results == ["bypass"] * 3


async def test_an_mcp_routes_tool_call_with_a_key_of_its_own_is_cached() -> None:
    """The route read the message and gave the key (`key_body`): the cache's to keep."""
    clock = ManualClock()
    cache = make_cache(clock)
    vendor = Vendor()
    call = b'{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"s"}}'
    for request_id in (3, 4):
        flow = make_flow(clock, call.replace(b'"id":3', b'"id":%d' % request_id))
        flow = flow.with_request(replace(flow.request, key_body=b'{"tool":"s"}'))
        await cache.handle(flow, vendor)
    assert vendor.calls == 1


# --- coalescing in one process ----------------------------------------------------------------


async def test_twenty_concurrent_identical_requests_make_one_vendor_call() -> None:
    clock, events = ManualClock(), RecordingEvents()
    cache = make_cache(clock, events=events)
    gate = asyncio.Event()
    vendor = Vendor(ok(), gate=gate)
    flows = [make_flow(clock) for _ in range(20)]
    tasks = [asyncio.create_task(cache.handle(f, vendor)) for f in flows]
    await eventually(lambda: vendor.calls == 1)
    await asyncio.sleep(0)
    gate.set()
    replies = await asyncio.gather(*tasks)
    assert vendor.calls == 1
    assert all(r.body == BODY and r.status == 200 for r in replies)
    assert len({id(r.headers) for r in replies}) == 20  # each got its own copy
    assert [f.trace.cache for f in flows] == ["miss"] * 20
    assert events.coalesced_count == 19
    assert events.results.count("store") == 1 and events.results.count("miss") == 20
    assert (await cache.handle(make_flow(clock), vendor)).headers["X-Cache"] == "HIT"


class _LockKeepingStore(MemoryStore):
    """Keeps locks as the Redis store does. The first lookup is slow and takes the lock; the
    next one finds none to take (its entry looked fresh and went stale meanwhile). Giving the
    lock back is a round trip, held open until `unlocked` is set."""

    keeps_locks = True

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(retain=600, max_entries=100, max_bytes=10**6, clock=clock)
        self.first_lookup = asyncio.Event()
        self.unlocking = asyncio.Event()
        self.unlocked = asyncio.Event()
        self.lookups = 0

    async def lookup(self, key: str, fresh_after: float, ask: Any = None) -> Found:
        self.lookups += 1
        if self.lookups == 1:
            await self.first_lookup.wait()
            return Found(None, Lease(LockState.ACQUIRED, "t"))
        return Found(None)

    async def unlock(self, key: str, token: str) -> None:
        self.unlocking.set()
        await self.unlocked.wait()


async def test_a_follower_whose_leader_ends_while_it_gives_its_lock_back_gets_the_answer() -> None:
    """B's lookup took the lock while A went to the vendor without it. B joins A, then gives
    the lock back; A ends during that round trip. B must still get A's answer (found by the
    diff review: B joined after the await and waited on a future nobody would resolve)."""
    clock = ManualClock()
    store = _LockKeepingStore(clock)
    cache = StaleCache(ROUTE, CFG, store, clock, None)
    gate = asyncio.Event()
    vendor = Vendor(gate=gate)
    b = asyncio.create_task(cache.handle(make_flow(clock), vendor))  # its lookup is under way
    await asyncio.sleep(0.01)
    a = asyncio.create_task(cache.handle(make_flow(clock), vendor))  # A leads
    await eventually(lambda: vendor.calls == 1)
    store.first_lookup.set()  # B finds A in flight and gives its lock back
    await asyncio.wait_for(store.unlocking.wait(), 2)
    gate.set()
    assert (await asyncio.wait_for(a, 2)).status == 200
    store.unlocked.set()
    reply = await asyncio.wait_for(b, 2)
    assert reply.status == 200 and reply.body == BODY and vendor.calls == 1


async def test_concurrent_requests_share_a_failure_too() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    gate = asyncio.Event()
    vendor = Vendor(CircuitOpen("tavily: circuit open"), gate=gate)
    tasks = [asyncio.create_task(cache.handle(make_flow(clock), vendor)) for _ in range(5)]
    await eventually(lambda: vendor.calls == 1)
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert vendor.calls == 1 and all(isinstance(r, CircuitOpen) for r in results)


async def test_a_session_bound_4xx_is_not_shared_when_the_key_leaves_part_of_the_request_out() -> (
    None
):
    """An MCP tool call keys on tool and arguments (`key_body`), not its session: a leader whose
    session is gone (404) must not hand that 404 to a caller whose session is fine."""
    clock = ManualClock()
    cache = make_cache(clock)
    gate = asyncio.Event()
    vendor = Vendor(failing(404), ok(), gate=gate)
    key_body = b'{"tool":"search","arguments":{"query":"q"}}'
    flows = [
        f.with_request(replace(f.request, key_body=key_body))
        for f in (make_flow(clock, headers={"Mcp-Session-Id": s}) for s in ("gone", "alive"))
    ]
    tasks = [asyncio.create_task(cache.handle(f, vendor)) for f in flows]
    await eventually(lambda: vendor.calls == 1)
    gate.set()
    gone, alive = await asyncio.gather(*tasks)
    assert gone.status == 404 and alive.status == 200 and vendor.calls == 2


async def test_different_requests_are_not_coalesced() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    gate = asyncio.Event()
    vendor = Vendor(ok(), gate=gate)
    bodies = [b'{"query": "a"}', b'{"query": "b"}', b'{"query": "c"}']
    tasks = [asyncio.create_task(cache.handle(make_flow(clock, b), vendor)) for b in bodies]
    await eventually(lambda: vendor.calls == 3)
    gate.set()
    await asyncio.gather(*tasks)


async def test_when_the_leader_is_cancelled_a_follower_calls_the_vendor_itself() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    vendor = Vendor(ok(), hang_first=True)
    leader = asyncio.create_task(cache.handle(make_flow(clock), vendor))
    await eventually(lambda: vendor.calls == 1)
    follower = asyncio.create_task(cache.handle(make_flow(clock), vendor))
    await asyncio.sleep(0)
    leader.cancel()
    reply = await asyncio.wait_for(follower, 1.0)
    assert reply.body == BODY and vendor.calls == 2


async def test_a_follower_that_goes_away_leaves_the_leader_and_other_followers_alone() -> None:
    clock = ManualClock()
    cache = make_cache(clock)
    gate = asyncio.Event()
    vendor = Vendor(ok(), gate=gate)
    leader = asyncio.create_task(cache.handle(make_flow(clock), vendor))
    await eventually(lambda: vendor.calls == 1)
    leaving = asyncio.create_task(cache.handle(make_flow(clock), vendor))
    staying = asyncio.create_task(cache.handle(make_flow(clock), vendor))
    await asyncio.sleep(0)
    leaving.cancel()
    gate.set()
    assert (await leader).body == BODY and (await staying).body == BODY
    assert leaving.cancelled() and vendor.calls == 1


async def test_followers_of_a_streamed_reply_make_their_own_calls() -> None:
    clock = ManualClock()
    gate = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"

    vendor = Vendor(Reply(200, CIMultiDict(), stream=chunks()), gate=gate)
    cache = make_cache(clock)
    tasks = [asyncio.create_task(cache.handle(make_flow(clock), vendor)) for _ in range(3)]
    await eventually(lambda: vendor.calls == 1)
    await asyncio.sleep(0)
    gate.set()
    replies = await asyncio.gather(*tasks)
    assert vendor.calls == 3 and all(r.stream is not None for r in replies)
    assert vendor.peak == 2  # the two followers ran side by side, not one after the other


# --- two replicas through Redis ---------------------------------------------------------------


def replica(
    link: RedisLink,
    clock: Clock,
    cfg: CacheConfig = CFG,
    events: RecordingEvents | None = None,
) -> StaleCache:
    """One proxy replica's cache: its own in-process tier in front of the shared Redis."""
    return StaleCache(ROUTE, cfg, build_store(cfg, link, clock), clock, events, poll_interval=0.01)


async def test_entries_live_in_redis_under_the_route_with_ttl_plus_stale_ttl(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    clock = ManualClock()
    await replica(links[0], clock).handle(make_flow(clock), Vendor(ok()))
    k = key(QUERY)
    assert await raw.keys("test:*") == [f"test:cache:{{{k}}}".encode()]
    assert k.startswith("tavily:")
    pttl = await raw.pttl(f"test:cache:{{{k}}}")
    assert (CFG.ttl + CFG.stale_ttl) * 1000 - 1000 < pttl <= (CFG.ttl + CFG.stale_ttl) * 1000
    stored = Entry.from_bytes(await raw.get(f"test:cache:{{{k}}}"))
    assert stored.body == BODY and stored.stored_at == clock.wall()


async def test_an_entry_stored_by_one_replica_is_a_fresh_hit_on_another(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    clock = ManualClock()
    a, b = replica(links[0], clock), replica(links[1], clock)
    await a.handle(make_flow(clock), Vendor(ok()))
    clock.advance(7)
    vendor_b = Vendor(ok(b'{"other": true}'))
    await raw.config_resetstat()
    hit = await b.handle(make_flow(clock), vendor_b)
    assert vendor_b.calls == 0
    assert (hit.body, hit.headers["X-Cache"], hit.headers["Age"]) == (BODY, "HIT", "7")
    stats = await raw.info("commandstats")
    assert stats["cmdstat_get"]["calls"] == 1  # one round trip for the lookup
    assert not {"cmdstat_set", "cmdstat_exists", "cmdstat_del"} & set(stats)
    # Now in b's own tier: the next hit needs no Redis at all.
    await raw.config_resetstat()
    assert (await b.handle(make_flow(clock), vendor_b)).headers["X-Cache"] == "HIT"
    assert "cmdstat_get" not in await raw.info("commandstats")


async def test_an_entry_stored_by_one_replica_is_served_stale_by_another(
    links: tuple[RedisLink, RedisLink],
) -> None:
    clock = ManualClock()
    a, b = replica(links[0], clock), replica(links[1], clock)
    await a.handle(make_flow(clock), Vendor(ok()))
    clock.advance(CFG.ttl + 5)
    reply = await b.handle(make_flow(clock), Vendor(CircuitOpen("tavily: circuit open")))
    assert (reply.body, reply.headers["X-Cache"], reply.headers["Age"]) == (BODY, "STALE", "65")


async def test_a_newer_entry_in_redis_replaces_a_stale_one_in_process(
    links: tuple[RedisLink, RedisLink],
) -> None:
    clock = ManualClock()
    a, b = replica(links[0], clock), replica(links[1], clock)
    await a.handle(make_flow(clock), Vendor(ok(b'{"v":1}')))
    clock.advance(CFG.ttl + 1)
    await b.handle(make_flow(clock), Vendor(ok(b'{"v":2}')))  # b refreshes the entry
    vendor_a = Vendor(ok(b'{"v":3}'))
    assert (await a.handle(make_flow(clock), vendor_a)).body == b'{"v":2}'
    assert vendor_a.calls == 0


async def test_twenty_concurrent_requests_with_the_redis_tier_make_one_call(
    links: tuple[RedisLink, RedisLink],
) -> None:
    clock = ManualClock()
    cache = replica(links[0], clock)
    gate = asyncio.Event()
    vendor = Vendor(ok(), gate=gate)
    tasks = [asyncio.create_task(cache.handle(make_flow(clock), vendor)) for _ in range(20)]
    await eventually(lambda: vendor.calls == 1)
    await asyncio.sleep(0.02)
    gate.set()
    replies = await asyncio.gather(*tasks)
    assert vendor.calls == 1 and all(r.body == BODY for r in replies)


async def test_a_follower_on_another_replica_waits_for_the_leaders_entry(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    events_b = RecordingEvents()
    clock_b = RecordingClock()
    a = replica(links[0], SYSTEM_CLOCK)
    b = replica(links[1], clock_b, events=events_b)
    gate = asyncio.Event()
    vendor = Vendor(ok(), gate=gate)  # one vendor behind both replicas
    leader = asyncio.create_task(a.handle(make_flow(SYSTEM_CLOCK), vendor))
    lock = f"test:cache-lock:{{{key(QUERY)}}}"
    await eventually(lambda: raw.exists(lock))
    follower = asyncio.create_task(b.handle(make_flow(clock_b), vendor))
    await asyncio.sleep(0.05)
    assert not follower.done() and vendor.calls == 1
    gate.set()
    first, second = await leader, await follower
    assert vendor.calls == 1
    assert first.headers["X-Cache"] == "MISS"
    assert second.headers["X-Cache"] == "HIT" and second.body == BODY
    # It stopped polling when the leader's entry arrived, long before lock_wait ran out.
    assert 0 < sum(clock_b.sleeps) < CFG.lock_wait / 2
    assert events_b.coalesced_count == 1 and events_b.results == ["hit"]
    assert not await raw.exists(lock)  # released with the store


async def test_a_follower_waits_at_most_lock_wait_then_calls_the_vendor(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    clock = ManualClock()
    cache = replica(links[1], clock, cfg=replace(CFG, lock_wait=0.5))
    # A leader on another replica that never finishes.
    await raw.set(f"test:cache-lock:{{{key(QUERY)}}}", b"1", px=60_000)
    vendor = Vendor(ok())
    reply = await cache.handle(make_flow(clock), vendor)
    assert vendor.calls == 1 and reply.headers["X-Cache"] == "MISS"
    assert sum(clock.sleeps) == pytest.approx(0.5)
    assert max(clock.sleeps) <= 0.01 + 1e-9


async def test_a_followers_wait_is_capped_by_its_deadline(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    clock = ManualClock()
    cache = replica(links[1], clock, cfg=replace(CFG, lock_wait=5.0))
    await raw.set(f"test:cache-lock:{{{key(QUERY)}}}", b"1", px=60_000)
    vendor = Vendor(ok())
    await cache.handle(make_flow(clock, deadline_in=0.2), vendor)
    assert vendor.calls == 1 and sum(clock.sleeps) == pytest.approx(0.2)


async def test_a_follower_stops_waiting_when_the_leader_gives_up_without_an_entry(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    # The manual clock's polls take no time: the follower spins while the test runs, so how far
    # its clock gets before the delete is seen depends on the machine. A lock_wait (and deadline)
    # of 100,000 polls tells stopping at the delete from waiting it out on any machine.
    clock = ManualClock()
    cfg = replace(CFG, lock_wait=1000.0)
    cache = replica(links[1], clock, cfg=cfg)
    lock = f"test:cache-lock:{{{key(QUERY)}}}"
    await raw.set(lock, b"1", px=60_000)
    vendor = Vendor(ok())
    flow = make_flow(clock, deadline_in=cfg.lock_wait * 2)
    follower = asyncio.create_task(cache.handle(flow, vendor))
    await eventually(lambda: len(clock.sleeps) >= 2)
    assert vendor.calls == 0
    await raw.delete(lock)
    await asyncio.wait_for(follower, 30.0)
    assert vendor.calls == 1 and sum(clock.sleeps) < cfg.lock_wait / 2


async def test_a_no_cache_follower_does_not_take_the_entry_it_already_refused(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    clock = ManualClock()
    cfg = replace(CFG, lock_wait=0.1)
    a, b = replica(links[0], clock, cfg), replica(links[1], clock, cfg)
    await a.handle(make_flow(clock), Vendor(ok(b'{"v":1}')))
    await raw.set(f"test:cache-lock:{{{key(QUERY)}}}", b"1", px=60_000)
    vendor_b = Vendor(ok(b'{"v":2}'))
    reply = await b.handle(make_flow(clock, headers={"Cache-Control": "no-cache"}), vendor_b)
    assert reply.body == b'{"v":2}' and vendor_b.calls == 1


async def test_a_failed_leader_releases_its_lock(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    clock = ManualClock()
    with pytest.raises(UpstreamTimeout):
        await replica(links[0], clock).handle(make_flow(clock), Vendor(UpstreamTimeout("slow")))
    assert await raw.keys("test:*") == []


async def test_clear_removes_the_routes_entries_in_both_tiers_and_nothing_else(
    links: tuple[RedisLink, RedisLink], raw: Redis
) -> None:
    clock = ManualClock()
    cache = replica(links[0], clock)
    other = StaleCache("tavily-eu", CFG, build_store(CFG, links[0], clock), clock)
    vendor = Vendor(ok())
    for i in range(3):
        await cache.handle(make_flow(clock, f'{{"query": "q{i}"}}'.encode()), vendor)
    await other.handle(make_flow(clock), vendor)
    assert await cache.clear() == Cleared(local=3, shared=3)
    assert [k.decode() for k in await raw.keys("test:*")] == [
        f"test:cache:{{{key(QUERY, route='tavily-eu')}}}"
    ]
    await cache.handle(make_flow(clock, b'{"query": "q0"}'), vendor)
    assert vendor.calls == 5


async def test_redis_going_away_leaves_the_in_process_tier_and_coming_back_shares_again(
    killable_redis: RedisServer,
) -> None:
    clock = ManualClock()
    link_a = RedisLink(killable_redis.url, "test", retry_interval=0.05)
    link_b = RedisLink(killable_redis.url, "test", retry_interval=0.05)
    a, b = replica(link_a, clock), replica(link_b, clock)
    vendor_a, vendor_b = Vendor(ok()), Vendor(ok())
    before = b'{"query": "before"}'
    try:
        await a.handle(make_flow(clock, before), vendor_a)
        killable_redis.stop()

        async def timed(cache: StaleCache, body: bytes, vendor: Vendor) -> Reply:
            async with asyncio.timeout(0.2):  # a dead Redis must not stall the cache
                return await cache.handle(make_flow(clock, body), vendor)

        assert (await timed(a, before, vendor_a)).headers["X-Cache"] == "HIT"
        assert (await timed(b, before, vendor_b)).headers["X-Cache"] == "MISS"
        during = b'{"query": "during"}'
        assert (await timed(a, during, vendor_a)).headers["X-Cache"] == "MISS"
        assert (await timed(a, during, vendor_a)).headers["X-Cache"] == "HIT"
        assert (await timed(b, during, vendor_b)).headers["X-Cache"] == "MISS"
        assert (vendor_a.calls, vendor_b.calls) == (2, 2)
        assert not link_a.up

        killable_redis.start()
        await eventually(link_a.ping)
        await eventually(link_b.ping)
        after = b'{"query": "after"}'
        await a.handle(make_flow(clock, after), vendor_a)
        assert (await b.handle(make_flow(clock, after), vendor_b)).headers["X-Cache"] == "HIT"
        assert vendor_b.calls == 2
    finally:
        await link_a.close()
        await link_b.close()

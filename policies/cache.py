"""The stale-while-error cache: fresh entries answer, stale ones stand in when the vendor fails.

Decisions (key, freshness, request directives, what is stored) are pure functions; the stores
only keep bytes: an in-process LRU, Redis, or both as two tiers. `StaleCache` is the policy.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import math
import struct
import unicodedata
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, NamedTuple, Protocol
from urllib.parse import parse_qsl

import orjson
import structlog
from multidict import CIMultiDict

from policies.core.clock import SYSTEM_CLOCK, Clock
from policies.core.errors import ClientFault, LocalRefusal, ProxyError
from policies.core.events import Events, NullEvents
from policies.core.flow import Flow, Handler, Reply
from policies.core.outcome import Outcome
from policies.core.redislink import UNAVAILABLE, RedisLink

log = structlog.get_logger("search_proxy.cache")


@dataclass(frozen=True)
class CacheConfig:
    """A route's `cache:` section."""

    ttl: float = 600.0  # seconds an entry answers without asking the vendor
    stale_ttl: float = 86400.0  # then seconds it may stand in when the vendor fails
    max_entry_bytes: int = 1024 * 1024
    methods: frozenset[str] = frozenset({"GET", "POST"})
    ignore_body_fields: tuple[str, ...] = ()
    shared: bool = False
    max_entries: int = 10_000
    max_bytes: int = 256 * 1024 * 1024
    lock_wait: float = 2.0


# ---------------------------------------------------------------------------------------------
# Pure decisions

_CREDENTIAL_HEADERS = ("authorization", "x-api-key", "x-subscription-token")
_CREDENTIAL_FIELD = "api_key"
_QUERY_FIELDS = frozenset({"query", "q"})


class Freshness(enum.Enum):
    """Where an entry stands: served (FRESH), served only if the vendor fails (STALE), or gone."""

    FRESH = "fresh"
    STALE = "stale"
    EXPIRED = "expired"


def freshness(
    stored_at_wall: float, now_wall: float, ttl: float, stale_ttl: float
) -> tuple[Freshness, float]:
    """The entry's state and age in seconds: fresh for `ttl`, then stale for `stale_ttl`."""
    # Replicas' wall clocks differ a little; an entry from the future is simply new.
    age = max(0.0, now_wall - stored_at_wall)
    if age < ttl:
        return Freshness.FRESH, age
    if age < ttl + stale_ttl:
        return Freshness.STALE, age
    return Freshness.EXPIRED, age


class Directives(NamedTuple):
    """The request's cache directives (RFC 9111 §5.2.1) that this cache honours."""

    no_cache: bool  # skip the fresh hit; still store, still serve stale on failure
    no_store: bool  # neither read nor write


_NO_DIRECTIVES = Directives(no_cache=False, no_store=False)


def request_directives(headers: CIMultiDict[str]) -> Directives:
    """Read Cache-Control (and Pragma when Cache-Control is absent, RFC 9111 §5.4)."""
    values = headers.getall("Cache-Control", ())
    if not values:
        if "no-cache" in headers.get("Pragma", "").lower():
            return Directives(no_cache=True, no_store=False)
        return _NO_DIRECTIVES
    no_cache = no_store = False
    for value in values:
        for item in value.split(","):
            name, _, arg = item.strip().lower().partition("=")
            if name == "no-cache" or (name == "max-age" and arg.strip().strip('"') == "0"):
                no_cache = True
            elif name == "no-store":
                no_store = True
    return Directives(no_cache=no_cache, no_store=no_store)


def _text(value: str, field: str | None) -> str:
    value = unicodedata.normalize("NFC", value)
    # str.split() without arguments splits on every run of Unicode whitespace and trims.
    return " ".join(value.split()) if field in _QUERY_FIELDS else value


def _canonical(value: Any, field: str | None = None) -> Any:
    if isinstance(value, str):
        return _text(value, field)
    if isinstance(value, dict):
        return {unicodedata.normalize("NFC", k): _canonical(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v, field) for v in value]
    return value


def _body_part(body: bytes, ignored: tuple[str, ...]) -> tuple[bytes, list[str]]:
    """The body as it counts for the key, and the credentials taken out of it."""
    if not body:
        return b"", []
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return b"r" + body, []
    data = _canonical(data)
    credentials: list[str] = []
    if isinstance(data, dict):
        for name in ignored:
            data.pop(name, None)
        if _CREDENTIAL_FIELD in data:
            value = data.pop(_CREDENTIAL_FIELD)
            credentials.append(value if isinstance(value, str) else orjson.dumps(value).decode())
    return b"j" + orjson.dumps(data, option=orjson.OPT_SORT_KEYS), credentials


def _query_part(query_string: str) -> tuple[list[tuple[str, str]], list[str]]:
    """Sorted query parameters, and the credentials taken out of them."""
    if not query_string:
        return [], []
    try:
        pairs = parse_qsl(query_string, keep_blank_values=True, errors="strict")
    except UnicodeDecodeError:
        # Decoding with replacement would map different byte strings to one key.
        return [("", query_string)], []
    params: list[tuple[str, str]] = []
    credentials: list[str] = []
    for name, value in pairs:
        if name == _CREDENTIAL_FIELD:
            credentials.append(value)
        else:
            params.append((unicodedata.normalize("NFC", name), _text(value, name)))
    # A stable sort keeps repeated parameters in their order, which may carry meaning.
    params.sort(key=itemgetter(0))
    return params, credentials


def cache_key(
    route: str,
    method: str,
    path: str,
    query_string: str,
    body: bytes,
    headers: CIMultiDict[str],
    cfg: CacheConfig,
    client: str = "",
) -> str:
    """`<route>:<sha256 hex>` over method, path, sorted query, canonical body and, unless
    `cfg.shared`, the caller's credentials (headers, `api_key` in body or query, `client`).

    JSON bodies count with sorted keys, Unicode NFC and whitespace runs collapsed in `query`/`q`
    fields; `cfg.ignore_body_fields` and `api_key` are dropped from the top-level object. Any
    other body counts byte for byte.
    """
    params, query_credentials = _query_part(query_string)
    body_part, body_credentials = _body_part(body, cfg.ignore_body_fields)
    material: list[Any] = [method.upper(), path, params]
    if not cfg.shared:
        material.append(
            [f"{h}={v}" for h in _CREDENTIAL_HEADERS for v in headers.getall(h, ())]
            + [f"api_key={v}" for v in (*query_credentials, *body_credentials)]
            + [f"client={client}"]
        )
    # orjson escapes control characters, so the NUL cannot occur inside the JSON before it.
    digest = hashlib.sha256(orjson.dumps(material))
    digest.update(b"\x00")
    digest.update(body_part)
    return f"{route}:{digest.hexdigest()}"


def default_storable(reply: Reply) -> bool:
    """A 2xx reply whose body parses when its content type says JSON."""
    if not 200 <= reply.status < 300:
        return False
    media = reply.headers.get("Content-Type", "").partition(";")[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        try:
            orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Entries

# Replayed from the vendor's answer. Everything else (Date, Set-Cookie, framing, hop-by-hop,
# rate-limit counters, request ids) describes the original exchange, not a later replay.
_REPLAYED_HEADERS = frozenset({"content-type", "content-language", "etag", "last-modified"})
_VERSION = 1
# version, stored_at (wall seconds), status, length of the JSON header list; then the body.
_HEAD = struct.Struct(">BdHI")
_ENTRY_OVERHEAD = 96  # the bookkeeping of one LRU slot, so tiny entries are not free


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored answer: the vendor's status, replayable headers and exact body bytes."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    stored_at: float  # wall seconds

    @property
    def size(self) -> int:
        """Bytes counted against the in-process bound."""
        return len(self.body) + sum(len(k) + len(v) for k, v in self.headers) + _ENTRY_OVERHEAD

    def to_bytes(self) -> bytes:
        """A compact binary form: a 15-byte head, the headers as JSON, then the body."""
        head = orjson.dumps(self.headers)
        return _HEAD.pack(_VERSION, self.stored_at, self.status, len(head)) + head + self.body

    @classmethod
    def from_bytes(cls, data: bytes) -> Entry:
        """Read `to_bytes` output; ValueError for anything else."""
        try:
            version, stored_at, status, head_len = _HEAD.unpack_from(data)
        except struct.error as exc:
            raise ValueError(f"cache entry too short: {len(data)} bytes") from exc
        start = _HEAD.size
        if version != _VERSION or start + head_len > len(data):
            raise ValueError(f"not a version {_VERSION} cache entry")
        pairs = orjson.loads(data[start : start + head_len])
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p)
            for p in pairs
        ):
            raise ValueError("cache entry headers are not a list of name/value pairs")
        headers = tuple((name, value) for name, value in pairs)
        return cls(status, headers, data[start + head_len :], stored_at)

    def reply(self) -> Reply:
        """A new Reply carrying this entry."""
        return Reply(self.status, CIMultiDict(self.headers), self.body)


def entry_from_reply(reply: Reply, stored_at: float) -> Entry:
    """The entry to store for a (non-streamed) reply."""
    headers = tuple((k, v) for k, v in reply.headers.items() if k.lower() in _REPLAYED_HEADERS)
    return Entry(reply.status, headers, reply.body, stored_at)


# ---------------------------------------------------------------------------------------------
# Storage


class LockState(enum.Enum):
    """The outcome of asking for the cross-replica fetch lock."""

    ACQUIRED = "acquired"  # we fetch; other replicas wait for our entry
    HELD = "held"  # another replica is fetching this key
    ABSENT = "absent"  # no shared lock (no Redis, or it is down): fetch without one


class Poll(NamedTuple):
    """The shared tier's entry for a key, and whether a replica still holds its fetch lock."""

    entry: Entry | None
    held: bool


class Cleared(NamedTuple):
    """Entries removed by `clear`: in this process, and in Redis (None: not reachable)."""

    local: int
    shared: int | None


class CacheStore(Protocol):
    """Where entries live; stores only move bytes, the policy decides."""

    async def get(self, key: str, fresh_after: float = -math.inf) -> Entry | None:
        """The newest entry for `key`; a later tier is asked only when the first tier's
        entry was not stored after `fresh_after` (wall seconds)."""
        ...

    async def put(self, key: str, entry: Entry, *, unlock: bool = False) -> None:
        """Keep `entry` until stored_at + ttl + stale_ttl; `unlock` also releases the lock."""
        ...

    async def lock(self, key: str, ttl: float) -> LockState:
        """Take the cross-replica fetch lock for `key` for at most `ttl` seconds."""
        ...

    async def poll(self, key: str) -> Poll:
        """One look at the shared tier while another replica fetches `key`."""
        ...

    async def unlock(self, key: str) -> None:
        """Release the fetch lock without storing."""
        ...

    async def clear(self, route: str) -> Cleared:
        """Remove every entry of `route`."""
        ...


class MemoryStore:
    """The in-process tier: an LRU bounded by entry count and by bytes."""

    def __init__(self, retain: float, max_entries: int, max_bytes: int, clock: Clock) -> None:
        self.retain = retain
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: OrderedDict[str, tuple[Entry, int]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held, as counted against `max_bytes`."""
        return self._bytes

    def peek(self, key: str) -> Entry | None:
        """The entry for `key` unless past retention; marks it recently used."""
        slot = self._entries.get(key)
        if slot is None:
            return None
        if slot[0].stored_at + self.retain <= self.clock.wall():
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return slot[0]

    def keep(self, key: str, entry: Entry) -> None:
        """Store `entry`, evicting the least recently used until both bounds hold."""
        size = entry.size
        if key in self._entries:
            self._remove(key)
        if size > self.max_bytes or entry.stored_at + self.retain <= self.clock.wall():
            return
        self._entries[key] = (entry, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self._bytes -= evicted

    def _remove(self, key: str) -> None:
        _, size = self._entries.pop(key)
        self._bytes -= size

    async def get(self, key: str, fresh_after: float = -math.inf) -> Entry | None:
        return self.peek(key)

    async def put(self, key: str, entry: Entry, *, unlock: bool = False) -> None:
        self.keep(key, entry)

    async def lock(self, key: str, ttl: float) -> LockState:
        # One process: the policy's in-flight map already makes one fetch per key.
        return LockState.ABSENT

    async def poll(self, key: str) -> Poll:
        return Poll(self.peek(key), held=False)

    async def unlock(self, key: str) -> None:
        pass

    async def clear(self, route: str) -> Cleared:
        prefix = route + ":"
        doomed = [k for k in self._entries if k.startswith(prefix)]
        for key in doomed:
            self._remove(key)
        return Cleared(local=len(doomed), shared=None)


class RedisStore:
    """The shared tier. Entries at `<prefix>:cache:<route>:<sha256>` (SET PX ttl+stale_ttl),
    fetch locks at `<prefix>:cache-lock:<route>:<sha256>` (SET NX PX). Redis down = a miss."""

    def __init__(self, link: RedisLink, retain: float, clock: Clock) -> None:
        self.link = link
        self.retain = retain
        self.clock = clock

    def entry_key(self, key: str) -> str:
        """The Redis key holding the entry for cache key `key`."""
        return self.link.key("cache", key)

    def lock_key(self, key: str) -> str:
        """The Redis key of the fetch lock for cache key `key`."""
        return self.link.key("cache-lock", key)

    def _decode(self, raw: Any) -> Entry | None:
        if raw is None or raw is UNAVAILABLE:
            return None
        try:
            return Entry.from_bytes(raw)
        except ValueError as exc:
            log.warning("cache_entry_unreadable", detail=str(exc)[:200])
            return None

    async def get(self, key: str, fresh_after: float = -math.inf) -> Entry | None:
        name = self.entry_key(key)
        return self._decode(await self.link.run(lambda r: r.get(name)))

    async def put(self, key: str, entry: Entry, *, unlock: bool = False) -> None:
        px = math.ceil((entry.stored_at + self.retain - self.clock.wall()) * 1000)
        if px <= 0:
            if unlock:
                await self.unlock(key)
            return
        name, data, lock = self.entry_key(key), entry.to_bytes(), self.lock_key(key)

        async def store(r: Any) -> Any:
            if not unlock:
                return await r.set(name, data, px=px)
            # The entry is written before the lock goes, so a waiting replica that sees the
            # lock gone also sees the entry. Deleting without an owner check is safe because
            # the lock outlives the leader's deadline (see StaleCache).
            async with r.pipeline(transaction=False) as pipe:
                pipe.set(name, data, px=px)
                pipe.delete(lock)
                return await pipe.execute()

        await self.link.run(store)

    async def lock(self, key: str, ttl: float) -> LockState:
        name, px = self.lock_key(key), max(1, math.ceil(ttl * 1000))
        got = await self.link.run(lambda r: r.set(name, b"1", nx=True, px=px))
        if got is UNAVAILABLE:
            return LockState.ABSENT
        return LockState.ACQUIRED if got else LockState.HELD

    async def poll(self, key: str) -> Poll:
        name, lock = self.entry_key(key), self.lock_key(key)

        async def look(r: Any) -> Any:
            async with r.pipeline(transaction=False) as pipe:
                pipe.get(name)
                pipe.exists(lock)
                return await pipe.execute()

        found = await self.link.run(look)
        if found is UNAVAILABLE:
            return Poll(None, held=False)
        return Poll(self._decode(found[0]), held=bool(found[1]))

    async def unlock(self, key: str) -> None:
        name = self.lock_key(key)
        await self.link.run(lambda r: r.delete(name))

    async def clear(self, route: str) -> Cleared:
        # Route names are [a-z0-9_-], so the pattern has no glob characters but the last.
        pattern = self.link.key("cache", route) + ":*"
        cursor, removed = 0, 0
        while True:
            page = await self.link.run(lambda r, c=cursor: r.scan(c, match=pattern, count=500))
            if page is UNAVAILABLE:
                return Cleared(local=0, shared=None)
            cursor, names = page
            if names:
                n = await self.link.run(lambda r, names=names: r.unlink(*names))
                if n is UNAVAILABLE:
                    return Cleared(local=0, shared=None)
                removed += n
            if cursor == 0:
                return Cleared(local=0, shared=removed)


class TieredStore:
    """The in-process LRU in front of Redis: always read and written; Redis when it answers."""

    def __init__(self, local: MemoryStore, shared: RedisStore) -> None:
        self.local = local
        self.shared = shared

    async def get(self, key: str, fresh_after: float = -math.inf) -> Entry | None:
        entry = self.local.peek(key)
        if entry is not None and entry.stored_at > fresh_after:
            return entry
        remote = await self.shared.get(key)
        if remote is not None and (entry is None or remote.stored_at > entry.stored_at):
            self.local.keep(key, remote)
            return remote
        return entry

    async def put(self, key: str, entry: Entry, *, unlock: bool = False) -> None:
        self.local.keep(key, entry)
        await self.shared.put(key, entry, unlock=unlock)

    async def lock(self, key: str, ttl: float) -> LockState:
        return await self.shared.lock(key, ttl)

    async def poll(self, key: str) -> Poll:
        found = await self.shared.poll(key)
        if found.entry is not None:
            self.local.keep(key, found.entry)
        return found

    async def unlock(self, key: str) -> None:
        await self.shared.unlock(key)

    async def clear(self, route: str) -> Cleared:
        local = await self.local.clear(route)
        shared = await self.shared.clear(route)
        return Cleared(local=local.local, shared=shared.shared)


def build_store(
    cfg: CacheConfig, link: RedisLink | None, clock: Clock = SYSTEM_CLOCK
) -> CacheStore:
    """One route's store: the in-process LRU, in front of Redis when a link is configured."""
    retain = cfg.ttl + cfg.stale_ttl
    local = MemoryStore(retain, cfg.max_entries, cfg.max_bytes, clock)
    return local if link is None else TieredStore(local, RedisStore(link, retain, clock))


# ---------------------------------------------------------------------------------------------
# The policy

# A crashed leader's lock blocks other replicas' followers no longer than their lock_wait, and
# expires after this at the latest.
_MAX_LOCK_TTL = 120.0


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What a leader hands its in-process followers. Neither reply nor error: fetch yourself."""

    cache: str
    reply: Reply | None = None  # a private copy, never the leader's own object
    error: BaseException | None = None
    streamed: bool = False


_FETCH_YOURSELF = _Outcome(cache="miss")


def _copy(reply: Reply) -> Reply:
    return Reply(reply.status, CIMultiDict(reply.headers), reply.body)


class StaleCache:
    """Serves fresh entries, stores good 2xx answers, and serves stale entries when the vendor
    fails (429, 5xx, or a non-client ProxyError); one vendor call per key at a time.

    Coalescing: in one process, identical requests wait for the first one's call and get a copy
    of its answer. Across replicas, the first takes a Redis lock (SET NX PX); a request on another
    replica that finds it held polls the shared tier every `poll_interval` for at most
    min(cfg.lock_wait, time left before its deadline), then calls the vendor itself. It stops
    early when a new fresh entry appears (served as a hit) or the lock is released without one.
    So a follower waits at most lock_wait beyond its own vendor call, and each replica makes at
    most one vendor call per key at a time.
    """

    def __init__(
        self,
        route: str,
        cfg: CacheConfig,
        store: CacheStore,
        clock: Clock = SYSTEM_CLOCK,
        events: Events | None = None,
        storable: Callable[[Reply], bool] = default_storable,
        poll_interval: float = 0.05,
    ) -> None:
        self.route = route
        self.cfg = cfg
        self.store = store
        self.clock = clock
        self.events = events or NullEvents()
        self.storable = storable
        self.poll_interval = poll_interval
        self._inflight: dict[str, asyncio.Future[_Outcome]] = {}

    async def clear(self) -> Cleared:
        """Drop this route's entries (admin endpoint)."""
        return await self.store.clear(self.route)

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        """Answer from the cache, or call the vendor and store; serve stale if the vendor fails."""
        if flow.method not in self.cfg.methods:
            return await self._bypass(flow, call_next)
        directives = request_directives(flow.headers)
        if directives.no_store:
            return await self._bypass(flow, call_next)
        key = cache_key(
            self.route,
            flow.method,
            flow.path,
            flow.query_string,
            flow.body,
            flow.headers,
            self.cfg,
            flow.client,
        )
        pending = self._inflight.get(key)
        if pending is not None:
            return await self._follow(flow, call_next, pending)

        entry = await self.store.get(key, fresh_after=self.clock.wall() - self.cfg.ttl)
        fwd = "uri-miss"
        if entry is not None:
            state, age = freshness(
                entry.stored_at, self.clock.wall(), self.cfg.ttl, self.cfg.stale_ttl
            )
            if state is Freshness.FRESH and not directives.no_cache:
                self._mark(flow, "hit")
                return self._hit(entry, age)
            if state is Freshness.EXPIRED:
                entry = None
            else:
                fwd = "request" if state is Freshness.FRESH else "stale"

        # The lookup may have yielded to another identical request that is now fetching.
        pending = self._inflight.get(key)
        if pending is not None:
            return await self._follow(flow, call_next, pending)
        return await self._lead(flow, call_next, key, entry, fwd)

    def _mark(self, flow: Flow, result: str) -> None:
        # Each request reports exactly one of hit, miss, stale or bypass.
        flow.cache = result
        self.events.cache(self.route, result)

    async def _bypass(self, flow: Flow, call_next: Handler) -> Reply:
        self._mark(flow, "bypass")
        reply = await call_next(flow)
        reply.headers["X-Cache"] = "BYPASS"
        reply.headers["Cache-Status"] = "search-proxy; fwd=bypass"
        return reply

    async def _follow(
        self, flow: Flow, call_next: Handler, pending: asyncio.Future[_Outcome]
    ) -> Reply:
        # shield: a follower that goes away must not cancel the leader's future.
        outcome = await asyncio.shield(pending)
        if outcome.streamed:
            # A stream can be read once; run this one's own call, uncached, in parallel.
            self._mark(flow, "miss")
            return await call_next(flow)
        if outcome.reply is None and outcome.error is None:
            return await self.handle(flow, call_next)
        self.events.coalesced(self.route)
        self._mark(flow, outcome.cache)
        if outcome.error is not None:
            raise outcome.error
        assert outcome.reply is not None
        return _copy(outcome.reply)

    async def _lead(
        self, flow: Flow, call_next: Handler, key: str, fallback: Entry | None, fwd: str
    ) -> Reply:
        future: asyncio.Future[_Outcome] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        outcome = _FETCH_YOURSELF
        try:
            reply = await self._fetch(flow, call_next, key, fallback, fwd)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            outcome = _Outcome(cache=flow.cache or "miss", error=exc)
            raise
        else:
            if reply.stream is not None:
                outcome = _Outcome(cache="miss", streamed=True)
            else:
                outcome = _Outcome(cache=flow.cache or "miss", reply=_copy(reply))
            return reply
        finally:
            del self._inflight[key]
            future.set_result(outcome)

    async def _fetch(
        self, flow: Flow, call_next: Handler, key: str, fallback: Entry | None, fwd: str
    ) -> Reply:
        lock = LockState.ABSENT
        if self.cfg.lock_wait > 0:
            remaining = flow.deadline - self.clock.now()
            # The lock outlives the leader's call (bounded by its deadline), so only its owner
            # ever deletes it; a crashed leader's lock still expires.
            ttl = min(max(remaining, self.cfg.lock_wait), _MAX_LOCK_TTL)
            lock = await self.store.lock(key, ttl)
        if lock is LockState.HELD:
            hit = await self._await_remote(flow, key, fallback)
            if hit is not None:
                return hit
        locked = lock is LockState.ACQUIRED
        stored = False
        try:
            try:
                reply = await call_next(flow)
            except ProxyError as exc:
                # A fault of the request itself: stale data would only hide the agent's mistake.
                if isinstance(exc, ClientFault):
                    self._mark(flow, "miss")
                    raise
                forwarded = not isinstance(exc, LocalRefusal)
                stale = self._stale(flow, fallback, exc.upstream_status, exc.type, forwarded)
                if stale is None:
                    self._mark(flow, "miss")
                    raise
                return stale
            if Outcome.of_status(reply.status).is_vendor_failure:
                detail = "upstream_rate_limited" if reply.status == 429 else "upstream_error"
                stale = self._stale(flow, fallback, reply.status, detail, forwarded=True)
                if stale is not None:
                    reply.discard()
                    return stale
            elif self._storable(reply):
                entry = entry_from_reply(reply, self.clock.wall())
                await self.store.put(key, entry, unlock=locked)
                stored = True
                self.events.cache(self.route, "store")
            self._mark(flow, "miss")
            status = "" if 200 <= reply.status < 300 else f"; fwd-status={reply.status}"
            reply.headers["X-Cache"] = "MISS"
            reply.headers["Cache-Status"] = (
                f"search-proxy; fwd={fwd}{status}{'; stored' if stored else ''}"
            )
            return reply
        finally:
            if locked and not stored:
                await self.store.unlock(key)

    def _storable(self, reply: Reply) -> bool:
        # A stream is passed through untouched: never read, never stored.
        return (
            reply.stream is None
            and 200 <= reply.status < 300
            and len(reply.body) <= self.cfg.max_entry_bytes
            and self.storable(reply)
        )

    async def _await_remote(self, flow: Flow, key: str, seen: Entry | None) -> Reply | None:
        """Wait for another replica's leader to store `key`; None means "fetch it yourself"."""
        now = self.clock.now()
        until = now + min(self.cfg.lock_wait, flow.deadline - now)
        seen_at = seen.stored_at if seen is not None else -math.inf
        while True:
            entry, held = await self.store.poll(key)
            if entry is not None and entry.stored_at > seen_at:
                state, age = freshness(
                    entry.stored_at, self.clock.wall(), self.cfg.ttl, self.cfg.stale_ttl
                )
                if state is Freshness.FRESH:
                    self.events.coalesced(self.route)
                    self._mark(flow, "hit")
                    return self._hit(entry, age)
            left = until - self.clock.now()
            if not held or left <= 0:
                return None
            await self.clock.sleep(min(self.poll_interval, left))

    def _hit(self, entry: Entry, age: float) -> Reply:
        reply = entry.reply()
        reply.headers["X-Cache"] = "HIT"
        reply.headers["Age"] = str(int(age))
        reply.headers["Cache-Status"] = f"search-proxy; hit; ttl={int(self.cfg.ttl - age)}"
        return reply

    def _stale(
        self, flow: Flow, entry: Entry | None, status: int | None, detail: str, forwarded: bool
    ) -> Reply | None:
        """The stale answer for a failed vendor call, or None when there is nothing to serve.

        RFC 9211: when nothing reached the vendor (open circuit, refused token) the stale entry
        is a `hit`; when the request was forwarded and failed it is `fwd=stale`, with the
        vendor's status in `fwd-status` when it answered one.
        """
        if entry is None:
            return None
        # The vendor call may have outlasted the entry's stale window.
        state, age = freshness(entry.stored_at, self.clock.wall(), self.cfg.ttl, self.cfg.stale_ttl)
        if state is Freshness.EXPIRED:
            return None
        self._mark(flow, "stale")
        reply = entry.reply()
        reply.headers["X-Cache"] = "STALE"
        reply.headers["Age"] = str(int(age))
        ttl = math.floor(self.cfg.ttl - age)
        if not forwarded:
            how = "hit"
        else:
            how = "fwd=stale" + (f"; fwd-status={status}" if status is not None else "")
        reply.headers["Cache-Status"] = f"search-proxy; {how}; ttl={ttl}; detail={detail}"
        return reply

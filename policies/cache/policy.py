"""`StaleCache`, the policy: fresh entries answer, good answers are stored, stale entries stand
in when the vendor fails, and identical requests share one vendor call."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass

from multidict import CIMultiDict

from policies.cache.config import CacheConfig
from policies.cache.entry import (
    Entry,
    Freshness,
    default_storable,
    entry_from_reply,
    freshness,
    opens_session,
)
from policies.cache.key import (
    NO_KNOWN_CREDENTIALS,
    KnownCredentials,
    cache_key,
    request_directives,
    session_traffic,
)
from policies.cache.lock import NO_LEASE, FetchLock, Lease, LockState
from policies.cache.store import CacheStore, Cleared
from policies.core.clock import SYSTEM_CLOCK, Clock
from policies.core.errors import ClientFault, LocalRefusal, ProxyError
from policies.core.events import Events, NullEvents
from policies.core.flow import Flow, Handler, Reply
from policies.core.outcome import Outcome


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What a leader hands its in-process followers. Neither reply nor error: fetch yourself."""

    cache: str
    reply: Reply | None = None  # a private copy, never the leader's own object
    error: BaseException | None = None
    streamed: bool = False


_FETCH_YOURSELF = _Outcome(cache="miss")


@dataclass(eq=False, slots=True)
class _Lead:
    """A vendor call in flight for a key. Its followers wait on `future`, made when the first
    of them comes: most calls have none, and then pay neither the future nor the copy."""

    future: asyncio.Future[_Outcome] | None = None

    def join(self) -> asyncio.Future[_Outcome]:
        if self.future is None:
            self.future = asyncio.get_running_loop().create_future()
        return self.future


def _copy(reply: Reply) -> Reply:
    return Reply(reply.status, CIMultiDict(reply.headers), reply.body, provider=reply.provider)


class StaleCache:
    """Serves fresh entries, stores good 2xx answers, and serves stale entries when the vendor
    fails (429, 5xx, or a non-client ProxyError); one vendor call per key at a time.

    Coalescing: in one process, identical requests wait for the first one's call and get a copy
    of its answer. Across replicas (`FetchLock`), the first takes a Redis lock for lock_wait; a
    request on another replica that finds it held polls the shared tier every `poll_interval` for
    at most min(cfg.lock_wait, time left before its deadline), then calls the vendor itself. It
    stops early when a new fresh entry appears (served as a hit) or the lock is released without
    one.
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
        known: KnownCredentials = NO_KNOWN_CREDENTIALS,
    ) -> None:
        self.route = route
        self.cfg = cfg
        self.store = store
        self.clock = clock
        self.events = events or NullEvents()
        self.storable = storable
        self.known = known  # where this route's requests carry credentials (the key's part)
        self.fetch_lock = FetchLock(store, cfg, clock, poll_interval)
        self._inflight: dict[str, _Lead] = {}

    async def clear(self) -> Cleared:
        """Drop this route's entries (admin endpoint)."""
        return await self.store.clear(self.route)

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        """Answer from the cache, or call the vendor and store; serve stale if the vendor fails."""
        request = flow.request
        if request.method not in self.cfg.methods:
            return await self._bypass(flow, call_next)
        directives = request_directives(request.headers)
        if directives.no_store:
            return await self._bypass(flow, call_next)
        if request.key_body is None and session_traffic(request.headers, request.body):
            return await self._bypass(flow, call_next)  # neither read, stored nor coalesced
        key = cache_key(
            self.route,
            request.method,
            request.path,
            request.query_string,
            request.body if request.key_body is None else request.key_body,
            request.headers,
            self.cfg,
            request.client,
            self.known,
        )
        # A request testing injected faults reads the cache, but shares no vendor call with
        # other requests and stores nothing: its answers are not the vendor's.
        testing = flow.context.fault_test
        pending = None if testing else self._inflight.get(key)
        if pending is not None:
            return await self._follow(flow, call_next, pending.join())

        # The lookup takes the fetch lock too when the entry is missing or not fresh: one
        # round trip to Redis instead of two.
        fresh_after = math.inf if directives.no_cache else self.clock.wall() - self.cfg.ttl
        ask = self.fetch_lock.ask(flow.context.deadline)
        entry, lease = await self.store.lookup(key, fresh_after, ask)
        fwd = "uri-miss"
        if entry is not None:
            state, age = freshness(
                entry.stored_at, self.clock.wall(), self.cfg.ttl, self.cfg.stale_ttl
            )
            if state is Freshness.FRESH and not directives.no_cache:
                if lease.state is LockState.ACQUIRED:  # it aged past fresh_after meanwhile
                    await self.fetch_lock.release(key, lease)
                self._mark(flow, "hit")
                flow.trace.cached = (key, entry)
                return self._hit(entry, age)
            if state is Freshness.EXPIRED:
                entry = None
            else:
                fwd = "request" if state is Freshness.FRESH else "stale"

        if testing:
            if lease.state is LockState.ACQUIRED:  # the lookup took it; this call shares nothing
                await self.fetch_lock.release(key, lease)
            return await self._fetch(flow, call_next, key, entry, fwd, NO_LEASE, shared=False)
        # The lookup may have yielded to another identical request that is now fetching.
        pending = self._inflight.get(key)
        if pending is not None:
            future = pending.join()  # before the await: the leader may end meanwhile
            await self.fetch_lock.release(key, lease)
            return await self._follow(flow, call_next, future)
        return await self._lead(flow, call_next, key, entry, fwd, lease)

    def _mark(self, flow: Flow, result: str) -> None:
        # Each request reports exactly one of hit, miss, stale or bypass.
        flow.trace.cache = result
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
        self,
        flow: Flow,
        call_next: Handler,
        key: str,
        fallback: Entry | None,
        fwd: str,
        lease: Lease,
    ) -> Reply:
        lead = self._inflight[key] = _Lead()
        outcome = _FETCH_YOURSELF
        try:
            reply = await self._fetch(flow, call_next, key, fallback, fwd, lease)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            outcome = _Outcome(cache=flow.trace.cache or "miss", error=exc)
            raise
        else:
            # Followers are known by now: none can join once no await is left.
            if lead.future is not None:
                outcome = self._handed(flow, reply)
            return reply
        finally:
            del self._inflight[key]
            if lead.future is not None:
                lead.future.set_result(outcome)

    @staticmethod
    def _handed(flow: Flow, reply: Reply) -> _Outcome:
        """What the leader's reply gives its followers."""
        if reply.stream is not None:
            return _Outcome(cache="miss", streamed=True)
        if flow.request.key_body is not None and 400 <= reply.status < 500 and reply.status != 429:
            # The key leaves part of the request out (an MCP call's session): an answer about
            # this request itself (404: its session is gone) is not the others'.
            return _FETCH_YOURSELF
        return _Outcome(cache=flow.trace.cache or "miss", reply=_copy(reply))

    async def _fetch(
        self,
        flow: Flow,
        call_next: Handler,
        key: str,
        fallback: Entry | None,
        fwd: str,
        lease: Lease,
        *,
        shared: bool = True,
    ) -> Reply:
        """Call the vendor under `lease` (the cross-replica lock); with `shared`, storing the
        answer."""
        if lease.state is LockState.HELD:
            arrived = await self.fetch_lock.wait(key, flow.context.deadline, fallback)
            if arrived is not None:
                entry, age = arrived
                self.events.coalesced(self.route)
                self._mark(flow, "hit")
                return self._hit(entry, age)
        locked = lease.state is LockState.ACQUIRED
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
            elif shared and self._storable(reply):
                entry = entry_from_reply(reply, self.clock.wall())
                await self.store.put(key, entry, unlock=lease.token or None)
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
                await self.fetch_lock.release(key, lease)

    def _storable(self, reply: Reply) -> bool:
        # A stream is passed through untouched: never read, never stored. Another vendor's
        # answer (failover) is not this vendor's to keep.
        return (
            reply.stream is None
            and reply.provider is None
            and 200 <= reply.status < 300
            and len(reply.body) <= self.cfg.max_entry_bytes
            and not opens_session(reply)
            and self.storable(reply)
        )

    def _hit(self, entry: Entry, age: float) -> Reply:
        reply = entry.reply()
        reply.headers.extend(self._hit_headers(age))
        return reply

    def _hit_headers(self, age: float) -> tuple[tuple[str, str], ...]:
        """What a fresh hit `age` seconds old adds to its entry's headers."""
        return (
            ("X-Cache", "HIT"),
            ("Age", str(int(age))),
            ("Cache-Status", f"search-proxy; hit; ttl={int(self.cfg.ttl - age)}"),
        )

    def replay(self, key: str, entry: Entry) -> tuple[tuple[str, str], ...] | None:
        """Answer a fresh hit for `key` again from `entry` without the chain (an identical
        request, proxy/replay.py): the hit's own headers now, counted as a hit; None when
        `entry` no longer answers `key` here (replaced, past fresh, or being fetched again:
        the chain then decides)."""
        local = self.store.local
        if local is None or key in self._inflight or local.peek(key) is not entry:
            return None
        state, age = freshness(entry.stored_at, self.clock.wall(), self.cfg.ttl, 0.0)
        if state is not Freshness.FRESH:
            return None
        self.events.cache(self.route, "hit")
        return self._hit_headers(age)

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

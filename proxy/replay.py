"""Fresh cache hits answered again to identical requests without running the route's chain.

A request the front reads whole (proxy/front.py) whose exact bytes (method, target, body, and
the headers the cache keys on) were answered by a fresh cache hit a moment ago gets the same
answer, written from the bytes kept then, as long as the cache entry it came from is still the
route's fresh entry for that key. Nothing above the cache could answer it differently: the
route is replayable only when the policies above its cache are ones that pass a fresh hit on
unchanged (the search guard while it replays no failure, failover, fault injection for a
request not asking for a fault); a client gate, request cache directives, an entry only Redis
holds, or an entry being fetched again send the request through the chain as always.

The answer is the one the chain served (its headers in their order, its body after the echo
guard), with what changes per request made again: the request id, the hit's Age and
Cache-Status, Date and Connection. Metrics and the access line are the same as a hit's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from multidict import CIMultiDictProxy

from policies.cache import StaleCache
from policies.cache.entry import MCP_SESSION
from policies.core.credentials import is_credential_name
from policies.failover import Failover
from policies.faults import HEADER as FAULT_HEADER
from policies.faults import FaultInjector
from policies.search import SearchGuard
from proxy.wire import connection_value, response_head

if TYPE_CHECKING:
    from proxy.wire import AgentRequest

MAX_REPLAYS = 512  # identical requests remembered per route
MAX_REPLAY_BYTES = 4 * 1024 * 1024  # what they hold per route: answers, entries, requests
MAX_REPLAYED_BODY = 4096  # a request body over this is never remembered (nor its key held)
# Headers of the answer made again for each request (lower case).
PER_REQUEST = frozenset({"x-request-id", "age", "cache-status", "date", "connection"})
# A request carrying one of these goes through the chain: it asks the cache (or a fault) for
# something of its own, or is a browser page's, which the route's handler may refuse.
_OWN_WAY = frozenset(
    {"cache-control", "pragma", "origin", MCP_SESSION.lower(), FAULT_HEADER.lower()}
)
# The `Connection` tokens that change nothing of what is forwarded (any other names a header
# the proxy then drops before the cache keys on it).
_PLAIN_CONNECTION = frozenset({"keep-alive", "close"})
# Headers the proxy writes itself on the way up (from the peer, Host, the request id): a route
# whose cache varies on one keys on what the agent does not send, so it is never replayed.
_DERIVED = frozenset({"x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-request-id"})

RequestKey = tuple[str, str, bytes, tuple[tuple[str, str], ...]]


@dataclass(frozen=True, slots=True)
class Replay:
    """What a hit answered: its cache key and entry, its status and headers as served."""

    cache_key: str
    entry: Any  # policies.cache.Entry
    status: int
    reason: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    @property
    def size(self) -> int:
        """Bytes it holds: the answer, the entry (when not the answer itself), the headers."""
        entry_body = getattr(self.entry, "body", b"")
        held = len(self.body) + (0 if entry_body is self.body else len(entry_body))
        return held + sum(len(k) + len(v) for k, v in self.headers) + 256


class Replays:
    """One route's remembered hits, by the exact request."""

    def __init__(self, cache: StaleCache, guard: SearchGuard | None) -> None:
        self.cache = cache
        self.guard = guard
        self.route = cache.route
        # What the cache key reads of the headers: credentials, and `cache.vary`.
        self._keyed = cache.known.headers | {name.lower() for name in cache.cfg.vary}
        self._memo: OrderedDict[RequestKey, Replay] = OrderedDict()
        self._bytes = 0  # what the remembered requests and answers hold

    def key(
        self, method: str, target: str, headers: CIMultiDictProxy[str], body: bytes
    ) -> RequestKey | None:
        """The request as the cache tells it apart from others (None: it goes its own way)."""
        if len(body) > MAX_REPLAYED_BODY:
            return None
        keyed = []
        for name, value in headers.items():
            lower = name.lower()
            if lower in _OWN_WAY:
                return None
            if (
                lower == "connection"
                and not {token.strip().lower() for token in value.split(",")} <= _PLAIN_CONNECTION
            ):
                return None  # it names a header dropped before the cache keys on it
            if lower in self._keyed or is_credential_name(lower):
                keyed.append((lower, value))
        return (method, target, body, tuple(keyed))

    @property
    def remembering(self) -> bool:
        """Whether any answer is remembered (none: no request is worth a look)."""
        return bool(self._memo)

    def remembered(self, request: AgentRequest, body: bytes) -> RequestKey | None:
        """The key of `request` (its body `body`) when an answer to it is remembered; None
        when none is (the usual miss: nothing more is looked at)."""
        key = self.key(request.method, request.raw_path, request.headers, body)
        return key if key is not None and key in self._memo else None

    def find(self, key: RequestKey) -> tuple[Replay, tuple[tuple[str, str], ...]] | None:
        """The remembered answer and the hit's headers now, counted as a hit; None when the
        chain must answer."""
        replay = self._memo.get(key)
        if replay is None or (self.guard is not None and self.guard.remembers_failures):
            return None
        now = self.cache.replay(replay.cache_key, replay.entry)
        if now is None:
            self._forget(key)
            return None
        return replay, now

    def answer(
        self, key: RequestKey, request: AgentRequest, rid: str
    ) -> tuple[int, bytes, int] | None:
        """The answer remembered for `key` (`request`'s, its id `rid`), as its status, the
        bytes to write and the body bytes among them, counted as a hit; None when the chain
        must answer. What changes per request (PER_REQUEST) is made anew: the hit's Age and
        Cache-Status, the id, the date, and Connection as this request says."""
        found = self.find(key)
        if found is None:
            return None
        replay, hit_headers = found
        now = {name.lower(): value for name, value in hit_headers}
        now["x-request-id"] = rid
        now["date"] = rfc822_formatted_time()
        headers = (
            (name, now.get(name.lower(), value))
            for name, value in replay.headers
            if name.lower() != "connection"
        )
        version = request.version
        connection = connection_value(version, request.keep_alive)
        head = response_head(version, replay.status, replay.reason, headers, connection)
        if request.method == "HEAD":
            return replay.status, head, 0
        return replay.status, head + replay.body, len(replay.body)

    def remember(self, request: AgentRequest, response: web.Response, body: bytes) -> None:
        """Keep the answer a fresh hit gave `request` as written (`body`), for the next
        identical request (`request.hit`: the hit's cache key and entry)."""
        if request.hit is None or request.body is None:
            return
        key = self.key(request.method, request.raw_path, request.headers, request.body)
        if key is not None:
            cache_key, entry = request.hit[1]
            headers = tuple(response.headers.items())
            self.keep(
                key, Replay(cache_key, entry, response.status, response.reason, headers, body)
            )

    def keep(self, key: RequestKey, served: Replay) -> None:
        """Remember the answer a fresh hit gave `key` (the oldest go past MAX_REPLAYS or
        MAX_REPLAY_BYTES)."""
        size = served.size + len(key[2])
        if size > MAX_REPLAY_BYTES // 4:
            return  # a large answer: the chain answers it each time
        self._forget(key)
        self._memo[key] = served
        self._bytes += size
        while len(self._memo) > MAX_REPLAYS or self._bytes > MAX_REPLAY_BYTES:
            self._forget(next(iter(self._memo)))

    def _forget(self, key: RequestKey) -> None:
        served = self._memo.pop(key, None)
        if served is not None:
            self._bytes -= served.size + len(key[2])


def replays_for(policies: Sequence[Any]) -> Replays | None:
    """The route's replays, when its chain lets a fresh hit be answered again without it: a
    cache, with only policies above it that pass a fresh hit on unchanged."""
    guard = None
    for policy in policies:
        if isinstance(policy, StaleCache):
            if any(name.lower() in _DERIVED for name in policy.cfg.vary):
                return None
            return Replays(policy, guard)
        if isinstance(policy, SearchGuard):
            guard = policy
        elif not isinstance(policy, Failover | FaultInjector):
            return None  # a policy that could answer differently
    return None

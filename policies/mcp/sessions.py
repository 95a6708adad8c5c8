"""Who each session of an MCP route belongs to: a digest of the credentials that opened it, so
no other caller can use or end it. Bounded, forgotten when the session ends or idles past
`mcp.session_idle`, and shared by the replicas through Redis when it is configured."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Generic, TypeVar

from policies.core.clock import Clock
from policies.core.shared import UNAVAILABLE

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

V = TypeVar("V")


def digest(*parts: str) -> str:
    """A digest standing for `parts` (a session id, a caller's credentials): what is kept
    instead of them, in memory and in Redis."""
    text = "\n".join(parts).encode("utf-8", "surrogateescape")
    return hashlib.blake2b(text, digest_size=16).hexdigest()


class Recent(Generic[V]):
    """At most `limit` values by key, each forgotten `idle` seconds after its last use; when
    full, the least recently used goes first."""

    def __init__(self, limit: int, idle: float, clock: Clock) -> None:
        self.limit = limit
        self.idle = idle
        self.clock = clock
        self._items: OrderedDict[str, tuple[V, float]] = OrderedDict()

    def get(self, key: str) -> V | None:
        """The value, now used again; None when there is none or it idled out."""
        item = self._items.get(key)
        if item is None:
            return None
        now = self.clock.now()
        if now - item[1] > self.idle:
            del self._items[key]
            return None
        self._items[key] = (item[0], now)
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: str, value: V) -> None:
        self._items[key] = (value, self.clock.now())
        self._items.move_to_end(key)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def pop(self, key: str) -> V | None:
        item = self._items.pop(key, None)
        return None if item is None else item[0]

    def __len__(self) -> int:
        return len(self._items)


# KEYS[1]: a session's owner. ARGV: the asking caller's digest, the idle limit in seconds.
# The owner the key holds (its idle time starts again), or, for a session no replica knows,
# the caller, now bound: one round trip, on any Redis version.
_OWNER_SCRIPT = """
local owner = redis.call('GET', KEYS[1])
if owner then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return owner
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return ARGV[1]
"""


class SessionOwners:
    """The owner of each session of one MCP route (`bind` when the server opens one, `allows`
    on every request naming one, `forget` when it ends).

    A session this replica does not know (opened before a restart, idled out here, or on
    another replica while Redis was down) belongs to the first caller that uses it: the proxy
    cannot know who opened it, and refusing would end every session at each restart.
    """

    def __init__(
        self, route: str, limit: int, idle: float, clock: Clock, redis: RedisLink | None = None
    ) -> None:
        self.route = route
        self.clock = clock
        self.idle = idle
        self.ttl = max(1, math.ceil(idle))
        # session digest -> (owner digest, when Redis's copy was last given its full idle time)
        self.local: Recent[tuple[str, float]] = Recent(limit, idle, clock)
        self.redis = redis
        self._owner = redis.client.register_script(_OWNER_SCRIPT) if redis else None

    def _key(self, session_id: str) -> str:
        return digest(self.route, session_id)

    def _redis_key(self, key: str) -> str:
        assert self.redis is not None
        return self.redis.key("mcp-session", self.route, key)

    async def bind(self, session_id: str, client: str) -> None:
        """`client` opened `session_id`: from now on only it may use or end the session."""
        key, owner = self._key(session_id), digest(client)
        self.local.put(key, (owner, self.clock.now()))
        if self.redis is not None:
            name = self._redis_key(key)
            await self.redis.run(lambda r: r.set(name, owner, ex=self.ttl))

    async def allows(self, session_id: str, client: str) -> bool:
        """Whether `client` may use `session_id`: it opened it, or the session is unknown (and
        from now on it is this caller's)."""
        key, caller = self._key(session_id), digest(client)
        known = self.local.get(key)
        now = self.clock.now()
        if known is not None and (self.redis is None or now - known[1] < self.idle / 4):
            return known[0] == caller
        owner = caller if known is None else known[0]
        if self.redis is not None and self._owner is not None:
            # Unknown here, or time to give Redis's copy its idle time again.
            script, keys = self._owner, (self._redis_key(key),)
            shared = await self.redis.run(
                lambda r: script(keys=keys, args=(owner, self.ttl), client=r)
            )
            if shared is not UNAVAILABLE:
                owner = shared.decode() if isinstance(shared, bytes) else str(shared)
        self.local.put(key, (owner, now))
        return owner == caller

    async def forget(self, session_id: str) -> None:
        """The session ended (DELETE, or the server no longer knows it)."""
        key = self._key(session_id)
        self.local.pop(key)
        if self.redis is not None:
            name = self._redis_key(key)
            await self.redis.run(lambda r: r.delete(name))

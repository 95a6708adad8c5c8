"""Daily request quotas per client, counted by every replica together through Redis.

`day_window` is the rule (a UTC day, and how long until it ends), `MemoryQuotas` and
`RedisQuotas` keep the counts, `DailyQuota` spends a client's requests and refuses past its limit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from policies.core.clock import Clock
from policies.core.errors import QuotaExceeded
from policies.core.shared import LATE, UNAVAILABLE

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

DAY = 86_400


@dataclass(frozen=True, slots=True)
class Usage:
    """A client's count for the current day, this request included, and the seconds until the
    day ends and the count starts again from 0."""

    used: int
    resets_in: float


def day_window(wall: float) -> tuple[int, float]:
    """The UTC day of `wall` (Unix seconds), as days since the epoch, and the seconds left in it."""
    day = math.floor(wall / DAY)
    return day, (day + 1) * DAY - wall


def until_text(seconds: float) -> str:
    """A wait of up to a day as an agent reads it: 5h 12m, 12m 3s, 40s."""
    total = max(1, math.ceil(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s" if minutes else f"{secs}s"


class QuotaStore(Protocol):
    """Where the day's counts live (one store per process, chosen at start-up)."""

    async def spend(self, client: str, cost: int) -> Usage:
        """Add `cost` to `client`'s count for today; the count after it."""
        ...


class MemoryQuotas:
    """Counts in this process: the store without Redis, and the fallback while Redis is down.

    A fallback count goes on from the last count Redis gave, so an outage does not hand every
    client a fresh day. One entry per client name (only configured clients with a quota are
    counted).
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._counts: dict[str, tuple[int, int]] = {}  # client -> (day, used)

    def take(self, client: str, cost: int) -> Usage:
        """`spend` without the await."""
        day, resets_in = day_window(self.clock.wall())
        counted_day, used = self._counts.get(client, (day, 0))
        used = (used if counted_day == day else 0) + cost
        self._counts[client] = (day, used)
        return Usage(used, resets_in)

    async def spend(self, client: str, cost: int) -> Usage:
        return self.take(client, cost)

    def observe(self, client: str, used: int) -> None:
        """Remember the shared count Redis just answered."""
        day, _ = day_window(self.clock.wall())
        self._counts[client] = (day, used)


# The day is Redis's (TIME), so every replica turns the page at the same instant whatever its
# own clock says; the key expires when its day ends. Lua numbers returned to Redis are truncated
# to integers: both values are whole numbers already.
SPEND_SCRIPT = """
-- KEYS[1]: the client's count, a hash {day, used}. ARGV: cost, not-after ms (0: none).
-- Returns {used, ms left in the day}, or {-1} when the caller gave up before this ran
-- (a late run must not count a request twice: the caller counted it in-process).
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local not_after = tonumber(ARGV[2])
if not_after > 0 and now_ms > not_after then return {-1} end
local day = math.floor(tonumber(t[1]) / 86400)
if redis.call('HGET', KEYS[1], 'day') ~= tostring(day) then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'day', tostring(day))
  redis.call('EXPIREAT', KEYS[1], (day + 1) * 86400)
end
local used = redis.call('HINCRBY', KEYS[1], 'used', tonumber(ARGV[1]))
return {used, (day + 1) * 86400000 - now_ms}
"""


class RedisQuotas:
    """Counts shared by every replica: one EVALSHA per request, in-process while Redis is down.

    What a replica counted while Redis could not (down, or a script that refused to run late)
    is owed to the shared count and added, once, with its next request that reaches Redis:
    an outage neither loses those requests nor counts them twice.
    """

    def __init__(self, link: RedisLink, clock: Clock) -> None:
        self.link = link
        self.clock = clock
        self.local = MemoryQuotas(clock)
        self._spend = link.client.register_script(SPEND_SCRIPT)
        self._owed: dict[str, tuple[int, int]] = {}  # client -> (day, requests not yet shared)

    def key(self, client: str) -> str:
        """The Redis key of `client`'s count."""
        return self.link.key("quota", client)

    async def spend(self, client: str, cost: int) -> Usage:
        keys = (self.key(client),)
        day, _ = day_window(self.clock.wall())
        owed_day, owed = self._owed.get(client, (day, 0))
        total = cost + (owed if owed_day == day else 0)  # yesterday's debt went with its day
        result = await self.link.run(
            lambda r: self._spend(keys=keys, args=(total, self.link.not_after()), client=r)
        )
        if result is not UNAVAILABLE and result[0] == LATE:
            self.link.resync()  # we were still waiting: our idea of Redis's clock is off
            result = UNAVAILABLE
        if result is UNAVAILABLE:
            self._owed[client] = (day, total)
            return self.local.take(client, cost)
        self._owed.pop(client, None)
        used, left_ms = int(result[0]), int(result[1])
        self.local.observe(client, used)
        return Usage(used, left_ms / 1000)


def quota_store(clock: Clock, link: RedisLink | None) -> QuotaStore:
    """Shared through Redis when a link is configured, else in-process."""
    return MemoryQuotas(clock) if link is None else RedisQuotas(link, clock)


class DailyQuota:
    """Counts each client's requests per UTC day and refuses those past its limit.

    `limits` maps a client name to its requests per day; a client without one is not counted.
    """

    def __init__(self, limits: Mapping[str, int], store: QuotaStore) -> None:
        self.limits = dict(limits)
        self.store = store

    async def spend(self, client: str, cost: int = 1) -> Usage | None:
        """Count `cost` requests of `client`'s day (None: it has no quota). Raises
        QuotaExceeded, with the time until the day ends, once the count passes the limit."""
        limit = self.limits.get(client)
        if limit is None:
            return None
        usage = await self.store.spend(client, cost)
        if usage.used > limit:
            raise QuotaExceeded(
                f"client {client!r} has used its daily quota of {limit} requests (search-proxy's "
                "quota for this client, not the vendor's plan); it resets at 00:00 UTC, in "
                f"{until_text(usage.resets_in)}; retry then",
                retry_after_s=usage.resets_in,
            )
        return usage

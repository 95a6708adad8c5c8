"""The one Redis connection that shared state (buckets, breakers, cache) goes through.

Redis is an optimisation, never a dependency: every call has a tight timeout, a failure marks
the link down for `retry_interval` (callers use their in-process state meanwhile), and the
first call after that probes again, so recovery needs no operator.

A command that timed out may still sit in a stalled Redis's input buffer and run when it wakes,
after its caller moved on. Scripts whose late run would do harm (taking a fetch lock, a token,
a breaker probe slot) take `not_after()` and refuse to act past it, on Redis's own clock.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import structlog
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from policies.core.clock import SYSTEM_CLOCK, Clock
from policies.core.events import Events, NullEvents

T = TypeVar("T")
log = structlog.get_logger("search_proxy.redis")


class _Unavailable(enum.Enum):
    """Returned instead of a value when Redis could not be used; callers fall back.

    An enum member, so `if value is UNAVAILABLE: return` narrows the type for the checker.
    """

    UNAVAILABLE = "UNAVAILABLE"

    def __repr__(self) -> str:
        return "UNAVAILABLE"


UNAVAILABLE: Final = _Unavailable.UNAVAILABLE

# How often the offset between our clock and Redis's is measured again (clocks drift or step).
OFFSET_MAX_AGE = 60.0
# Slack on `not_after` for the offset's own error (half a round trip when it was measured).
_LATE_MARGIN = 0.05

# A script's answer meaning "not done: past not_after, the caller has given up". A caller that
# still receives it was not late: the clock offset is wrong (`resync`).
LATE: Final = -1

# The Lua lines that end a script with LATE once Redis's clock is past ARGV[i] (ms; 0 = unknown).
LATE_GUARD_LUA: Final = """
local function too_late(not_after)
  local limit = tonumber(not_after)
  if limit == nil or limit <= 0 then return false end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000 > limit
end
"""


class RedisLink:
    """A redis.asyncio client with tight timeouts and an up/down state shared by all stores."""

    def __init__(
        self,
        url: str,
        key_prefix: str,
        *,
        timeout: float = 0.1,
        retry_interval: float = 1.0,
        events: Events | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        # redis-py's defaults (5 s timeouts, 10 retries) stall a request for seconds against a
        # dead server; 100 ms and one retry fail in milliseconds. The retry covers a pooled
        # connection a restarted Redis dropped; never a timeout, whose command may still run,
        # so resending it would queue it twice.
        self.client: Redis = Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            health_check_interval=0,
        )
        self.prefix = key_prefix
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.events = events or NullEvents()
        self.clock = clock
        self._up = True
        self._next_probe = 0.0
        self._offset: float | None = None  # Redis TIME minus the real monotonic clock
        self._offset_at = 0.0

    def key(self, *parts: str) -> str:
        """A namespaced key: `<prefix>:<part>:<part>`."""
        return ":".join((self.prefix, *parts))

    @property
    def up(self) -> bool:
        return self._up

    def usable(self) -> bool:
        """Whether to try Redis now: always when up, once per retry_interval when down."""
        return self._up or self.clock.now() >= self._next_probe

    @property
    def gives_up_after(self) -> float:
        """Seconds `run` waits for an answer before its caller moves on."""
        return self.timeout * 3

    def not_after(self) -> int:
        """Redis-clock milliseconds past which a command sent now has no caller waiting for it
        (0 while the clock offset is unknown: no limit)."""
        if self._offset is None:
            return 0
        limit = SYSTEM_CLOCK.now() + self._offset + self.gives_up_after + _LATE_MARGIN
        return int(limit * 1000)

    def resync(self) -> None:
        """Measure the clock offset again before the next command (a script said LATE to a
        caller that was still waiting)."""
        self._offset = None

    async def run(self, op: Callable[[Redis], Awaitable[T]]) -> T | _Unavailable:
        """Run `op` against Redis, or return UNAVAILABLE at once when Redis is down."""
        if not self.usable():
            return UNAVAILABLE
        if not self._up:
            # One probe per interval, not a stampede of every waiting request.
            self._next_probe = self.clock.now() + self.retry_interval
        try:
            async with asyncio.timeout(self.gives_up_after):
                if self._offset is None or SYSTEM_CLOCK.now() - self._offset_at > OFFSET_MAX_AGE:
                    await self._measure_offset()
                value = await op(self.client)
        except (RedisError, OSError, TimeoutError) as exc:
            self.mark_down(exc)
            return UNAVAILABLE
        self.mark_up()
        return value

    async def _measure_offset(self) -> None:
        # Against the real clock, whatever clock the link was given: Redis's TIME is real time.
        sent = SYSTEM_CLOCK.now()
        seconds, micros = await self.client.time()
        received = SYSTEM_CLOCK.now()
        self._offset = seconds + micros / 1_000_000 - (sent + received) / 2
        self._offset_at = received

    def mark_down(self, exc: BaseException) -> None:
        """Record a failed call; logs and reports only the transition."""
        self._next_probe = self.clock.now() + self.retry_interval
        self._offset = None  # what answers next may be another Redis
        if self._up:
            self._up = False
            log.warning("redis_unreachable", error=type(exc).__name__, detail=str(exc)[:200])
            self.events.redis_state(False)

    def mark_up(self) -> None:
        """Record a successful call; logs and reports only the transition."""
        if not self._up:
            self._up = True
            log.info("redis_recovered")
            self.events.redis_state(True)

    async def ping(self) -> bool:
        """A direct reachability check (readiness), not gated by the down interval."""
        try:
            async with asyncio.timeout(self.timeout * 3):
                await self.client.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            self.mark_down(exc)
            return False
        self.mark_up()
        return True

    async def close(self) -> None:
        await self.client.aclose()

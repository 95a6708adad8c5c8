"""The one Redis connection that shared state (buckets, breakers, cache) goes through.

Redis is an optimisation, never a dependency: every call has a tight timeout, a failure marks
the link down for `retry_interval` (callers use their in-process state meanwhile), and the
first call after that probes again, so recovery needs no operator.
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
        # dead server; 100 ms and one retry fail in milliseconds.
        self.client: Redis = Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1),
            health_check_interval=0,
        )
        self.prefix = key_prefix
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.events = events or NullEvents()
        self.clock = clock
        self._up = True
        self._next_probe = 0.0

    def key(self, *parts: str) -> str:
        """A namespaced key: `<prefix>:<part>:<part>`."""
        return ":".join((self.prefix, *parts))

    @property
    def up(self) -> bool:
        return self._up

    def usable(self) -> bool:
        """Whether to try Redis now: always when up, once per retry_interval when down."""
        return self._up or self.clock.now() >= self._next_probe

    async def run(self, op: Callable[[Redis], Awaitable[T]]) -> T | _Unavailable:
        """Run `op` against Redis, or return UNAVAILABLE at once when Redis is down."""
        if not self.usable():
            return UNAVAILABLE
        if not self._up:
            # One probe per interval, not a stampede of every waiting request.
            self._next_probe = self.clock.now() + self.retry_interval
        try:
            async with asyncio.timeout(self.timeout * 3):
                value = await op(self.client)
        except (RedisError, OSError, TimeoutError) as exc:
            self.mark_down(exc)
            return UNAVAILABLE
        self.mark_up()
        return value

    def mark_down(self, exc: BaseException) -> None:
        """Record a failed call; logs and reports only the transition."""
        self._next_probe = self.clock.now() + self.retry_interval
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

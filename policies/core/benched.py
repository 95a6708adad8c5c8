"""Names benched until a wall-clock time, here and with Redis for every replica: a vendor whose
plan is spent or who paused the whole route (failover), one key of a route's pool (key pools).
The hot path reads memory; Redis is asked at most once a second per name."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from policies.core.clock import Clock
from policies.core.shared import UNAVAILABLE

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

# How often a replica asks Redis whether another replica benched a name.
REFRESH_S = 1.0
# A vendor's reset hint may say anything; a day covers daily quotas.
MAX_BENCH_S = 86_400.0
# A spent plan (a key's, a vendor's) stays benched this long when the vendor gives no reset.
EXHAUSTED_FOR_S = 600.0
# Names benched at once, here: a route that passes its agents' own keys benches one per caller,
# and callers are as many as the keys agents send. Past it, those whose time is past go, then
# the caller benched longest ago (a route's or a pool key's, a configured few, stay).
MAX_BENCHED = 10_000


def bench_seconds(retry_after: float | None, default: float) -> float:
    """How long a spent plan stays benched: the vendor's reset hint (Retry-After, in seconds,
    at most MAX_BENCH_S when marked), else `default`."""
    return retry_after if retry_after is not None and retry_after > 0 else default


class Benched:
    """Which names are benched, until when (wall seconds) and why (a few words)."""

    def __init__(self, clock: Clock, link: RedisLink | None = None) -> None:
        self.clock = clock
        self.link = link
        self._until: dict[str, float] = {}  # names benched here, until when; none past it
        self._why: dict[str, str] = {}
        self._callers: dict[str, None] = {}  # which of them are callers', oldest first
        # name -> clock.now() of its last Redis read, oldest first; only the last REFRESH_S's.
        self._asked: dict[str, float] = {}

    def _redis_key(self, name: str) -> str:
        assert self.link is not None
        return self.link.key("exhausted", name)

    async def mark(self, name: str, seconds: float, why: str = "", *, caller: bool = False) -> None:
        """Bench `name` (a caller's own key: `caller`) for `seconds` (at most MAX_BENCH_S); a
        shorter bench than the one in force changes nothing here."""
        seconds = min(seconds, MAX_BENCH_S)
        until = self.clock.wall() + seconds
        if until > self._until.get(name, 0.0):
            self._keep(name, until, why, caller)
        if self.link is not None:
            # The value is the end (wall seconds), so every replica reads one deadline; the
            # key's own expiry only clears it away afterwards.
            key, px = self._redis_key(name), max(1, math.ceil(seconds * 1000))
            value = f"{until:.3f} {why}".rstrip()
            await self.link.run(lambda r: r.set(key, value, px=px))

    async def remaining(self, name: str, *, caller: bool = False) -> float:
        """Seconds `name` (a caller's own key: `caller`) stays benched (0 when it is not)."""
        now = self.clock.wall()
        until = self._until.get(name)
        if until is not None:
            if until > now:
                return until - now
            self._forget(name)
        if self.link is None or not self._due(name):
            return 0.0
        key = self._redis_key(name)
        raw = await self.link.run(lambda r: r.get(key))
        if raw is UNAVAILABLE or raw is None:
            return 0.0
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        until_text, _, why = text.partition(" ")
        try:
            until = float(until_text)
        except ValueError:
            return 0.0
        if until <= now:
            return 0.0
        self._keep(name, until, why, caller)
        return until - now

    def _keep(self, name: str, until: float, why: str, caller: bool) -> None:
        benched = self._until
        if name in benched:  # to the end: at the cap, the one benched longest ago goes first
            self._forget(name)
        elif len(benched) >= MAX_BENCHED:
            now = self.clock.wall()
            for past in [n for n, end in benched.items() if end <= now]:
                self._forget(past)
            if len(benched) >= MAX_BENCHED:  # a caller goes first: they are the many
                self._forget(next(iter(self._callers or benched)))
        benched[name], self._why[name] = until, why
        if caller:
            self._callers[name] = None

    def _forget(self, name: str) -> None:
        del self._until[name], self._why[name]
        self._callers.pop(name, None)

    def _due(self, name: str) -> bool:
        """Whether Redis is to be asked about `name` now (at most once per REFRESH_S), noted
        as asked if so."""
        now, asked = self.clock.now(), self._asked
        if now - asked.get(name, -math.inf) < REFRESH_S:
            return False
        asked.pop(name, None)  # to the end: the oldest stay first
        while asked and now - next(iter(asked.values())) >= REFRESH_S:
            del asked[next(iter(asked))]
        asked[name] = now
        return True

    def why(self, name: str) -> str:
        """Why `name` was benched, as the last `mark` or Redis read said ("" if unknown)."""
        return self._why.get(name, "")

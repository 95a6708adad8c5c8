"""Active probes: while the circuit is not closed, one replica at a time sends the operator's
probe every `probe.every`, and a healthy answer closes the circuit before half-open is due."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog

from policies.breaker.config import ProbeConfig
from policies.breaker.machine import Change, Circuit
from policies.breaker.snapshot import CLOSED
from policies.core.clock import Clock
from policies.core.errors import ProxyError
from policies.core.events import Events
from policies.core.shared import UNAVAILABLE

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

log = structlog.get_logger("search_proxy.breaker")

# Sends the route's configured probe and returns the vendor's status, or raises a ProxyError when
# no answer came. The server builds it around the route's upstream: policies do no I/O of their own.
ProbeSender = Callable[[], Awaitable[int]]


class ProbeLease:
    """Which replica sends the next probe: the first to SET NX the lease, which then stands for
    one interval, so the fleet sends one probe per interval."""

    def __init__(self, link: RedisLink, route: str) -> None:
        self._link = link
        self.key = link.key("breaker", f"{{{route}}}", "active-probe")
        self._tokens = itertools.count()
        self._instance = secrets.token_hex(6)

    async def take(self, seconds: float) -> bool:
        """Whether this replica sends the next probe; when Redis cannot be asked each replica
        probes on its own."""
        token = f"{self._instance}:{next(self._tokens)}"
        ms = max(1, int(seconds * 1000))
        taken = await self._link.run(lambda r: r.set(self.key, token, nx=True, px=ms))
        return True if taken is UNAVAILABLE else bool(taken)


class ActiveProbe:
    """The probe loop of one route's circuit; `running` while its breaker runs."""

    def __init__(
        self,
        route: str,
        probe: ProbeConfig,
        send: ProbeSender,
        circuit: Circuit,
        clock: Clock,
        events: Events,
        changed: Callable[[], Awaitable[None]],
        apply: Callable[[Change], None],
        lease: ProbeLease | None,
    ) -> None:
        self._route = route
        self._probe = probe
        self._send = send
        self._circuit = circuit
        self._clock = clock
        self._events = events
        self._changed = changed  # returns at the circuit's next change
        self._apply = apply  # the side effects of the close a healthy answer makes
        self._lease = lease  # None without Redis: every replica probes
        self.running = False

    def start(self) -> asyncio.Task[None]:
        self.running = True
        return asyncio.create_task(self._run(), name=f"breaker-probe-{self._route}")

    def stop(self) -> None:
        """Let the loop end (its task is cancelled by the owner)."""
        self.running = False

    def may_close(self) -> bool:
        """Whether a probe may close the circuit before its opening ends."""
        return self.running and self._circuit.probe_trusted

    async def _run(self) -> None:
        """Probe while the circuit is not closed and probes are trusted, until `running` ends."""
        circuit, every = self._circuit, self._probe.every
        while self.running:
            if circuit.state == CLOSED or not circuit.probe_trusted:
                await self._changed()
                continue
            await self._clock.sleep(every)  # the vendor just failed: give it a moment
            if circuit.state == CLOSED or not circuit.probe_trusted:
                continue
            if self._lease is not None and not await self._lease.take(every):
                continue  # another replica sends this one
            try:
                status = await self._send()
            except ProxyError as exc:
                healthy, answer = False, exc.reason
            else:
                healthy, answer = self._probe.healthy(status), str(status)
            self._events.breaker_probe(self._route, "ok" if healthy else "failed")
            if not healthy:
                continue
            change = circuit.close_by_probe(self._clock.now(), self._clock.wall())
            if change.entered is not None:
                log.info("breaker_closed_by_probe", route=self._route, answer=answer)
                self._apply(change)

"""Admitting a request the circuit does not pass at once: waiting for its slow-start place, for the
end of an opening or a probe's verdict (up to max_wait, half of what the deadline leaves), and
taking a half-open probe's place here and one of the fleet's probe slots."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from policies.breaker.fleet import Fleet, SlotGrant
from policies.breaker.machine import Change, Circuit
from policies.breaker.snapshot import CLOSED, HALF_OPEN, OPEN
from policies.core.clock import Clock
from policies.core.errors import CircuitOpen, seconds_text
from policies.core.flow import Flow

# Slow-start places: the golden-ratio sequence spreads any number of requests evenly over [0, 1).
_GOLDEN: Final = (math.sqrt(5) - 1) / 2

# Float sums of a clock and a wait land a few ulps off: a place this close is reached.
_EPSILON: Final = 1e-9

# A request waiting for a fleet-wide probe slot looks again this often: a slot freed on another
# replica without a decision (a tolerated failure) announces itself to nobody.
_SLOT_POLL: Final = 0.25


class Waiters:
    """The requests and loops waiting for the circuit to change (a transition, a freed probe
    place), woken together by `announce`."""

    def __init__(self) -> None:
        self._next: asyncio.Future[None] | None = None

    def next(self) -> asyncio.Future[None]:
        """A future the next change resolves (shared by everyone waiting for it)."""
        if self._next is None or self._next.done():
            self._next = asyncio.get_running_loop().create_future()
        return self._next

    async def wait(self) -> None:
        """Return at the next change (leaving the shared future alone if cancelled)."""
        await asyncio.wait((self.next(),))

    def announce(self) -> None:
        """The circuit changed: wake everyone waiting."""
        change, self._next = self._next, None
        if change is not None and not change.done():
            change.set_result(None)


@dataclass(frozen=True, slots=True)
class Ticket:
    """An admitted request: the epoch its outcome counts in, and whether it is a probe."""

    epoch: int
    probe: bool = False
    slot: SlotGrant | None = None  # the fleet's probe slot it holds, to free when it ends


class Admission:
    """Admits requests to one route's circuit, or refuses them with CircuitOpen."""

    def __init__(
        self,
        route: str,
        circuit: Circuit,
        clock: Clock,
        waiters: Waiters,
        apply: Callable[[Change], None],
        fleet: Fleet | None,
        probing: Callable[[], bool],
    ) -> None:
        self._route = route
        self._circuit = circuit
        self._clock = clock
        self._waiters = waiters
        self._apply = apply  # the side effects of the half-open transition an arrival makes
        self._fleet = fleet
        self._probing = probing  # whether an active probe may close the circuit sooner
        self._place = 0.0  # the last slow-start place handed out

    async def admit(self, flow: Flow) -> Ticket:
        """Admit the request: as a probe while half-open, else once closed. Waits while the
        circuit may admit it within the request's allowance; raises CircuitOpen otherwise."""
        circuit, config = self._circuit, self._circuit.config
        hold_until: float | None = None  # when waiting for an open circuit stops
        place: float | None = None  # the request's place in a slow-start ramp
        while True:
            now = self._clock.now()
            state = circuit.state
            if state == CLOSED:
                if place is None:
                    place = self._place = (self._place + _GOLDEN) % 1.0
                delay = circuit.slow_start_wait(place, now)
                if delay <= _EPSILON:
                    flow.trace.breaker = CLOSED
                    return Ticket(circuit.epoch)
                # The ramp must leave the call itself at least as much time as it takes, and
                # wait no longer than a fallback would take to answer (wait_at_most).
                if delay > min((flow.context.deadline - now) / 2, flow.context.wait_at_most):
                    raise self._ramp_refusal(flow, delay)
                await self._pause(flow, delay)
                continue
            if hold_until is None:
                allowed = min(config.max_wait, (flow.context.deadline - now) / 2)
                hold_until = now + max(0.0, min(allowed, flow.context.wait_at_most))
            left = hold_until - now
            if state == OPEN:
                until = circuit.seconds_until_half_open(now)
                if until <= 0:
                    self._apply(circuit.half_open(now))
                    continue
                # Only the end of the opening, or an active probe, can admit it sooner; with a
                # fallback to ask (a finite wait_at_most), hoping for a probe is not worth it.
                hoping = self._probing() and math.isinf(flow.context.wait_at_most)
                if left <= 0 or (until > left and not hoping):
                    raise self._refusal(flow, until)
                await self._pause(flow, min(until, left))
                continue
            epoch = circuit.begin_probe()
            if epoch is not None:
                grant = SlotGrant(True)
                if self._fleet is not None:
                    try:
                        grant = await self._fleet.acquire_probe()
                    except asyncio.CancelledError:
                        circuit.end_probe(epoch)  # the agent left; a slot taken meanwhile lapses
                        raise
                    if epoch != circuit.epoch:
                        # Another probe or replica decided while we waited on Redis: look again.
                        if grant.key is not None:
                            self._fleet.release(grant)
                        continue
                    if not grant.admitted:
                        circuit.end_probe(epoch)
                if grant.admitted:
                    flow.trace.breaker = HALF_OPEN
                    # Without a key Redis is unreachable, and the local gate decides alone.
                    return Ticket(epoch, True, grant if grant.key is not None else None)
                left = hold_until - self._clock.now()
            if left <= 0:
                raise self._refusal(flow, 1.0)
            await self._pause(flow, left if self._fleet is None else min(left, _SLOT_POLL))

    def leave(self, ticket: Ticket) -> None:
        """The admitted request is done: a probe gives back its place and its slot."""
        if not ticket.probe:
            return
        if self._circuit.end_probe(ticket.epoch):
            self._waiters.announce()  # a waiting request may take the freed place
        if ticket.slot is not None and self._fleet is not None:
            self._fleet.release(ticket.slot)

    async def _pause(self, flow: Flow, seconds: float) -> None:
        """Wait up to `seconds` on our clock, or until the circuit changes."""
        started = self._clock.now()
        change = self._waiters.next()
        sleep = self._clock.timer(seconds)
        try:
            await asyncio.wait((sleep, change), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleep.cancel()
            waited = self._clock.now() - started
            flow.trace.waited_seconds += waited
            flow.context.waited(waited)

    def _refusal(self, flow: Flow, retry_after: float) -> CircuitOpen:
        flow.trace.breaker = OPEN
        failures = self._circuit.failures
        cause = f" after {failures} consecutive failure{'s' if failures != 1 else ''}"
        if self._circuit.state == HALF_OPEN:
            what = f"circuit open{cause if failures else ''}, a recovery probe is in flight"
        else:
            what = f"circuit open{cause if failures else ''}"
        return CircuitOpen(
            f"{self._route}: {what}; retry in {seconds_text(retry_after)}",
            route=self._route,
            attempts=flow.trace.attempts,
            retry_after_s=retry_after,
            headers={"X-Circuit": "open"},
        )

    def _ramp_refusal(self, flow: Flow, retry_after: float) -> CircuitOpen:
        flow.trace.breaker = "slow_start"
        return CircuitOpen(
            f"{self._route}: the vendor just recovered and traffic returns gradually over "
            f"{seconds_text(self._circuit.config.slow_start)}; retry in "
            f"{seconds_text(retry_after)}",
            route=self._route,
            attempts=flow.trace.attempts,
            retry_after_s=retry_after,
            headers={"X-Circuit": "slow-start"},
        )

"""The breaker policy: admits each request to its route's circuit, counts the vendor's answer, and
runs the circuit's side effects (events, waking waiters, sharing) and background tasks."""

from __future__ import annotations

import asyncio
import secrets
from contextvars import ContextVar
from dataclasses import replace
from typing import TYPE_CHECKING

from policies.breaker.admission import Admission, Ticket, Waiters
from policies.breaker.config import SECTION, BreakerConfig, ProbeConfig, vendor_probe
from policies.breaker.fleet import Fleet, RedisBreakerState
from policies.breaker.machine import Change, Circuit
from policies.breaker.probe import ActiveProbe, ProbeLease, ProbeSender
from policies.breaker.snapshot import CLOSED
from policies.core.clock import SYSTEM_CLOCK, Clock
from policies.core.credentials import injects_key
from policies.core.errors import VendorFailure
from policies.core.events import Events, NullEvents
from policies.core.flow import Flow, Handler, Reply
from policies.core.outcome import Outcome
from policies.core.section import Build, Link, SideRequest

if TYPE_CHECKING:  # the link loads redis-py: imported where Redis is configured
    from policies.core.redislink import RedisLink

# The breaker and epoch that admitted the request running in this context: `halts_retries` is
# asked from inside the request (the retry loop), and only a probe may retry while half-open.
_ADMITTED: ContextVar[tuple[Breaker, int] | None] = ContextVar("breaker_admitted", default=None)


class Breaker:
    """Fails fast with CircuitOpen while the route's vendor is unwell.

    The circuit (machine.Circuit) decides; around it, a request that would be refused waits
    instead, up to `max_wait` and at most half of what its deadline leaves, and after a close
    waits for its place in the slow-start ramp (admission); with Redis the circuit is shared by
    every replica (fleet); with `probe` and a `send_probe`, one replica at a time probes the
    vendor while the circuit is not closed (probe).

    Call `start()` to run the background tasks (Redis sync, active probes) and `stop()` at
    shutdown.
    """

    def __init__(
        self,
        route: str,
        config: BreakerConfig,
        clock: Clock = SYSTEM_CLOCK,
        events: Events | None = None,
        link: RedisLink | None = None,
        *,
        probe_lease: float = 30.0,
        sync_interval: float = 1.0,
        send_probe: ProbeSender | None = None,
    ) -> None:
        self.route = route
        self.config = config
        self._clock = clock
        self._events = events or NullEvents()
        self._circuit = Circuit(config, origin=secrets.token_hex(6))
        self._waiters = Waiters()
        self._fleet = None
        if link is not None:
            shared = RedisBreakerState(link, route, config.half_open_probes, probe_lease)
            self._fleet = Fleet(route, shared, self._circuit, clock, self._apply, sync_interval)
        self._probe = None
        if send_probe is not None and isinstance(config.probe, ProbeConfig):
            lease = ProbeLease(link, route) if link is not None else None
            self._probe = ActiveProbe(
                route,
                config.probe,
                send_probe,
                self._circuit,
                clock,
                self._events,
                self._waiters.wait,
                self._apply,
                lease,
            )
        self._admission = Admission(
            route, self._circuit, clock, self._waiters, self._apply, self._fleet, self._probing
        )
        self._running = False
        self._tasks: list[asyncio.Task[None]] = []
        self._since = clock.now()  # when the circuit entered its current state

    @property
    def state(self) -> str:
        """closed, half_open or open."""
        return self._circuit.state

    @property
    def level(self) -> int:
        """Consecutive openings so far (0 once a request got through the closed circuit)."""
        return self._circuit.level

    def halts_retries(self) -> bool:
        """Whether the request being handled should stop retrying: the circuit is open, or it
        is half-open and the request is not one of its probes (it was admitted before the trip;
        with short openings its retry would otherwise land as an extra, ungated probe), or is
        one while an active probe watches the vendor (the probe tells recovery: a trial is one
        search, not one per retry)."""
        admitted = _ADMITTED.get()
        epoch = admitted[1] if admitted is not None and admitted[0] is self else None
        if self._circuit.state != CLOSED and self._probing():
            return True
        return self._circuit.halts_retries(epoch)

    def seconds_in_state(self) -> float:
        """Seconds since the circuit entered its current state (or since it was built)."""
        return max(0.0, self._clock.now() - self._since)

    def seconds_until_half_open(self) -> float:
        """Seconds until an open circuit admits a probe; 0 when it is not open."""
        return self._circuit.seconds_until_half_open(self._clock.now())

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        """Refuse while open; otherwise call on and count the outcome."""
        circuit = self._circuit
        ticket: Ticket | None = None
        if circuit.passes_freely():
            flow.trace.breaker = CLOSED
            epoch = circuit.epoch
        else:
            ticket = await self._admission.admit(flow)
            epoch = ticket.epoch
        admitted = _ADMITTED.set((self, epoch))
        try:
            reply = await call_next(flow)
        except VendorFailure:
            # Our own refusals and the agent's faults are no evidence about the vendor: they
            # neither count nor reset the count; nor does a request testing injected faults.
            if not flow.context.fault_test:
                self._record(epoch, failed=True)
            raise
        finally:
            _ADMITTED.reset(admitted)
            if ticket is not None:
                self._admission.leave(ticket)
        if not flow.context.fault_test:
            self._record(epoch, failed=Outcome.of_status(reply.status).is_vendor_failure)
        return reply

    async def start(self) -> None:
        """Start the background tasks; returns once subscribed to the shared state (or Redis
        found down)."""
        if self._running:
            return
        self._running = True
        if self._probe is not None:
            self._tasks.append(self._probe.start())
        if self._fleet is not None:
            self._tasks += await self._fleet.start()

    async def stop(self) -> None:
        """Stop the background tasks, pushing a last unsynced transition if Redis allows."""
        self._running = False
        if self._probe is not None:
            self._probe.stop()
        if self._fleet is not None:
            self._fleet.stop()
        pending, self._tasks = set(self._tasks), []
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.5)
        if self._fleet is not None:
            await self._fleet.flush()

    async def reset(self) -> None:
        """Close the circuit (admin endpoint), here and for every replica: no slow start, and
        the next opening is a first one again."""
        self._apply(self._circuit.reset(self._clock.now(), self._clock.wall()))
        if self._fleet is not None:
            await self._fleet.flush()

    def _record(self, epoch: int, *, failed: bool) -> None:
        now, wall = self._clock.now(), self._clock.wall()
        self._apply(self._circuit.record(epoch, failed=failed, now=now, wall=wall))

    def _probing(self) -> bool:
        return self._probe is not None and self._probe.may_close()

    def _apply(self, change: Change) -> None:
        """Do what a change of the circuit calls for: report and announce a transition, and
        queue a local change for the other replicas."""
        if change.entered is not None:
            self._since = self._clock.now()
            self._events.breaker_transition(self.route, change.entered)
            self._waiters.announce()
        if change.share is not None and self._fleet is not None:
            self._fleet.publish()


def probe_sender(probe: ProbeConfig, send: SideRequest) -> ProbeSender:
    """The route's configured probe, sent through its upstream: the vendor's status."""
    body = probe.body.encode()

    async def sender() -> int:
        return await send(probe.method, probe.path, body)

    return sender


def build(cfg: BreakerConfig, route: Build) -> Breaker:
    r = route.route
    probe = cfg.probe
    if probe is None and route.profile is not None and _own_key(route):
        # The vendor's free call (Tavily's usage): recovery seen within a second, no credits.
        probe = vendor_probe(route.profile.health)
    cfg = replace(cfg, probe=probe or None)
    # A reload keeps the breaker (its state and background tasks) while its section and the
    # upstream it judges (and probes) are unchanged; the probe's headers are read when sent.
    breaker = route.keep(
        "breaker",
        (cfg, r.upstream, r.timeouts, r.max_response_bytes),
        lambda: Breaker(
            r.name,
            cfg,
            route.clock,
            route.events,
            route.redis,
            # A probe's fleet-wide slot lasts as long as the probe itself may.
            probe_lease=r.timeouts.total,
            send_probe=probe_sender(probe, route.side_request) if probe else None,
        ),
    )
    # The retry loop stops once the breaker opens: its retries would only hit a vendor known
    # to be down.
    route.halt_retries = breaker.halts_retries
    return breaker


def _own_key(route: Build) -> bool:
    """Whether the route calls its vendor with a key of its own (headers.set or keys): the
    probe goes with it, and without one the vendor's free call would only answer 401."""
    keys = route.route.section("keys")
    return injects_key(route.route.headers.set) or bool(keys and keys.keys)


LINK = Link("breaker", SECTION, build)

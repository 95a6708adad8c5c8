"""Circuit breakers per route: pybreaker's state machine on our clock, shared by replicas via Redis.

The hot path reads in-memory state only. Trips and closes are written to Redis in the background
(HSET + PUBLISH); a subscriber and a periodic read apply the other replicas' transitions. On top
of pybreaker: open periods that grow while the vendor stays down, half-open trials that survive
an unlucky probe, optional active probes, and a slow start after the circuit closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import secrets
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final, NamedTuple

import pybreaker
import structlog
from redis.exceptions import RedisError

from policies.breaker.config import RECORD_TTL, BreakerConfig
from policies.core.clock import SYSTEM_CLOCK, Clock
from policies.core.errors import CircuitOpen, ProxyError, VendorFailure, seconds_text
from policies.core.events import Events, NullEvents
from policies.core.flow import Flow, Handler, Reply
from policies.core.outcome import Outcome
from policies.core.redislink import LATE, LATE_GUARD_LUA, UNAVAILABLE, RedisLink

log = structlog.get_logger("search_proxy.breaker")

CLOSED: Final = "closed"
HALF_OPEN: Final = "half_open"
OPEN: Final = "open"
_NAMES: Final = {
    pybreaker.STATE_CLOSED: CLOSED,
    pybreaker.STATE_HALF_OPEN: HALF_OPEN,
    pybreaker.STATE_OPEN: OPEN,
}

# Consecutive openings past this say nothing more (the open time reached its maximum long ago);
# the cap keeps a garbled shared record from meaning anything absurd.
_MAX_LEVEL: Final = 1000
# Slow-start places: the golden-ratio sequence spreads any number of requests evenly over [0, 1).
_GOLDEN: Final = (math.sqrt(5) - 1) / 2

# Sends the route's configured probe and returns the vendor's status, or raises a ProxyError when
# no answer came. The server builds it around the route's upstream: policies do no I/O of their own.
ProbeSender = Callable[[], Awaitable[int]]


class Snapshot(NamedTuple):
    """A shared transition; across replicas the highest (since_us, origin) wins."""

    state: str  # closed | open; half-open is derived from opened_at by each replica
    since_us: int  # when the transition happened, unix microseconds
    opened_us: int  # when the circuit last opened, unix microseconds
    failures: int  # consecutive failures that opened it
    origin: str  # the replica that made the transition; breaks ties between equal times
    level: int = 0  # consecutive openings, which set the open time; 0 once a request got through

    def newer_than(self, other: Snapshot) -> bool:
        """Last writer wins, by wall time then origin, so every replica picks the same one."""
        return (self.since_us, self.origin) > (other.since_us, other.origin)

    def encode(self) -> str:
        """The pub/sub message: `state|since_us|opened_us|failures|origin|level`."""
        return (
            f"{self.state}|{self.since_us}|{self.opened_us}|{self.failures}|{self.origin}|"
            f"{self.level}"
        )


def parse_snapshot(data: bytes | str) -> Snapshot | None:
    """Decode a pub/sub message; None for anything malformed (never trust the wire).

    A message without the level (five fields: a replica from before open times adapted) has
    level 0.
    """
    if isinstance(data, bytes):
        data = data.decode("ascii", "replace")
    parts = data.split("|")
    if len(parts) not in (5, 6) or parts[0] not in (CLOSED, OPEN):
        return None
    try:
        level = int(parts[5]) if len(parts) == 6 else 0
        snap = Snapshot(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), parts[4], level)
    except ValueError:
        return None
    if not 0 <= snap.level <= _MAX_LEVEL:
        return None
    return snap


def snapshot_from_hash(fields: Mapping[bytes | str, bytes | str]) -> Snapshot | None:
    """Decode the state hash (HGETALL); None when it is missing or malformed."""
    keys = [b"state", b"since", b"opened_at", b"failures", b"origin"]
    if b"level" in fields:
        keys.append(b"level")
    try:
        values = [fields[k] for k in keys]
    except KeyError:
        return None
    return parse_snapshot(b"|".join(v if isinstance(v, bytes) else v.encode() for v in values))


class ClockedMemoryStorage(pybreaker.CircuitBreakerStorage):
    """pybreaker's state in process memory, with the open time taken from our Clock.

    The Breaker moves to half-open itself (its open times adapt); should pybreaker ever compare
    `datetime.now(UTC) >= opened_at + reset_timeout`, `opened_at` is reported as "now minus the
    time elapsed on our clock", so that too follows the injected clock instead of the wall.
    """

    def __init__(self, clock: Clock) -> None:
        super().__init__("clocked-memory")
        self._clock = clock
        self._state = pybreaker.STATE_CLOSED
        self._failures = 0
        self._successes = 0
        self.opened_mono: float | None = None  # clock.now() when it last opened
        self.opened_wall = 0.0  # clock.wall() at the same moment, for other replicas

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, state: str) -> None:
        self._state = state

    def increment_counter(self) -> None:
        self._failures += 1

    def reset_counter(self) -> None:
        self._failures = 0

    def set_counter(self, failures: int) -> None:
        """Adopt another replica's failure count along with its open state."""
        self._failures = failures

    def increment_success_counter(self) -> None:
        self._successes += 1

    def reset_success_counter(self) -> None:
        self._successes = 0

    @property
    def counter(self) -> int:
        return self._failures

    @property
    def success_counter(self) -> int:
        return self._successes

    @property
    def opened_at(self) -> datetime | None:
        if self.opened_mono is None:
            return None
        return datetime.now(UTC) - timedelta(seconds=self.seconds_open())

    @opened_at.setter
    def opened_at(self, _pybreaker_now: datetime) -> None:
        # pybreaker passes datetime.now(UTC); the time that counts is ours.
        self.mark_opened(self._clock.now(), self._clock.wall())

    def mark_opened(self, mono: float, wall: float) -> None:
        """Record when the circuit opened, on our monotonic clock and on the wall."""
        self.opened_mono = mono
        self.opened_wall = wall

    def seconds_open(self) -> float:
        """Seconds since the circuit last opened, on our clock."""
        if self.opened_mono is None:
            return 0.0
        return max(0.0, self._clock.now() - self.opened_mono)


class SlotGrant(NamedTuple):
    """A fleet-wide probe slot decision; `key` is None when Redis could not be asked."""

    admitted: bool
    key: str | None = None
    token: str = ""


_WRITE_LUA: Final = """
-- KEYS[1] state hash; KEYS[2..] probe slots, freed by every shared transition.
-- ARGV: state, since_us, opened_us, failures, origin, channel, message, ttl_ms, level
-- Last writer wins by (since, origin), the order Snapshot.newer_than uses.
local current = redis.call('HMGET', KEYS[1], 'since', 'origin')
local since, new = tonumber(current[1] or '0'), tonumber(ARGV[2])
if since > new or (since == new and (current[2] or '') >= ARGV[5]) then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'since', ARGV[2], 'opened_at', ARGV[3],
           'failures', ARGV[4], 'origin', ARGV[5], 'level', ARGV[9])
redis.call('PEXPIRE', KEYS[1], ARGV[8])
if #KEYS > 1 then redis.call('DEL', unpack(KEYS, 2)) end
redis.call('PUBLISH', ARGV[6], ARGV[7])
return 1
"""

_ACQUIRE_LUA: Final = (
    LATE_GUARD_LUA
    + """
-- KEYS: probe slots; ARGV: token, lease_ms, not-after ms. Returns the index taken, 0 when all
-- are busy, or -1 when the caller gave up before this ran (a slot nobody would release).
if too_late(ARGV[3]) then return -1 end
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, ARGV[1], 'NX', 'PX', ARGV[2]) then return i end
end
return 0
"""
)

_RELEASE_LUA: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisBreakerState:
    """One route's breaker record in Redis: a hash, N probe-slot keys, a channel, and the lease
    that picks the replica sending the next active probe.

    Keys share the `{route}` hash tag so each script touches one cluster slot. Every call goes
    through the RedisLink, so an unreachable Redis costs milliseconds and the caller falls back.
    """

    def __init__(self, link: RedisLink, route: str, probes: int, probe_lease: float) -> None:
        self._link = link
        self._route = route
        tag = f"{{{route}}}"
        self.key = link.key("breaker", tag)
        self.slots = [link.key("breaker", tag, "probe", str(i)) for i in range(1, probes + 1)]
        self.channel = link.key("breaker", tag, "events")
        self.lease = link.key("breaker", tag, "active-probe")
        self._lease_ms = max(1, int(probe_lease * 1000))
        self._write = link.client.register_script(_WRITE_LUA)
        self._acquire = link.client.register_script(_ACQUIRE_LUA)
        self._release = link.client.register_script(_RELEASE_LUA)
        self._tokens = itertools.count()
        self._instance = secrets.token_hex(6)
        # Python 3.11's wait_for (inside redis-py) can swallow a cancel, so the background
        # loops also stop on this flag.
        self.running = False

    async def write(self, snap: Snapshot) -> bool:
        """Store and publish `snap` unless Redis holds newer; False if Redis is unreachable."""
        fields = (snap.state, snap.since_us, snap.opened_us, snap.failures, snap.origin)
        args = (*fields, self.channel, snap.encode(), int(RECORD_TTL * 1000), snap.level)
        keys = [self.key, *self.slots]
        result = await self._link.run(lambda r: self._write(keys=keys, args=args, client=r))
        return result is not UNAVAILABLE

    async def read(self) -> Snapshot | None:
        """The shared record; None when there is none or Redis is unreachable."""
        fields = await self._link.run(lambda r: r.hgetall(self.key))
        if fields is UNAVAILABLE or not fields:
            return None
        return snapshot_from_hash(fields)

    async def acquire_probe(self) -> SlotGrant:
        """Take one of the fleet's half-open probe slots (SET NX PX)."""
        token = f"{self._instance}:{next(self._tokens)}"
        index = await self._link.run(
            lambda r: self._acquire(
                keys=self.slots, args=(token, self._lease_ms, self._link.not_after()), client=r
            )
        )
        if index == LATE:
            self._link.resync()  # we were still waiting: our idea of Redis's clock is off
            index = UNAVAILABLE
        if index is UNAVAILABLE:
            return SlotGrant(True)
        if not index:
            return SlotGrant(False)
        return SlotGrant(True, self.slots[int(index) - 1], token)

    async def take_lease(self, seconds: float) -> bool:
        """Whether this replica sends the next active probe: the first to SET NX the lease, which
        then stands for `seconds`, so the fleet sends one probe per interval. When Redis cannot
        be asked each replica probes on its own."""
        token = f"{self._instance}:{next(self._tokens)}"
        ms = max(1, int(seconds * 1000))
        taken = await self._link.run(lambda r: r.set(self.lease, token, nx=True, px=ms))
        return True if taken is UNAVAILABLE else bool(taken)

    async def release_probe(self, grant: SlotGrant) -> None:
        """Free a slot we hold; if Redis is unreachable, its lease frees it instead."""
        if grant.key is None:
            return
        keys, args = [grant.key], [grant.token]
        await self._link.run(lambda r: self._release(keys=keys, args=args, client=r))

    async def listen(
        self,
        apply: Callable[[Snapshot], None],
        resync: Callable[[], None],
        retry_every: float,
        ready: asyncio.Event,
    ) -> None:
        """Apply every snapshot published on the channel until `running` is cleared.

        Sets `ready` once the first subscription attempt has ended, whether or not Redis is up.
        """
        pubsub = self._link.client.pubsub()
        lost = False
        try:
            while self.running:
                try:
                    if not pubsub.subscribed:
                        try:
                            await pubsub.subscribe(self.channel)
                        finally:
                            ready.set()
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=retry_every
                    )
                except (RedisError, OSError) as exc:
                    if not lost:
                        lost = True
                        log.warning("breaker_subscription_lost", route=self._route, error=str(exc))
                    await asyncio.sleep(retry_every)
                    continue
                if lost:
                    lost = False
                    log.info("breaker_subscription_resumed", route=self._route)
                    # Messages published during the outage are gone: read the record now.
                    resync()
                if message is not None and message.get("type") == "message":
                    snap = parse_snapshot(message["data"])
                    if snap is not None:
                        apply(snap)
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py: unannotated


class _VendorUnwell(Exception):
    """Raised inside pybreaker's `call` to replay a failed outcome."""


def _replay(failed: bool) -> None:
    if failed:
        raise _VendorUnwell


@dataclass(slots=True)
class _Probe:
    epoch: int
    slot: SlotGrant | None  # the Redis slot we hold, to free when the probe ends


class _Transitions(pybreaker.CircuitBreakerListener):
    def __init__(self, on_change: Callable[[str, str], None]) -> None:
        self._on_change = on_change

    def state_change(
        self,
        cb: pybreaker.CircuitBreaker,
        old_state: pybreaker.CircuitBreakerState | None,
        new_state: pybreaker.CircuitBreakerState,
    ) -> None:
        old = old_state.name if old_state is not None else ""
        self._on_change(old, new_state.name)


# The breaker and epoch that admitted the request running in this context: `halts_retries` is
# asked from inside the request (the retry loop), and only a probe may retry while half-open.
_ADMITTED: ContextVar[tuple[Breaker, int] | None] = ContextVar("breaker_admitted", default=None)

# A request waiting for a fleet-wide probe slot looks again this often: a slot freed on another
# replica without a decision (a tolerated failure) announces itself to nobody.
_SLOT_POLL: Final = 0.25


class Breaker:
    """The breaker policy: fails fast with CircuitOpen while the route's vendor is unwell.

    pybreaker counts outcomes and decides transitions; outcomes are replayed into it with
    `call` once the awaited upstream answer is known. Around that state machine:

    - each opening lasts `config.open_seconds(level)`; the level counts consecutive openings
      and drops to 0 once a request gets through the closed circuit;
    - half-open admits `half_open_probes` requests fleet-wide and reopens only when the trial
      can no longer reach `success_threshold` successes (one unlucky probe is survived);
    - a request that would be refused waits instead, up to `max_wait` (and at most half of what
      its deadline leaves), for the circuit to admit it: the end of the opening, a probe's
      verdict, a close;
    - with `probe` (and a `send_probe`), one replica at a time sends the operator's probe every
      `probe.every` while the circuit is not closed; a healthy answer closes it;
    - after a close, `slow_start` readmits traffic gradually: each request takes an evenly spread
      place in the ramp and waits for it, so a backlog reaches a recovering vendor spread out.

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
        self._storage = ClockedMemoryStorage(clock)
        self._cb = pybreaker.CircuitBreaker(
            fail_max=config.fail_max,
            reset_timeout=config.reset_timeout,
            success_threshold=config.success_threshold,
            listeners=[_Transitions(self._on_transition)],
            state_storage=self._storage,
            name=route,
            throw_new_error_on_trip=False,
        )
        # Bumped on every transition: an outcome only counts in the state it was admitted in.
        self._epoch = 0
        self._probes = 0  # probes in flight here during the current half-open epoch
        self._half_open_failures = 0  # failed probes of the current half-open trial
        self._level = 0  # consecutive openings; 0 once a request got through a closed circuit
        self._open_for = config.open_seconds(1)  # how long the current opening lasts
        self._confirmed = True  # a request got through since the circuit last closed
        self._probe_trusted = True  # False once a probe's close was followed by a trip
        self._closing_by = ""  # "probe" or "reset" while we close the circuit ourselves
        self._ramp_from: float | None = None  # clock.now() of the close slow start ramps from
        self._place = 0.0  # the last slow-start place handed out
        self._change: asyncio.Future[None] | None = None  # resolved by the next transition
        self._send_probe = send_probe if config.probe is not None else None
        self._running = False
        self._shared = (
            RedisBreakerState(link, route, config.half_open_probes, probe_lease) if link else None
        )
        self._origin = secrets.token_hex(6)  # this replica's name in shared snapshots
        self._snapshot = Snapshot(CLOSED, 0, 0, 0, self._origin)
        self._dirty = False  # the snapshot has not reached Redis yet
        self._applying_remote = False
        self._wake = asyncio.Event()
        self._releases: list[SlotGrant] = []
        self._sync_interval = sync_interval
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def state(self) -> str:
        """closed, half_open or open."""
        return _NAMES[self._storage.state]

    @property
    def level(self) -> int:
        """Consecutive openings so far (0 once a request got through the closed circuit)."""
        return self._level

    def halts_retries(self) -> bool:
        """Whether the request being handled should stop retrying: the circuit is open, or it
        is half-open and the request is not one of its probes (it was admitted before the trip;
        with short openings its retry would otherwise land as an extra, ungated probe)."""
        state = self._storage.state
        if state == pybreaker.STATE_CLOSED:
            return False
        if state == pybreaker.STATE_OPEN:
            return True
        admitted = _ADMITTED.get()
        return admitted is None or admitted[0] is not self or admitted[1] != self._epoch

    def seconds_until_half_open(self) -> float:
        """Seconds until an open circuit admits a probe; 0 when it is not open."""
        if self._storage.state != pybreaker.STATE_OPEN:
            return 0.0
        return max(0.0, self._open_for - self._storage.seconds_open())

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        """Refuse while open; otherwise call on and count the outcome."""
        probe: _Probe | None = None
        if self._storage.state == pybreaker.STATE_CLOSED and self._ramp_from is None:
            flow.breaker = CLOSED
            epoch = self._epoch
        else:
            probe = await self._admit(flow)
            epoch = self._epoch if probe is None else probe.epoch
        admitted = _ADMITTED.set((self, epoch))
        try:
            reply = await call_next(flow)
        except VendorFailure:
            # Our own refusals and the agent's faults are no evidence about the vendor: they
            # neither count nor reset the count.
            self._record(epoch, failed=True)
            raise
        finally:
            _ADMITTED.reset(admitted)
            if probe is not None:
                self._end_probe(probe)
        self._record(epoch, failed=Outcome.of_status(reply.status).is_vendor_failure)
        return reply

    async def start(self) -> None:
        """Start the background tasks; returns once subscribed to the shared state (or Redis
        found down)."""
        if self._running:
            return
        self._running = True
        if self._send_probe is not None:
            self._tasks.append(
                asyncio.create_task(self._probe_loop(), name=f"breaker-probe-{self.route}")
            )
        if self._shared is None:
            return
        self._shared.running = True
        subscribed = asyncio.Event()
        self._tasks += [
            asyncio.create_task(self._sync(), name=f"breaker-sync-{self.route}"),
            asyncio.create_task(
                self._shared.listen(self._apply, self._wake.set, self._sync_interval, subscribed),
                name=f"breaker-listen-{self.route}",
            ),
        ]
        # A trip published before we subscribe would wait for the periodic read.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await subscribed.wait()

    async def stop(self) -> None:
        """Stop the background tasks, pushing a last unsynced transition if Redis allows."""
        self._running = False
        if self._shared is not None:
            self._shared.running = False
            self._wake.set()
        pending, self._tasks = set(self._tasks), []
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.5)
        if self._shared is not None:
            await self._flush()

    async def reset(self) -> None:
        """Close the circuit (admin endpoint), here and for every replica: no slow start, and
        the next opening is a first one again."""
        self._storage.reset_counter()
        self._closing_by = "reset"
        try:
            if self._storage.state == pybreaker.STATE_CLOSED:
                self._confirm()
                self._ramp_from = None
                self._share(CLOSED)
            else:
                self._cb.close()  # the transition listener shares it
        finally:
            self._closing_by = ""
        if self._shared is not None:
            await self._flush()

    # -- admission and outcomes ----------------------------------------------------------------

    async def _admit(self, flow: Flow) -> _Probe | None:
        """Admit the request: as a probe while half-open, else (closed) None. Waits while the
        breaker may admit it within the request's allowance; raises CircuitOpen otherwise."""
        hold_until: float | None = None  # when waiting for an open circuit stops
        place: float | None = None  # the request's place in a slow-start ramp
        while True:
            now = self._clock.now()
            if self._storage.state == pybreaker.STATE_CLOSED:
                if place is None:
                    place = self._next_place()
                delay = self._ramp_delay(place, now)
                if delay <= 0:
                    flow.breaker = CLOSED
                    return None
                # The ramp must leave the call itself at least as much time as it takes.
                if delay > (flow.deadline - now) / 2:
                    raise self._ramp_refusal(flow, delay)
                await self._pause(flow, delay)
                continue
            if hold_until is None:
                hold_until = now + max(0.0, min(self.config.max_wait, (flow.deadline - now) / 2))
            left = hold_until - now
            if self._storage.state == pybreaker.STATE_OPEN:
                until = self.seconds_until_half_open()
                if until <= 0:
                    self._cb.half_open()
                    continue
                # Only the end of the opening, or an active probe, can admit it sooner.
                if left <= 0 or (until > left and not self._probing()):
                    raise self._refusal(flow, until)
                await self._pause(flow, min(until, left))
                continue
            if self._probes < self.config.half_open_probes:
                self._probes += 1
                epoch = self._epoch
                grant = SlotGrant(True)
                if self._shared is not None:
                    try:
                        grant = await self._shared.acquire_probe()
                    except asyncio.CancelledError:
                        if epoch == self._epoch:
                            self._probes -= 1  # the agent left; a slot taken meanwhile lapses
                        raise
                    if epoch != self._epoch:
                        # Another probe or replica decided while we waited on Redis: look again.
                        if grant.key is not None:
                            self._release(grant)
                        continue
                    if not grant.admitted:
                        self._probes -= 1
                if grant.admitted:
                    flow.breaker = HALF_OPEN
                    # Without a key Redis is unreachable, and the local gate decides alone.
                    return _Probe(epoch, grant if grant.key is not None else None)
                left = hold_until - self._clock.now()
            if left <= 0:
                raise self._refusal(flow, 1.0)
            await self._pause(flow, left if self._shared is None else min(left, _SLOT_POLL))

    async def _pause(self, flow: Flow, seconds: float) -> None:
        """Wait up to `seconds` on our clock, or until the breaker's state changes."""
        started = self._clock.now()
        change = self._next_change()
        sleep = asyncio.ensure_future(self._clock.sleep(seconds))
        try:
            await asyncio.wait((sleep, change), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleep.cancel()
            flow.waited_seconds += self._clock.now() - started

    def _next_change(self) -> asyncio.Future[None]:
        """A future the next transition resolves (shared by everyone waiting for it)."""
        if self._change is None or self._change.done():
            self._change = asyncio.get_running_loop().create_future()
        return self._change

    def _changed(self) -> None:
        change, self._change = self._change, None
        if change is not None and not change.done():
            change.set_result(None)

    def _next_place(self) -> float:
        self._place = (self._place + _GOLDEN) % 1.0
        return self._place

    def _ramp_delay(self, place: float, now: float) -> float:
        """Seconds until slow start admits the request at `place` (0 <= place < 1); 0 once it
        does. The admitted share grows linearly from 0 to all over `slow_start`."""
        if self._ramp_from is None:
            return 0.0
        elapsed = now - self._ramp_from
        if elapsed >= self.config.slow_start:
            self._ramp_from = None
            return 0.0
        return max(0.0, place * self.config.slow_start - elapsed)

    def _probing(self) -> bool:
        """Whether an active probe may close the circuit before the opening ends."""
        return self._send_probe is not None and self._running and self._probe_trusted

    def _end_probe(self, probe: _Probe) -> None:
        if probe.epoch == self._epoch:
            self._probes -= 1
            self._changed()  # a waiting request may take the freed slot
        if probe.slot is not None:
            self._release(probe.slot)

    def _record(self, epoch: int, *, failed: bool) -> None:
        if epoch != self._epoch:
            return  # admitted under an earlier state; that state's fate is already decided
        storage = self._storage
        if not failed and storage.state == pybreaker.STATE_CLOSED:
            if not self._confirmed:
                self._confirm()
            if storage.counter == 0:
                return  # the common case, and a no-op for pybreaker
        if failed and storage.state == pybreaker.STATE_HALF_OPEN:
            self._half_open_failures += 1
            if self._half_open_failures <= self.config.tolerated_failures:
                return  # the trial can still succeed: one unlucky probe does not reopen it
        with contextlib.suppress(_VendorUnwell):
            self._cb.call(_replay, failed)

    def _confirm(self) -> None:
        """A request got through the closed circuit: the vendor is back for real."""
        self._confirmed = True
        self._level = 0
        self._probe_trusted = True

    def _refusal(self, flow: Flow, retry_after: float) -> CircuitOpen:
        flow.breaker = OPEN
        failures = self._storage.counter
        cause = f" after {failures} consecutive failure{'s' if failures != 1 else ''}"
        if self._storage.state == pybreaker.STATE_HALF_OPEN:
            what = f"circuit open{cause if failures else ''}, a recovery probe is in flight"
        else:
            what = f"circuit open{cause if failures else ''}"
        return CircuitOpen(
            f"{self.route}: {what}; retry in {seconds_text(retry_after)}",
            route=self.route,
            attempts=flow.attempts,
            retry_after_s=retry_after,
            headers={"X-Circuit": "open"},
        )

    def _ramp_refusal(self, flow: Flow, retry_after: float) -> CircuitOpen:
        flow.breaker = "slow_start"
        return CircuitOpen(
            f"{self.route}: the vendor just recovered and traffic returns gradually over "
            f"{seconds_text(self.config.slow_start)}; retry in {seconds_text(retry_after)}",
            route=self.route,
            attempts=flow.attempts,
            retry_after_s=retry_after,
            headers={"X-Circuit": "slow-start"},
        )

    # -- active probes ---------------------------------------------------------------------------

    async def _probe_loop(self) -> None:
        """While the circuit is not closed, send the probe every `probe.every` (one replica at a
        time with Redis); a healthy answer closes the circuit."""
        probe, send = self.config.probe, self._send_probe
        assert probe is not None and send is not None
        while self._running:
            if self._storage.state == pybreaker.STATE_CLOSED or not self._probe_trusted:
                await asyncio.wait((self._next_change(),))
                continue
            await self._clock.sleep(probe.every)  # the vendor just failed: give it a moment
            if self._storage.state == pybreaker.STATE_CLOSED or not self._probe_trusted:
                continue
            if self._shared is not None and not await self._shared.take_lease(probe.every):
                continue  # another replica sends this one
            try:
                status = await send()
            except ProxyError as exc:
                healthy, answer = False, exc.reason
            else:
                healthy, answer = probe.healthy(status), str(status)
            self._events.breaker_probe(self.route, "ok" if healthy else "failed")
            if healthy and self._storage.state != pybreaker.STATE_CLOSED and self._probe_trusted:
                log.info("breaker_closed_by_probe", route=self.route, answer=answer)
                self._closing_by = "probe"
                try:
                    self._cb.close()
                finally:
                    self._closing_by = ""

    # -- transitions and the shared record -----------------------------------------------------

    def _on_transition(self, old: str, new: str) -> None:
        if old == new:
            return  # pybreaker re-enters the same state on close() of a closed breaker
        self._epoch += 1
        self._probes = 0
        self._half_open_failures = 0
        state = _NAMES[new]
        if state == OPEN:
            self._ramp_from = None
            if not self._applying_remote:  # a remote opening brought its level along
                fresh = old == pybreaker.STATE_CLOSED and self._confirmed
                self._level = 1 if fresh else min(self._level + 1, _MAX_LEVEL)
            self._open_for = self.config.open_seconds(self._level)
            if old == pybreaker.STATE_CLOSED and not self._confirmed:
                # A probe closed it and it tripped before any request got through: the probe
                # answers while requests fail. Until one gets through, half-open decides alone.
                self._probe_trusted = False
        elif state == CLOSED:
            ramp = self.config.slow_start > 0 and self._closing_by != "reset"
            self._ramp_from = self._clock.now() if ramp else None
            if not self._applying_remote:
                if self._closing_by == "probe":
                    self._confirmed = False  # the level stands until a request gets through
                else:
                    self._confirm()  # half-open successes are requests that got through
        self._events.breaker_transition(self.route, state)
        self._changed()
        # Half-open is derived from opened_at by every replica, so only open/closed are shared.
        if state != HALF_OPEN and not self._applying_remote:
            self._share(state)

    def _share(self, state: str) -> None:
        """Stamp a local transition and queue it for Redis."""
        since = max(int(self._clock.wall() * 1_000_000), self._snapshot.since_us + 1)
        opened = int(self._storage.opened_wall * 1_000_000)
        self._snapshot = Snapshot(
            state, since, opened, self._storage.counter, self._origin, self._level
        )
        if self._shared is not None:
            self._dirty = True
            self._wake.set()

    def _apply(self, snap: Snapshot) -> None:
        """Adopt another replica's transition if it is newer than what we know."""
        if not snap.newer_than(self._snapshot):
            return  # our own echo, or older than what we know
        self._snapshot = snap
        self._dirty = False  # whatever we had not pushed is superseded
        storage = self._storage
        if snap.state == OPEN:
            wall = snap.opened_us / 1_000_000
            # Monotonic clocks differ between processes; the wall time maps onto ours.
            storage.mark_opened(self._clock.now() - max(0.0, self._clock.wall() - wall), wall)
            storage.set_counter(snap.failures)
            # Level 0 comes from a replica that predates adaptive open times: a first opening.
            self._level = max(1, snap.level)
            self._open_for = self.config.open_seconds(self._level)
            target = pybreaker.STATE_OPEN
        else:
            storage.reset_counter()
            storage.reset_success_counter()
            self._level = snap.level  # above 0: closed by a probe, not yet confirmed
            if snap.level == 0:
                self._confirm()
            else:
                self._confirmed = False
            target = pybreaker.STATE_CLOSED
        if storage.state != target:
            storage.state = target
            self._applying_remote = True
            try:
                self._cb.state = target  # pybreaker notifies the listeners
            finally:
                self._applying_remote = False

    def _release(self, slot: SlotGrant) -> None:
        self._releases.append(slot)
        self._wake.set()

    async def _flush(self) -> None:
        assert self._shared is not None
        while self._releases:
            await self._shared.release_probe(self._releases.pop())
        if self._dirty:
            self._dirty = False
            if not await self._shared.write(self._snapshot):
                self._dirty = True  # Redis is down: the next tick tries again

    async def _sync(self) -> None:
        """Push local transitions, and every `sync_interval` read what pub/sub may have lost."""
        assert self._shared is not None
        while self._shared.running:
            await self._flush()
            snap = await self._shared.read()
            if snap is not None:
                self._apply(snap)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._sync_interval):
                    await self._wake.wait()
            self._wake.clear()

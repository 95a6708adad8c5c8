"""The breaker's state machine: every transition of one route's circuit, with no I/O and no clock
of its own. Callers pass the time (the clock's `now` and `wall`) and get back a `Change`: the
state entered, if any, and the record to share, if any; events, Redis and waking are theirs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from policies.breaker.config import BreakerConfig
from policies.breaker.library import pybreaker
from policies.breaker.snapshot import CLOSED, HALF_OPEN, MAX_LEVEL, OPEN, Snapshot
from policies.breaker.storage import CircuitStorage

# pybreaker's state names, as the storage keeps them, to ours (metrics, logs, the shared record).
_NAMES: Final = {
    pybreaker.STATE_CLOSED: CLOSED,
    pybreaker.STATE_HALF_OPEN: HALF_OPEN,
    pybreaker.STATE_OPEN: OPEN,
}

# Who moved the circuit: requests (a trip, a trial's verdict, an opening's end), an active
# probe, the admin's reset, or another replica through the shared record.
_By = Literal["requests", "probe", "reset", "fleet"]


@dataclass(frozen=True, slots=True)
class Change:
    """What one event did: the state the circuit entered (None: it stayed), and the record the
    other replicas should adopt (None: nothing new to tell them)."""

    entered: str | None = None
    share: Snapshot | None = None


NOTHING: Final = Change()


class Circuit:
    """One route's circuit: closed, open or half-open.

    - Closed, `fail_max` consecutive vendor failures open it; a success resets the count.
    - Each opening lasts `config.open_seconds(level)`: the level counts consecutive openings
      and drops to 0 once a request gets through the closed circuit.
    - Once the opening is over, half-open admits `half_open_probes` probes and reopens only
      when the trial can no longer reach `success_threshold` successes.
    - An active probe may close it early; if it then trips before any request got through, the
      probe answered while requests failed, and no probe is trusted until a request gets through.
    - After a close (not a reset), `slow_start` readmits requests over a ramp.
    - Every transition bumps the epoch: an outcome counts only in the epoch it was admitted in.
    """

    def __init__(self, config: BreakerConfig, origin: str) -> None:
        self.config = config
        self.storage = CircuitStorage()
        self._origin = origin  # this replica's name in shared records
        self._epoch = 0
        self._probes = 0  # probes in flight here in the current half-open epoch
        self._trial_failures = 0  # failed probes of the current half-open trial
        self._level = 0
        self._open_for = config.open_seconds(1)  # how long the current opening lasts
        self._confirmed = True  # a request got through since the circuit last closed
        self._probe_trusted = True  # False once a probe's close was followed by a trip
        self._ramp_from: float | None = None  # when the slow-start ramp began
        self._snapshot = Snapshot(CLOSED, 0, 0, 0, origin)  # the newest shared record we know

    @property
    def state(self) -> str:
        """closed, half_open or open."""
        return _NAMES[self.storage.state]

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def level(self) -> int:
        """Consecutive openings so far (0 once a request got through the closed circuit)."""
        return self._level

    @property
    def failures(self) -> int:
        """The consecutive failures counted so far (those that opened it, while open)."""
        return self.storage.counter

    @property
    def probe_trusted(self) -> bool:
        """Whether an active probe's healthy answer may close the circuit."""
        return self._probe_trusted

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def passes_freely(self) -> bool:
        """Closed and not ramping: a request goes through without being admitted."""
        return self.storage.state == pybreaker.STATE_CLOSED and self._ramp_from is None

    def seconds_until_half_open(self, now: float) -> float:
        """Seconds until an open circuit admits a probe; 0 when it is not open."""
        if self.storage.state != pybreaker.STATE_OPEN:
            return 0.0
        return max(0.0, self._open_for - self.storage.seconds_open(now))

    def halts_retries(self, admitted: int | None) -> bool:
        """Whether a request admitted in epoch `admitted` (None: not by this circuit) must stop
        retrying: the circuit is open, or half-open and the request is not one of its probes."""
        state = self.storage.state
        if state == pybreaker.STATE_CLOSED:
            return False
        return state == pybreaker.STATE_OPEN or admitted != self._epoch

    def slow_start_wait(self, place: float, now: float) -> float:
        """Seconds until the ramp admits the request at `place` (0 <= place < 1); 0 once it
        does. The admitted share grows linearly from none to all over `slow_start`."""
        if self._ramp_from is None:
            return 0.0
        elapsed = now - self._ramp_from
        if elapsed >= self.config.slow_start:
            self._ramp_from = None
            return 0.0
        return max(0.0, place * self.config.slow_start - elapsed)

    def begin_probe(self) -> int | None:
        """Take a probe's place in the half-open trial: its epoch, or None when none is free."""
        half_open = self.storage.state == pybreaker.STATE_HALF_OPEN
        if not half_open or self._probes >= self.config.half_open_probes:
            return None
        self._probes += 1
        return self._epoch

    def end_probe(self, epoch: int) -> bool:
        """Give back a probe's place; False when its trial is already decided (nothing freed)."""
        if epoch != self._epoch:
            return False
        self._probes -= 1
        return True

    # -- what happens to it ------------------------------------------------------------------------

    def half_open(self, now: float) -> Change:
        """End the opening once its time is over."""
        if self.storage.state != pybreaker.STATE_OPEN or self.seconds_until_half_open(now) > 0:
            return NOTHING
        return Change(self._enter(pybreaker.STATE_HALF_OPEN, now, "requests"))

    def record(self, epoch: int, *, failed: bool, now: float, wall: float) -> Change:
        """Count the vendor's answer to a request admitted in `epoch`."""
        if epoch != self._epoch:
            return NOTHING  # admitted under an earlier state, whose fate is already decided
        storage = self.storage
        if storage.state == pybreaker.STATE_CLOSED:
            if not failed:
                if not self._confirmed:
                    self._confirm()
                storage.reset_counter()
                return NOTHING
            storage.increment_counter()
            if storage.counter < self.config.fail_max:
                return NOTHING
            return self._trip(now, wall)
        if storage.state != pybreaker.STATE_HALF_OPEN:
            return NOTHING  # open: nothing was admitted in this epoch
        if failed:
            self._trial_failures += 1
            if self._trial_failures <= self.config.tolerated_failures:
                return NOTHING  # the trial can still succeed: one unlucky probe does not reopen
            storage.increment_counter()
            return self._trip(now, wall)
        storage.reset_counter()
        storage.increment_success_counter()
        if storage.success_counter < self.config.success_threshold:
            return NOTHING
        return self._close(now, wall, "requests")

    def close_by_probe(self, now: float, wall: float) -> Change:
        """An active probe found the vendor healthy: close, unless it is closed or the probe is
        not trusted. The level stands until a request gets through."""
        if self.storage.state == pybreaker.STATE_CLOSED or not self._probe_trusted:
            return NOTHING
        return self._close(now, wall, "probe")

    def reset(self, now: float, wall: float) -> Change:
        """The admin closes it: no slow start, and the next opening is a first one again. Shared
        even when it was closed already, so every replica closes."""
        self.storage.reset_counter()
        if self.storage.state != pybreaker.STATE_CLOSED:
            return self._close(now, wall, "reset")
        self._confirm()
        self._ramp_from = None
        return Change(share=self._stamp(CLOSED, wall))

    def adopt(self, snap: Snapshot, now: float, wall: float) -> Change | None:
        """Take on another replica's transition; None when `snap` is not newer than what we know
        (our own echo, or stale), so nothing of ours is superseded."""
        if not snap.newer_than(self._snapshot):
            return None
        self._snapshot = snap
        storage = self.storage
        if snap.state == OPEN:
            opened_wall = snap.opened_us / 1_000_000
            # Monotonic clocks differ between processes; the wall time maps onto ours.
            storage.mark_opened(now - max(0.0, wall - opened_wall), opened_wall)
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
        if storage.state == target:
            return NOTHING
        return Change(self._enter(target, now, "fleet"))

    # -- transitions -----------------------------------------------------------------------------

    def _trip(self, now: float, wall: float) -> Change:
        self.storage.mark_opened(now, wall)
        return Change(self._enter(pybreaker.STATE_OPEN, now, "requests"), self._stamp(OPEN, wall))

    def _close(self, now: float, wall: float, by: _By) -> Change:
        return Change(self._enter(pybreaker.STATE_CLOSED, now, by), self._stamp(CLOSED, wall))

    def _enter(self, new: str, now: float, by: _By) -> str:
        """Move to `new` (pybreaker's name); returns ours."""
        old, storage = self.storage.state, self.storage
        storage.state = new
        storage.reset_success_counter()
        self._epoch += 1
        self._probes = 0
        self._trial_failures = 0
        if new == pybreaker.STATE_OPEN:
            self._ramp_from = None
            if by != "fleet":  # a shared opening brought its level along
                fresh = old == pybreaker.STATE_CLOSED and self._confirmed
                self._level = 1 if fresh else min(self._level + 1, MAX_LEVEL)
            self._open_for = self.config.open_seconds(self._level)
            if old == pybreaker.STATE_CLOSED and not self._confirmed:
                # A probe closed it and it tripped before any request got through: the probe
                # answers while requests fail. Until one gets through, half-open decides alone.
                self._probe_trusted = False
        elif new == pybreaker.STATE_CLOSED:
            storage.reset_counter()
            ramp = self.config.slow_start > 0 and by != "reset"
            self._ramp_from = now if ramp else None
            if by == "probe":
                self._confirmed = False  # the level stands until a request gets through
            elif by != "fleet":  # a shared close brought its level along
                self._confirm()  # half-open successes are requests that got through
        return _NAMES[new]

    def _confirm(self) -> None:
        """A request got through the closed circuit: the vendor is back for real."""
        self._confirmed = True
        self._level = 0
        self._probe_trusted = True

    def _stamp(self, state: str, wall: float) -> Snapshot:
        """This replica's record of a local change, later than any it knows of."""
        since = max(int(wall * 1_000_000), self._snapshot.since_us + 1)
        opened = int(self.storage.opened_wall * 1_000_000)
        self._snapshot = Snapshot(
            state, since, opened, self.storage.counter, self._origin, self._level
        )
        return self._snapshot

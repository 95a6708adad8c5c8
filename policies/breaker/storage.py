"""A circuit's state and counters, kept behind pybreaker's storage interface, in process memory."""

from __future__ import annotations

from datetime import UTC, datetime

from policies.breaker.library import pybreaker


class CircuitStorage(pybreaker.CircuitBreakerStorage):
    """Where a circuit's state and counters live, behind pybreaker's storage interface: the
    state by pybreaker's names, consecutive failures, the half-open trial's successes, and when
    it last opened (on the caller's monotonic clock, and on the wall for other replicas)."""

    def __init__(self) -> None:
        super().__init__("memory")
        self._state = pybreaker.STATE_CLOSED
        self._failures = 0
        self._successes = 0
        self.opened_mono: float | None = None  # now() when it last opened; None: never
        self.opened_wall = 0.0  # wall() at the same moment

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
        """Adopt another replica's failure count along with its opening."""
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
        return None if self.opened_mono is None else datetime.fromtimestamp(self.opened_wall, UTC)

    @opened_at.setter
    def opened_at(self, when: datetime) -> None:
        # Open times are measured on the monotonic clock, which a datetime does not carry.
        raise TypeError("an opening is recorded with mark_opened(mono, wall)")

    def mark_opened(self, mono: float, wall: float) -> None:
        """Record when the circuit opened, on the monotonic clock and on the wall."""
        self.opened_mono = mono
        self.opened_wall = wall

    def seconds_open(self, now: float) -> float:
        """Seconds since the circuit last opened."""
        return 0.0 if self.opened_mono is None else max(0.0, now - self.opened_mono)

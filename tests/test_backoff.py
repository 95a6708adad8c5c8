"""Tests for the pure retry decisions: no sleeping, time comes from a ManualClock."""

from __future__ import annotations

import random

import pytest

from policies.backoff import (
    Backoff,
    GiveUpRetryAfterTooLong,
    RandomLike,
    RetryBudget,
    Wait,
    attempt_timeout,
    fits_deadline,
    parse_retry_after,
    wait_for_retry,
)
from policies.core.clock import ManualClock

NOW_WALL = 1_700_000_000.0  # Tue, 14 Nov 2023 22:13:20 GMT


class ScriptedRandom:
    """Returns `fraction` of the way through each requested range and records the ranges."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.calls: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.calls.append((a, b))
        return a + (b - a) * self.fraction


def schedule(backoff: Backoff, rng: RandomLike, retries: int) -> list[float]:
    """The delays a retry loop would sleep, threading `prev` the way the loop must."""
    delays: list[float] = []
    prev: float | None = None
    for n in range(1, retries + 1):
        prev = backoff.delay(n, prev, rng)
        delays.append(prev)
    return delays


# Backoff: no jitter


def test_no_jitter_doubles_from_initial_until_the_cap() -> None:
    backoff = Backoff(initial=0.2, max=5.0, multiplier=2.0, jitter="none")
    assert schedule(backoff, random.Random(0), 8) == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]


def test_no_jitter_does_not_draw_from_the_rng() -> None:
    rng = ScriptedRandom(0.5)
    Backoff(initial=0.2, max=5.0, multiplier=2.0, jitter="none").delay(3, None, rng)
    assert rng.calls == []


def test_multiplier_one_gives_a_constant_delay() -> None:
    backoff = Backoff(initial=1.5, max=10.0, multiplier=1.0, jitter="none")
    assert schedule(backoff, random.Random(0), 4) == [1.5, 1.5, 1.5, 1.5]


def test_huge_retry_number_returns_the_cap_instead_of_overflowing() -> None:
    backoff = Backoff(initial=0.2, max=5.0, multiplier=2.0, jitter="none")
    assert backoff.delay(5000, None, random.Random(0)) == 5.0


def test_retry_number_below_one_is_rejected() -> None:
    backoff = Backoff(initial=0.2, max=5.0, multiplier=2.0, jitter="none")
    with pytest.raises(ValueError, match="starts at 1"):
        backoff.delay(0, None, random.Random(0))


# Backoff: full jitter


def test_full_jitter_draws_between_zero_and_the_capped_exponential() -> None:
    rng = ScriptedRandom(1.0)
    backoff = Backoff(initial=0.2, max=1.0, multiplier=2.0, jitter="full")
    assert schedule(backoff, rng, 5) == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert rng.calls == [(0.0, 0.2), (0.0, 0.4), (0.0, 0.8), (0.0, 1.0), (0.0, 1.0)]


def test_full_jitter_stays_in_bounds_and_varies_over_many_draws() -> None:
    rng = random.Random(1234)
    backoff = Backoff(initial=0.2, max=1.0, multiplier=2.0, jitter="full")
    third = [backoff.delay(3, None, rng) for _ in range(2000)]
    assert all(0.0 <= d <= 0.8 for d in third)
    # Spread over the whole range, not clustered: both ends of [0, 0.8] are reached.
    assert min(third) < 0.01
    assert max(third) > 0.79
    assert len(set(third)) == 2000
    capped = [backoff.delay(9, None, rng) for _ in range(2000)]
    assert all(0.0 <= d <= 1.0 for d in capped)
    assert max(capped) > 0.99


def test_full_jitter_is_reproducible_with_the_same_seed() -> None:
    backoff = Backoff(initial=0.2, max=5.0, multiplier=2.0, jitter="full")
    assert schedule(backoff, random.Random(7), 6) == schedule(backoff, random.Random(7), 6)


# Backoff: decorrelated jitter


def test_decorrelated_first_retry_draws_between_initial_and_three_times_initial() -> None:
    rng = ScriptedRandom(1.0)
    backoff = Backoff(initial=0.2, max=5.0, multiplier=2.0, jitter="decorrelated")
    assert backoff.delay(1, None, rng) == pytest.approx(0.6)
    assert rng.calls == [(0.2, pytest.approx(0.6))]


def test_decorrelated_grows_from_the_previous_delay_and_is_capped() -> None:
    rng = ScriptedRandom(1.0)
    backoff = Backoff(initial=1.0, max=20.0, multiplier=2.0, jitter="decorrelated")
    assert schedule(backoff, rng, 4) == [3.0, 9.0, 20.0, 20.0]
    assert rng.calls == [(1.0, 3.0), (1.0, 9.0), (1.0, 27.0), (1.0, 60.0)]


def test_decorrelated_lowest_draw_stays_at_initial() -> None:
    backoff = Backoff(initial=0.5, max=20.0, multiplier=2.0, jitter="decorrelated")
    assert schedule(backoff, ScriptedRandom(0.0), 4) == [0.5, 0.5, 0.5, 0.5]


def test_decorrelated_stays_in_bounds_over_many_seeded_draws() -> None:
    rng = random.Random(42)
    backoff = Backoff(initial=0.2, max=3.0, multiplier=2.0, jitter="decorrelated")
    delays = schedule(backoff, rng, 2000)
    assert all(0.2 <= d <= 3.0 for d in delays)
    prevs = [0.2, *delays[:-1]]
    assert all(d <= 3 * p for d, p in zip(delays, prevs, strict=True))
    assert delays.count(3.0) > 0  # the cap is reached and applied exactly
    assert len(set(delays)) > 100


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial": 0.0}, "initial"),
        ({"initial": -1.0}, "initial"),
        ({"max": 0.1}, "max"),
        ({"multiplier": 0.5}, "multiplier"),
        ({"jitter": "equal"}, "jitter"),
    ],
)
def test_backoff_rejects_invalid_config(kwargs: dict[str, object], message: str) -> None:
    config: dict[str, object] = {"initial": 0.2, "max": 5.0, "multiplier": 2.0, "jitter": "none"}
    config.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Backoff(**config)  # type: ignore[arg-type]


# Retry-After


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("120", 120.0),
        ("0", 0.0),
        (" 7 ", 7.0),
        ("1.5", 1.5),
        ("Tue, 14 Nov 2023 22:15:20 GMT", 120.0),  # IMF-fixdate
        ("Tuesday, 14-Nov-23 22:15:20 GMT", 120.0),  # obsolete RFC 850
        ("Tue Nov 14 22:15:20 2023", 120.0),  # obsolete asctime, GMT by definition
        ("Tue, 14 Nov 2023 22:13:20 GMT", 0.0),  # exactly now
        ("Tue, 14 Nov 2023 22:10:00 GMT", 0.0),  # in the past
        ("Sun, 06 Nov 1994 08:49:37 GMT", 0.0),
    ],
)
def test_retry_after_readable_values(value: str, expected: float) -> None:
    assert parse_retry_after(value, NOW_WALL) == expected


@pytest.mark.parametrize(
    "value",
    [None, "", "   ", "-5", "-0.5", "+5", "soon", "5s", "1e3", "1.", ".5", "inf", "NaN",
     "Tue, 32 Nov 2023 22:15:20 GMT", "Mon"],
)  # fmt: skip
def test_retry_after_unreadable_values_give_none(value: str | None) -> None:
    assert parse_retry_after(value, NOW_WALL) is None


# Wait decision


def test_wait_uses_backoff_when_no_retry_after() -> None:
    assert wait_for_retry(0.4, None, honor=True, max_wait=30.0) == Wait(0.4)


def test_wait_takes_the_longer_of_backoff_and_retry_after() -> None:
    assert wait_for_retry(0.4, 5.0, honor=True, max_wait=30.0) == Wait(5.0)
    assert wait_for_retry(2.0, 0.5, honor=True, max_wait=30.0) == Wait(2.0)


def test_wait_accepts_retry_after_equal_to_max_wait() -> None:
    assert wait_for_retry(0.4, 30.0, honor=True, max_wait=30.0) == Wait(30.0)


def test_gives_up_when_retry_after_exceeds_max_wait() -> None:
    decision = wait_for_retry(0.4, 30.5, honor=True, max_wait=30.0)
    assert decision == GiveUpRetryAfterTooLong(30.5)
    assert not isinstance(decision, Wait)


def test_retry_after_is_ignored_when_not_honoured() -> None:
    assert wait_for_retry(0.4, 3600.0, honor=False, max_wait=30.0) == Wait(0.4)
    assert wait_for_retry(0.4, 5.0, honor=False, max_wait=30.0) == Wait(0.4)


# Deadlines


def test_fits_deadline_when_wait_and_attempt_end_before_it() -> None:
    assert fits_deadline(now=100.0, deadline=110.0, wait=2.0, min_attempt=1.0) is True


def test_fits_deadline_when_attempt_ends_exactly_at_it() -> None:
    assert fits_deadline(now=100.0, deadline=103.0, wait=2.0, min_attempt=1.0) is True


def test_does_not_fit_when_attempt_would_end_after_deadline() -> None:
    assert fits_deadline(now=100.0, deadline=102.75, wait=2.0, min_attempt=1.0) is False


def test_does_not_fit_when_sleep_alone_passes_deadline() -> None:
    assert fits_deadline(now=100.0, deadline=101.5, wait=2.0, min_attempt=0.0) is False


def test_does_not_fit_when_deadline_already_passed() -> None:
    assert fits_deadline(now=100.0, deadline=99.0, wait=0.0, min_attempt=0.0) is False


def test_zero_wait_fits_while_time_remains_for_one_attempt() -> None:
    assert fits_deadline(now=100.0, deadline=100.5, wait=0.0, min_attempt=0.5) is True
    assert fits_deadline(now=100.0, deadline=100.5, wait=0.0, min_attempt=0.75) is False


def test_no_deadline_always_fits() -> None:
    assert fits_deadline(now=100.0, deadline=float("inf"), wait=60.0, min_attempt=5.0) is True


def test_attempt_timeout_is_per_try_when_time_is_plentiful() -> None:
    assert attempt_timeout(now=100.0, deadline=120.0, per_try=5.0) == 5.0


def test_attempt_timeout_is_cut_to_time_left() -> None:
    assert attempt_timeout(now=100.0, deadline=102.5, per_try=5.0) == 2.5


def test_attempt_timeout_is_zero_past_the_deadline() -> None:
    assert attempt_timeout(now=100.0, deadline=99.0, per_try=5.0) == 0.0


# Retry budget


def test_quiet_route_gets_the_per_second_floor() -> None:
    clock = ManualClock()
    budget = RetryBudget(ratio=0.2, min_per_s=3, clock=clock)
    assert [budget.try_acquire_retry() for _ in range(5)] == [True, True, True, False, False]
    clock.advance(1.0)
    assert [budget.try_acquire_retry() for _ in range(4)] == [True, True, True, False]


def test_floor_is_per_second_not_pooled_over_the_window() -> None:
    clock = ManualClock()
    budget = RetryBudget(ratio=0.2, min_per_s=3, clock=clock)
    clock.advance(9.0)  # nine idle seconds do not bank 27 retries
    assert sum(budget.try_acquire_retry() for _ in range(30)) == 3


def test_outage_in_one_second_allows_ratio_times_requests_plus_floor() -> None:
    clock = ManualClock()
    budget = RetryBudget(ratio=0.2, min_per_s=3, clock=clock)
    allowed = 0
    for _ in range(100):
        budget.record_request()
        allowed += budget.try_acquire_retry()
        allowed += budget.try_acquire_retry()
    assert allowed == 0.2 * 100 + 3
    assert budget.requests_in_window == 100
    assert budget.ratio_retries_in_window == 20
    assert budget.try_acquire_retry() is False


def test_outage_over_the_window_allows_ratio_plus_floor_each_second() -> None:
    clock = ManualClock()
    budget = RetryBudget(ratio=0.2, min_per_s=3, clock=clock)
    allowed = 0
    for _ in range(10):
        for _ in range(10):
            budget.record_request()
            allowed += budget.try_acquire_retry()
            allowed += budget.try_acquire_retry()
        clock.advance(1.0)
    assert allowed == 0.2 * 100 + 3 * 10


def test_ratio_allowance_is_whole_despite_float_rounding() -> None:
    budget = RetryBudget(ratio=0.57, min_per_s=0, clock=ManualClock())
    for _ in range(100):
        budget.record_request()
    assert sum(budget.try_acquire_retry() for _ in range(100)) == 57


def test_exhausted_budget_recovers_after_the_window_passes() -> None:
    clock = ManualClock()
    budget = RetryBudget(ratio=0.2, min_per_s=0, clock=clock)
    for _ in range(100):
        budget.record_request()
    assert sum(budget.try_acquire_retry() for _ in range(50)) == 20
    clock.advance(9.5)  # still the same 10 s window: the spent retries still count
    assert budget.try_acquire_retry() is False
    clock.advance(0.5)
    assert budget.requests_in_window == 0
    assert budget.ratio_retries_in_window == 0
    for _ in range(10):
        budget.record_request()
    assert [budget.try_acquire_retry() for _ in range(3)] == [True, True, False]


def test_window_slides_one_second_at_a_time() -> None:
    clock = ManualClock()
    budget = RetryBudget(ratio=0.5, min_per_s=0, clock=clock)
    for _ in range(40):
        budget.record_request()
    clock.advance(5.0)
    for _ in range(20):
        budget.record_request()
    assert budget.requests_in_window == 60
    clock.advance(4.0)  # t+9: both seconds are still inside the window
    assert budget.requests_in_window == 60
    clock.advance(1.0)  # t+10: the first second leaves the window
    assert budget.requests_in_window == 20
    assert sum(budget.try_acquire_retry() for _ in range(20)) == 10
    clock.advance(5.0)  # t+15: the second batch leaves; the retries taken at t+10 stay
    assert budget.requests_in_window == 0
    assert budget.ratio_retries_in_window == 10
    clock.advance(5.0)  # t+20: the retries leave too
    assert budget.ratio_retries_in_window == 0


def test_zero_ratio_allows_only_the_floor() -> None:
    budget = RetryBudget(ratio=0.0, min_per_s=2, clock=ManualClock())
    for _ in range(1000):
        budget.record_request()
    assert sum(budget.try_acquire_retry() for _ in range(10)) == 2


def test_no_floor_and_no_requests_refuses_retries() -> None:
    budget = RetryBudget(ratio=0.2, min_per_s=0, clock=ManualClock())
    assert budget.try_acquire_retry() is False


def test_budget_memory_is_fixed_by_the_window_not_the_traffic() -> None:
    clock = ManualClock()
    budget = RetryBudget(ratio=0.2, min_per_s=3, clock=clock, window_s=10.0)
    for _ in range(500):
        for _ in range(200):
            budget.record_request()
            budget.try_acquire_retry()
        clock.advance(0.25)
    assert not hasattr(budget, "__dict__")
    # Reaching into the ring on purpose: this test is about its size.
    assert len(budget._requests) == 10
    assert len(budget._retries) == 10
    # The clock now reads second 125 of the run: seconds 116-124 held 4 steps of 200 requests.
    assert budget.requests_in_window == 9 * 4 * 200


def test_long_idle_gap_clears_the_window_without_walking_every_second() -> None:
    clock = ManualClock()
    budget = RetryBudget(ratio=1.0, min_per_s=0, clock=clock)
    for _ in range(5):
        budget.record_request()
    clock.advance(1e12)
    assert budget.requests_in_window == 0
    budget.record_request()
    assert [budget.try_acquire_retry() for _ in range(2)] == [True, False]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ratio": -0.1}, "ratio"),
        ({"min_per_s": -1}, "min_per_s"),
        ({"min_per_s": 1.5}, "min_per_s"),
        ({"window_s": 0.0}, "window_s"),
        ({"window_s": 2.5}, "window_s"),
    ],
)
def test_budget_rejects_invalid_config(kwargs: dict[str, object], message: str) -> None:
    config: dict[str, object] = {"ratio": 0.2, "min_per_s": 3, "window_s": 10.0}
    config.update(kwargs)
    with pytest.raises(ValueError, match=message):
        RetryBudget(clock=ManualClock(), **config)  # type: ignore[arg-type]

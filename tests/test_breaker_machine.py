"""The breaker's state machine driven directly: every transition, what each one hands back for the
policy to do, and what another replica's record does. Time is a ManualClock read by the test and
passed in, as the policy does; nothing here awaits or sleeps."""

from __future__ import annotations

import ast
import inspect
from datetime import UTC, datetime
from types import ModuleType

import pybreaker
import pytest

from policies.breaker import BreakerConfig, Change, Circuit, Snapshot, machine, snapshot, storage
from policies.breaker.machine import NOTHING
from policies.core.clock import ManualClock

CONFIG = BreakerConfig(fail_max=3, reset_timeout=30.0)
ADAPTIVE = BreakerConfig(fail_max=1, open_initial=1.0, open_multiplier=2.0, reset_timeout=5.0)


class Run:
    """One circuit and the clock its callers read, with the calls the policy makes."""

    def __init__(self, config: BreakerConfig = CONFIG) -> None:
        self.clock = ManualClock()
        self.circuit = Circuit(config, origin="here")

    def answer(self, *, failed: bool, epoch: int | None = None) -> Change:
        """The vendor's answer to a request admitted in `epoch` (default: the current one)."""
        admitted = self.circuit.epoch if epoch is None else epoch
        now, wall = self.clock.now(), self.clock.wall()
        return self.circuit.record(admitted, failed=failed, now=now, wall=wall)

    def fail(self, times: int = 1) -> Change:
        change = NOTHING
        for _ in range(times):
            change = self.answer(failed=True)
        return change

    def succeed(self) -> Change:
        return self.answer(failed=False)

    def half_open(self) -> Change:
        """Let the opening run out, and arrive."""
        self.clock.advance(self.circuit.seconds_until_half_open(self.clock.now()))
        return self.circuit.half_open(self.clock.now())

    def probe_closes(self) -> Change:
        return self.circuit.close_by_probe(self.clock.now(), self.clock.wall())

    def reset(self) -> Change:
        return self.circuit.reset(self.clock.now(), self.clock.wall())

    def adopt(self, snap: Snapshot) -> Change | None:
        return self.circuit.adopt(snap, self.clock.now(), self.clock.wall())

    def us(self, seconds_ago: float = 0.0) -> int:
        """The wall clock `seconds_ago`, in the shared record's microseconds."""
        return int((self.clock.wall() - seconds_ago) * 1_000_000)


# -- closed -> open ------------------------------------------------------------------------------


def test_fail_max_consecutive_failures_trip_it_and_the_trip_is_to_be_shared() -> None:
    run = Run()
    assert run.fail(2) == NOTHING
    change = run.fail()
    assert change.entered == "open" and run.circuit.state == "open"
    assert change.share == Snapshot("open", run.us(), run.us(), 3, "here", 1)
    assert run.circuit.snapshot == change.share
    assert run.circuit.seconds_until_half_open(run.clock.now()) == 30.0


def test_a_success_resets_the_count_and_changes_nothing_else() -> None:
    run = Run()
    run.fail(2)
    assert run.succeed() == NOTHING
    assert run.circuit.failures == 0
    assert run.fail(2) == NOTHING
    assert run.circuit.state == "closed"


def test_an_outcome_counts_only_in_the_epoch_that_admitted_it() -> None:
    run = Run()
    straggler = run.circuit.epoch
    run.fail(3)
    assert run.circuit.epoch == straggler + 1
    assert run.answer(failed=False, epoch=straggler) == NOTHING
    assert run.circuit.state == "open"  # a success from the closed era does not close it


# -- open -> half-open ---------------------------------------------------------------------------


def test_the_opening_ends_only_once_its_time_is_over() -> None:
    run = Run()
    run.fail(3)
    run.clock.advance(29.9)
    assert run.circuit.half_open(run.clock.now()) == NOTHING
    assert run.circuit.seconds_until_half_open(run.clock.now()) == pytest.approx(0.1)
    run.clock.advance(0.1)
    assert run.circuit.half_open(run.clock.now()) == Change("half_open")  # nothing to share
    assert run.circuit.seconds_until_half_open(run.clock.now()) == 0.0
    assert run.circuit.half_open(run.clock.now()) == NOTHING  # once


def test_only_the_open_state_halts_every_retry() -> None:
    run = Run()
    closed_era = run.circuit.epoch
    assert not run.circuit.halts_retries(closed_era)
    run.fail(3)
    assert run.circuit.halts_retries(run.circuit.epoch)
    run.half_open()
    probe = run.circuit.begin_probe()
    assert probe is not None and not run.circuit.halts_retries(probe)
    assert run.circuit.halts_retries(closed_era)  # admitted before the trip: not a probe
    assert run.circuit.halts_retries(None)  # not admitted by this circuit


# -- the half-open trial -------------------------------------------------------------------------


def test_the_trial_admits_half_open_probes_places_and_frees_them_in_its_epoch_only() -> None:
    run = Run(BreakerConfig(fail_max=1, half_open_probes=2, success_threshold=2))
    assert run.circuit.begin_probe() is None  # closed: no trial
    run.fail()
    assert run.circuit.begin_probe() is None  # open: no trial yet
    run.half_open()
    first, second = run.circuit.begin_probe(), run.circuit.begin_probe()
    assert first == second == run.circuit.epoch
    assert run.circuit.begin_probe() is None  # both places taken
    assert first is not None and run.circuit.end_probe(first)
    assert run.circuit.begin_probe() == first  # the freed place is taken again
    assert run.fail().entered == "open"  # one failure: two successes are out of reach
    assert not run.circuit.end_probe(first)  # that trial is over: nothing to free


def test_a_failed_probe_reopens_with_one_more_failure_and_a_longer_opening() -> None:
    run = Run(ADAPTIVE)
    run.fail()
    run.half_open()
    change = run.fail()
    assert change.entered == "open" and change.share is not None
    assert (change.share.failures, change.share.level) == (2, 2)
    assert run.circuit.seconds_until_half_open(run.clock.now()) == 2.0


def test_a_trial_survives_the_failures_it_can_afford_then_reopens() -> None:
    run = Run(BreakerConfig(fail_max=1, half_open_probes=3, success_threshold=2))
    run.fail()
    run.half_open()
    assert run.fail() == NOTHING  # 2 of the 3 can still succeed
    assert run.circuit.failures == 1  # a tolerated failure is not counted
    assert run.fail().entered == "open"
    assert run.circuit.failures == 2


def test_success_threshold_successes_close_it_and_the_close_is_confirmed() -> None:
    run = Run(BreakerConfig(fail_max=1, open_initial=1.0, reset_timeout=5.0, success_threshold=2))
    run.fail()
    run.half_open()
    run.fail()  # level 2
    run.half_open()
    assert run.succeed() == NOTHING
    assert run.circuit.failures == 0  # a success resets the count, as in pybreaker
    change = run.succeed()
    assert change.entered == "closed"
    assert change.share is not None and (change.share.failures, change.share.level) == (0, 0)
    assert run.circuit.level == 0 and run.circuit.passes_freely()


def test_each_reopening_lasts_longer_up_to_reset_timeout() -> None:
    run = Run(ADAPTIVE)
    run.fail()
    seen = []
    for _ in range(5):
        seen.append(run.circuit.seconds_until_half_open(run.clock.now()))
        run.half_open()
        run.fail()
    assert seen == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert run.circuit.level == 6


# -- active probes -------------------------------------------------------------------------------


def test_a_probe_closes_it_early_but_the_level_stands_until_a_request_gets_through() -> None:
    run = Run(ADAPTIVE)
    run.fail()
    change = run.probe_closes()
    assert change.entered == "closed"
    assert change.share is not None and change.share.level == 1
    assert run.circuit.level == 1
    assert run.probe_closes() == NOTHING  # closed already
    run.succeed()
    assert run.circuit.level == 0


def test_a_probe_whose_close_trips_again_is_not_trusted_until_a_request_gets_through() -> None:
    run = Run(ADAPTIVE)
    run.fail()
    run.probe_closes()
    run.fail()  # no request got through: the probe answers while requests fail
    assert run.circuit.level == 2 and not run.circuit.probe_trusted
    assert run.probe_closes() == NOTHING
    run.half_open()
    run.succeed()  # a real request closes it
    assert run.circuit.probe_trusted and run.circuit.level == 0
    run.fail()
    assert run.probe_closes().entered == "closed"


# -- slow start ----------------------------------------------------------------------------------


def test_after_a_close_slow_start_spreads_places_over_its_window() -> None:
    run = Run(BreakerConfig(fail_max=1, reset_timeout=1.0, slow_start=10.0))
    run.fail()
    run.half_open()
    run.succeed()
    assert not run.circuit.passes_freely()
    assert run.circuit.slow_start_wait(0.25, run.clock.now()) == 2.5
    run.clock.advance(4.0)
    assert run.circuit.slow_start_wait(0.25, run.clock.now()) == 0.0
    assert run.circuit.slow_start_wait(0.75, run.clock.now()) == pytest.approx(3.5)
    run.clock.advance(6.0)
    assert run.circuit.slow_start_wait(0.99, run.clock.now()) == 0.0  # the ramp is over
    assert run.circuit.passes_freely()


def test_a_close_adopted_from_another_replica_ramps_too() -> None:
    run = Run(BreakerConfig(fail_max=1, reset_timeout=1.0, slow_start=10.0))
    run.fail()
    run.adopt(Snapshot("closed", run.us() + 1, 0, 0, "there"))
    assert run.circuit.state == "closed" and not run.circuit.passes_freely()
    assert run.circuit.slow_start_wait(0.5, run.clock.now()) == 5.0


# -- the admin's reset ---------------------------------------------------------------------------


def test_reset_closes_without_slow_start_and_starts_the_levels_over() -> None:
    run = Run(BreakerConfig(fail_max=1, open_initial=1.0, reset_timeout=5.0, slow_start=10.0))
    run.fail()
    run.half_open()
    run.fail()
    change = run.reset()
    assert change.entered == "closed"
    assert change.share is not None and change.share.level == 0
    assert run.circuit.passes_freely() and run.circuit.failures == 0
    run.fail()
    assert run.circuit.seconds_until_half_open(run.clock.now()) == 1.0


def test_reset_of_a_closed_circuit_is_shared_without_a_transition() -> None:
    run = Run()
    run.fail(2)
    before = run.circuit.epoch
    change = run.reset()
    assert change.entered is None
    assert change.share == Snapshot("closed", run.us(), 0, 0, "here", 0)
    assert run.circuit.epoch == before and run.circuit.failures == 0


def test_local_records_stay_ordered_when_the_wall_clock_steps_back() -> None:
    run = Run()
    first = run.reset().share
    run.clock = ManualClock(wall_start=run.clock.wall() - 60.0)  # NTP stepped back a minute
    second = run.reset().share
    assert first is not None and second is not None
    assert second.since_us == first.since_us + 1 and second.newer_than(first)


# -- another replica's record --------------------------------------------------------------------


def test_a_shared_opening_is_adopted_with_its_level_failures_and_age() -> None:
    run = Run(ADAPTIVE)
    opened = run.us(seconds_ago=1.5)
    change = run.adopt(Snapshot("open", opened, opened, 7, "there", 3))
    assert change == Change("open")  # nothing to share back
    assert (run.circuit.level, run.circuit.failures) == (3, 7)
    assert run.circuit.seconds_until_half_open(run.clock.now()) == pytest.approx(4.0 - 1.5)
    run.half_open()
    run.fail()
    assert run.circuit.level == 4  # the next opening goes on from the shared level


def test_an_older_record_or_our_own_echo_is_ignored() -> None:
    run = Run()
    mine = run.fail(3).share
    assert mine is not None
    assert run.adopt(mine) is None
    assert run.adopt(Snapshot("closed", mine.since_us - 1, 0, 0, "there")) is None
    assert run.circuit.state == "open"


def test_a_shared_close_by_a_probe_stays_unconfirmed_and_one_by_requests_is_confirmed() -> None:
    run = Run(ADAPTIVE)
    run.fail()
    change = run.adopt(Snapshot("closed", run.us() + 1, 0, 0, "there", 1))
    assert change is not None and change.entered == "closed" and change.share is None
    run.fail()  # before any request got through
    assert run.circuit.level == 2 and not run.circuit.probe_trusted
    run.clock.advance(1.0)
    assert run.adopt(Snapshot("closed", run.us(), 0, 0, "there", 0)) == Change("closed")
    assert run.circuit.level == 0 and run.circuit.probe_trusted


def test_a_record_of_the_state_we_are_in_updates_it_without_a_transition() -> None:
    run = Run(ADAPTIVE)
    run.fail()
    epoch = run.circuit.epoch
    opened = run.us(seconds_ago=0.5)
    assert run.adopt(Snapshot("open", run.us() + 1, opened, 4, "there", 2)) == NOTHING
    assert run.circuit.epoch == epoch
    assert run.circuit.seconds_until_half_open(run.clock.now()) == pytest.approx(1.5)


def test_a_record_from_before_adaptive_open_times_is_a_first_opening() -> None:
    run = Run(ADAPTIVE)
    run.adopt(Snapshot("open", run.us(), run.us(), 5, "old-replica"))
    assert run.circuit.level == 1
    assert run.circuit.seconds_until_half_open(run.clock.now()) == pytest.approx(1.0)


# -- pybreaker's storage -------------------------------------------------------------------------


def test_the_state_and_counters_live_in_a_pybreaker_storage_by_its_names() -> None:
    run = Run()
    storage = run.circuit.storage
    assert isinstance(storage, pybreaker.CircuitBreakerStorage)
    assert (storage.state, storage.counter, storage.opened_at) == (pybreaker.STATE_CLOSED, 0, None)
    run.fail(3)
    assert (storage.state, storage.counter) == (pybreaker.STATE_OPEN, 3)
    assert storage.opened_at == datetime.fromtimestamp(run.clock.wall(), UTC)
    run.half_open()
    assert storage.state == pybreaker.STATE_HALF_OPEN
    with pytest.raises(TypeError):
        storage.opened_at = datetime.now(UTC)  # an opening needs the monotonic time too


# -- no I/O --------------------------------------------------------------------------------------


def imports_of(module: ModuleType) -> set[str]:
    tree = ast.parse(inspect.getsource(module))
    found = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    return found | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


@pytest.mark.parametrize("module", [machine, storage, snapshot])
def test_the_machine_and_its_state_import_nothing_that_waits_or_does_io(module: ModuleType) -> None:
    allowed = {"__future__", "collections.abc", "dataclasses", "datetime", "typing", "pybreaker"}
    ours = {"policies.breaker.config", "policies.breaker.snapshot", "policies.breaker.storage"}
    ours.add("policies.breaker.library")  # pybreaker itself, loaded without redis-py
    assert imports_of(module) <= allowed | ours

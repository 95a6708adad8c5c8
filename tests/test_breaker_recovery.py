"""Recovering as soon as the vendor does: open times that grow while it stays down, half-open
trials that survive an unlucky probe, waiting instead of refusing, slow start after a close,
active probes (one replica at a time through Redis), and the config that turns them on.

Time is a ManualClock, or a SteppedClock where several requests wait at once; the active probe's
fleet-wide lease runs against a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from policies.breaker import (
    SECTION,
    Breaker,
    BreakerConfig,
    ProbeConfig,
    Snapshot,
    open_seconds,
    parse_snapshot,
)
from policies.core.clock import ManualClock
from policies.core.errors import CircuitOpen, UpstreamUnreachable
from policies.core.flow import Flow, Reply
from policies.core.redislink import RedisLink
from proxy.config import ConfigError, as_document, parse_config
from testkit.fakevendor import FakeVendor
from testkit.redisserver import RedisServer
from testkit.waiting import eventually
from tests.conftest import route
from tests.test_breaker import ROUTE, RecordingEvents, Upstream, answer, fail, make_flow, refused

ADAPTIVE = BreakerConfig(fail_max=1, open_initial=1.0, open_multiplier=2.0, reset_timeout=5.0)


class SteppedClock(ManualClock):
    """A ManualClock whose `sleep` waits until `advance` reaches its end, so concurrent waits
    overlap the way they do in real time."""

    def __init__(self) -> None:
        super().__init__()
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.now() + seconds, woken))
        await woken

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        due = [f for at, f in self._sleepers if at <= self.now() + 1e-9]
        self._sleepers = [(at, f) for at, f in self._sleepers if at > self.now() + 1e-9]
        for woken in due:
            if not woken.done():
                woken.set_result(None)


class ProbeEvents(RecordingEvents):
    def __init__(self) -> None:
        super().__init__()
        self.probes: list[str] = []

    def breaker_probe(self, route: str, result: str) -> None:
        self.probes.append(result)


def flow_with(clock: ManualClock, seconds_left: float) -> Flow:
    flow = make_flow()
    flow.context.deadline = clock.now() + seconds_left
    return flow


async def let_run() -> None:
    """Let every ready task take its next steps."""
    for _ in range(5):
        await asyncio.sleep(0)


# -- the open time -------------------------------------------------------------------------------


def test_open_seconds_grows_by_the_multiplier_up_to_the_maximum() -> None:
    assert [open_seconds(1.0, 2.0, 30.0, level) for level in range(1, 8)] == [
        1.0,
        2.0,
        4.0,
        8.0,
        16.0,
        30.0,
        30.0,
    ]
    assert open_seconds(0.5, 1.0, 30.0, 50) == 0.5  # multiplier 1: a fixed open time
    assert open_seconds(1.0, 100.0, 86400.0, 10**6) == 86400.0  # no overflow, however long
    assert BreakerConfig(reset_timeout=7.0).open_seconds(5) == 7.0  # no open_initial: fixed


async def test_each_reopening_lasts_longer_until_reset_timeout_and_a_close_starts_over() -> None:
    clock = ManualClock()
    breaker = Breaker(ROUTE, ADAPTIVE, clock)
    upstream = Upstream()
    await fail(breaker, upstream)
    seen = []
    for _ in range(5):
        seen.append(breaker.seconds_until_half_open())
        clock.advance(breaker.seconds_until_half_open())
        await fail(breaker, upstream)  # the half-open probe fails: it opens again, for longer
    assert seen == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert breaker.level == 6
    clock.advance(5.0)
    await answer(breaker, upstream)  # the probe gets through: closed
    assert (breaker.state, breaker.level) == ("closed", 0)
    await fail(breaker, upstream)
    assert breaker.seconds_until_half_open() == 1.0  # a first opening again


async def test_refusals_give_the_adapted_time_as_retry_after() -> None:
    clock = ManualClock()
    breaker = Breaker(ROUTE, ADAPTIVE, clock)
    upstream = Upstream()
    await fail(breaker, upstream)
    clock.advance(1.0)
    await fail(breaker, upstream)
    clock.advance(0.5)
    error = await refused(breaker, upstream)
    assert error.retry_after_s == pytest.approx(1.5)
    assert error.message.endswith("retry in 1.5s")


# -- half-open trials ----------------------------------------------------------------------------


async def test_a_trial_of_three_probes_survives_two_failures_and_closes_on_a_success() -> None:
    clock = ManualClock()
    config = BreakerConfig(fail_max=1, reset_timeout=10.0, half_open_probes=3)
    breaker = Breaker(ROUTE, config, clock)
    assert config.tolerated_failures == 2
    upstream = Upstream()
    await fail(breaker, upstream)
    clock.advance(10.0)
    await fail(breaker, upstream)
    await fail(breaker, upstream)
    assert breaker.state == "half_open"  # two unlucky probes: the trial goes on
    await answer(breaker, upstream)
    assert breaker.state == "closed"


async def test_a_trial_reopens_once_it_can_no_longer_reach_success_threshold() -> None:
    clock = ManualClock()
    config = BreakerConfig(fail_max=1, reset_timeout=10.0, success_threshold=2, half_open_probes=3)
    breaker = Breaker(ROUTE, config, clock)
    upstream = Upstream()
    await fail(breaker, upstream)
    clock.advance(10.0)
    await fail(breaker, upstream)  # 1 failure: 2 of the 3 can still succeed
    assert breaker.state == "half_open"
    await fail(breaker, upstream)  # 2 failures: they cannot
    assert breaker.state == "open"


async def test_concurrent_probes_one_failing_then_two_succeeding_close_it() -> None:
    clock = ManualClock()
    config = BreakerConfig(fail_max=1, reset_timeout=10.0, success_threshold=2, half_open_probes=3)
    breaker = Breaker(ROUTE, config, clock)
    await fail(breaker, Upstream())
    clock.advance(10.0)
    gated = [Upstream() for _ in range(3)]
    for upstream, status in zip(gated, (503, 200, 200), strict=True):
        upstream.status, upstream.gate = status, asyncio.Event()
    tasks = [asyncio.create_task(breaker.handle(make_flow(), u)) for u in gated]
    await let_run()
    assert [u.calls for u in gated] == [1, 1, 1]  # all three admitted at once
    extra = await refused(breaker, Upstream())
    assert "probe is in flight" in extra.message
    for upstream in gated:
        assert upstream.gate is not None
        upstream.gate.set()
        await let_run()
    await asyncio.gather(*tasks)
    assert breaker.state == "closed"


# -- waiting instead of refusing -----------------------------------------------------------------


async def test_a_request_waits_out_the_end_of_a_short_opening_and_becomes_the_probe() -> None:
    clock = ManualClock()
    config = BreakerConfig(fail_max=1, open_initial=0.5, reset_timeout=30.0, max_wait=1.0)
    breaker = Breaker(ROUTE, config, clock)
    await fail(breaker, Upstream())
    flow = make_flow()
    reply = await breaker.handle(flow, Upstream())  # 0.5 s left: within max_wait
    assert reply.status == 200
    assert clock.sleeps == [0.5]
    assert flow.trace.breaker == "half_open" and flow.trace.waited_seconds == pytest.approx(0.5)
    assert breaker.state == "closed"


async def test_no_wait_when_the_opening_outlasts_max_wait_and_nothing_else_can_close_it() -> None:
    clock = ManualClock()
    config = BreakerConfig(fail_max=1, open_initial=5.0, reset_timeout=30.0, max_wait=1.0)
    breaker = Breaker(ROUTE, config, clock)
    await fail(breaker, Upstream())
    error = await refused(breaker, Upstream())
    assert clock.sleeps == []  # refused at once, as without max_wait
    assert error.retry_after_s == 5.0


async def test_a_wait_never_takes_more_than_half_of_what_the_deadline_leaves() -> None:
    clock = ManualClock()
    config = BreakerConfig(fail_max=1, open_initial=0.5, reset_timeout=30.0, max_wait=5.0)
    breaker = Breaker(ROUTE, config, clock)
    await fail(breaker, Upstream())
    with pytest.raises(CircuitOpen):
        await breaker.handle(flow_with(clock, 0.8), Upstream())  # may wait 0.4 s of the 0.5 s
    assert clock.sleeps == []


async def test_requests_wait_for_the_probe_and_follow_its_verdict() -> None:
    clock = SteppedClock()
    config = BreakerConfig(fail_max=1, open_initial=1.0, reset_timeout=30.0, max_wait=1.5)
    breaker = Breaker(ROUTE, config, clock)
    await fail(breaker, Upstream())
    clock.advance(1.0)
    probe = Upstream()
    probe.gate = asyncio.Event()
    first = asyncio.create_task(breaker.handle(make_flow(), probe))
    await let_run()
    others = Upstream()
    waiting = [asyncio.create_task(breaker.handle(make_flow(), others)) for _ in range(5)]
    await let_run()
    assert breaker.state == "half_open" and not any(t.done() for t in waiting)
    assert others.calls == 0  # they wait for the verdict instead of being refused
    probe.gate.set()
    await asyncio.gather(first, *waiting)
    assert others.calls == 5 and breaker.state == "closed"

    # The next trial's probe fails: the circuit reopens for 2 s, longer than the waiters may wait.
    await fail(breaker, Upstream())
    clock.advance(1.0)
    probe = Upstream()
    probe.status, probe.gate = 503, asyncio.Event()
    first = asyncio.create_task(breaker.handle(make_flow(), probe))
    await let_run()
    waiting = [asyncio.create_task(breaker.handle(make_flow(), others)) for _ in range(3)]
    await let_run()
    probe.gate.set()
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, CircuitOpen) for r in results)
    assert (await first).status == 503 and others.calls == 5


# -- slow start ----------------------------------------------------------------------------------


async def test_slow_start_admits_a_growing_share_of_a_backlog_over_its_window() -> None:
    clock = SteppedClock()
    config = BreakerConfig(fail_max=1, reset_timeout=1.0, slow_start=2.0)
    breaker = Breaker(ROUTE, config, clock)
    upstream = Upstream()
    await fail(breaker, upstream)
    clock.advance(1.0)
    await answer(breaker, upstream)  # the probe closes it; the ramp starts now
    assert breaker.state == "closed"
    before = upstream.calls
    backlog = [asyncio.create_task(breaker.handle(make_flow(), upstream)) for _ in range(40)]
    admitted = []
    for _ in range(4):
        await let_run()
        admitted.append(upstream.calls - before)
        clock.advance(0.5)
    await asyncio.gather(*backlog)
    admitted.append(upstream.calls - before)
    # Evenly spread places: about a quarter more of the backlog every half second.
    assert admitted[0] <= 2
    for got, want in zip(admitted[1:], (10, 20, 30, 40), strict=True):
        assert abs(got - want) <= 2, admitted
    fresh = make_flow()
    await breaker.handle(fresh, upstream)
    assert clock.sleeps[-1] < 2.0 and fresh.trace.breaker == "closed"  # the ramp is over


async def test_slow_start_refuses_a_request_whose_deadline_cannot_wait_for_its_place() -> None:
    clock = ManualClock()
    config = BreakerConfig(fail_max=1, reset_timeout=1.0, slow_start=10.0)
    breaker = Breaker(ROUTE, config, clock)
    await fail(breaker, Upstream())
    clock.advance(1.0)
    await answer(breaker, Upstream())
    # The first place is 0.618 of the ramp: 6.2 s away, more than half of 4 s.
    flow = flow_with(clock, 4.0)
    with pytest.raises(CircuitOpen) as info:
        await breaker.handle(flow, Upstream())
    assert info.value.headers == {"X-Circuit": "slow-start"}
    assert info.value.retry_after_s == pytest.approx(6.18, abs=0.01)
    assert "traffic returns gradually over 10s" in info.value.message
    assert flow.trace.breaker == "slow_start"


async def test_an_admin_reset_skips_slow_start() -> None:
    clock = ManualClock()
    breaker = Breaker(ROUTE, BreakerConfig(fail_max=1, slow_start=10.0), clock)
    await fail(breaker, Upstream())
    await breaker.reset()
    await answer(breaker, Upstream())
    assert clock.sleeps == []


# -- retries of requests admitted before the trip ------------------------------------------------


async def test_only_the_probes_of_a_half_open_trial_may_retry() -> None:
    clock = ManualClock()
    breaker = Breaker(ROUTE, BreakerConfig(fail_max=1, reset_timeout=1.0), clock)
    asked: list[tuple[str, bool]] = []
    probing = asyncio.Event()

    async def admitted_while_closed(flow: Flow) -> Reply:
        asked.append(("closed", breaker.halts_retries()))
        await probing.wait()
        asked.append(("straggler while half-open", breaker.halts_retries()))
        return Reply(503, CIMultiDict())

    async def probe(flow: Flow) -> Reply:
        asked.append(("probe", breaker.halts_retries()))
        probing.set()
        await let_run()  # the straggler asks meanwhile, from its own request
        return Reply(200, CIMultiDict())

    straggler = asyncio.create_task(breaker.handle(make_flow(), admitted_while_closed))
    await let_run()
    await fail(breaker, Upstream())
    assert breaker.halts_retries()  # open
    clock.advance(1.0)
    await breaker.handle(make_flow(), probe)
    assert (await straggler).status == 503
    assert asked == [
        ("closed", False),
        ("probe", False),  # a probe of this trial may retry
        ("straggler while half-open", True),  # its retry would be an extra, ungated probe
    ]
    assert breaker.state == "closed"  # the straggler's failure belonged to the closed era


# -- active probes -------------------------------------------------------------------------------


@dataclass
class Prober:
    """A scripted send_probe: answers the next status (or raises), counting calls."""

    statuses: list[int | Exception]
    sent: int = 0

    async def __call__(self) -> int:
        self.sent += 1
        answer = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


PROBED = BreakerConfig(
    fail_max=1,
    open_initial=10.0,
    reset_timeout=60.0,
    probe=ProbeConfig(every=1.0, method="GET", path="/usage", expect=frozenset({200})),
)


async def test_an_active_probe_closes_the_circuit_as_soon_as_the_vendor_answers() -> None:
    clock = SteppedClock()
    events = ProbeEvents()
    prober = Prober([UpstreamUnreachable("refused"), 503, 200])
    breaker = Breaker(ROUTE, PROBED, clock, events, send_probe=prober)
    await breaker.start()
    try:
        await fail(breaker, Upstream())
        await let_run()
        assert prober.sent == 0  # the first probe waits `every`: the vendor just failed
        for expected in (1, 2):
            clock.advance(1.0)
            await eventually(lambda n=expected: prober.sent == n)
            assert breaker.state == "open"
        clock.advance(1.0)
        await eventually(lambda: breaker.state == "closed")
        assert prober.sent == 3 and events.probes == ["failed", "failed", "ok"]
        assert events.transitions == ["open", "closed"]  # no half-open: 7 s before it was due
        assert breaker.level == 1  # a probe's close is confirmed by the first request through
        await answer(breaker, Upstream())
        assert breaker.level == 0
        clock.advance(5.0)
        await let_run()
        assert prober.sent == 3  # closed: no probes
    finally:
        await breaker.stop()


async def test_a_probe_whose_close_is_not_confirmed_is_not_trusted_again() -> None:
    clock = SteppedClock()
    events = ProbeEvents()
    prober = Prober([200])  # the probe endpoint answers while searches fail
    breaker = Breaker(ROUTE, PROBED, clock, events, send_probe=prober)
    await breaker.start()
    try:
        await fail(breaker, Upstream())
        await let_run()  # the probe loop sees the opening and starts its wait
        clock.advance(1.0)
        await eventually(lambda: breaker.state == "closed")
        await fail(breaker, Upstream())  # straight back open: the probe lied
        assert breaker.level == 2 and breaker.seconds_until_half_open() == 20.0
        clock.advance(3.0)
        await let_run()
        assert prober.sent == 1  # no more probes: half-open decides alone
        clock.advance(17.0)
        await answer(breaker, Upstream())  # a real request gets through
        assert breaker.state == "closed" and breaker.level == 0
        await fail(breaker, Upstream())
        await let_run()
        clock.advance(1.0)
        await eventually(lambda: prober.sent == 2)  # trusted again
    finally:
        await breaker.stop()


async def test_a_waiting_request_is_admitted_when_a_probe_closes_the_circuit() -> None:
    clock = SteppedClock()
    config = BreakerConfig(
        fail_max=1, open_initial=10.0, reset_timeout=60.0, max_wait=1.5, probe=PROBED.probe
    )
    prober = Prober([200])
    breaker = Breaker(ROUTE, config, clock, send_probe=prober)
    await breaker.start()
    try:
        await fail(breaker, Upstream())
        upstream = Upstream()
        waiting = asyncio.create_task(breaker.handle(make_flow(), upstream))
        await let_run()
        assert not waiting.done()  # 10 s to half-open, but a probe may close it sooner
        clock.advance(1.0)
        assert (await waiting).status == 200
        assert upstream.calls == 1
    finally:
        await breaker.stop()


async def test_with_a_fallback_to_ask_an_open_circuit_refuses_at_once_despite_a_probe() -> None:
    """A fallback answers now: hoping a probe closes the circuit within max_wait is not worth
    the wait (Context.wait_at_most, set by failover)."""
    clock = SteppedClock()
    config = BreakerConfig(
        fail_max=1, open_initial=10.0, reset_timeout=60.0, max_wait=1.5, probe=PROBED.probe
    )
    breaker = Breaker(ROUTE, config, clock, send_probe=Prober([200]))
    await breaker.start()
    try:
        await fail(breaker, Upstream())
        flow = make_flow()
        flow.context.wait_at_most = 0.25
        with pytest.raises(CircuitOpen):
            await breaker.handle(flow, Upstream())
        assert flow.trace.waited_seconds == 0.0
    finally:
        await breaker.stop()


async def test_a_slow_start_place_beyond_wait_at_most_is_refused_for_the_fallback() -> None:
    clock = ManualClock()
    config = BreakerConfig(fail_max=1, reset_timeout=1.0, slow_start=2.0)
    breaker = Breaker(ROUTE, config, clock)
    await fail(breaker, Upstream())
    clock.advance(1.0)
    await answer(breaker, Upstream())  # closed: the ramp starts; the first place is 1.24 s in
    flow = make_flow()
    flow.context.wait_at_most = 0.25
    with pytest.raises(CircuitOpen) as info:
        await breaker.handle(flow, Upstream())
    assert info.value.headers == {"X-Circuit": "slow-start"} and clock.sleeps == []
    reply = await breaker.handle(make_flow(), Upstream())  # no fallback: it waits its place
    assert reply.status == 200 and clock.sleeps and clock.sleeps[0] < 2.0


@pytest.mark.parametrize(("probe", "halted"), [(PROBED.probe, True), (None, False)])
async def test_a_trial_is_one_attempt_while_an_active_probe_watches_the_vendor(
    probe: ProbeConfig | None, halted: bool
) -> None:
    """The probe tells when the vendor is back: a half-open trial need not retry, so an outage
    costs one search per trial rather than one per attempt."""
    clock = SteppedClock()
    config = BreakerConfig(fail_max=1, open_initial=1.0, reset_timeout=60.0, probe=probe)
    breaker = Breaker(ROUTE, config, clock, send_probe=Prober([503]))
    await breaker.start()
    try:
        await fail(breaker, Upstream())
        clock.advance(1.0)  # the opening is over (the probe failed meanwhile)
        seen: list[bool] = []

        async def trial(flow: Flow) -> Reply:
            seen.append(breaker.halts_retries())
            return Reply(503, CIMultiDict())

        await breaker.handle(make_flow(), trial)
        assert seen == [halted]
    finally:
        await breaker.stop()


# -- replicas sharing Redis ----------------------------------------------------------------------


@dataclass
class ProbingReplicas:
    a: Breaker
    b: Breaker
    probers: list[Prober]
    clock: SteppedClock


@pytest.fixture
async def probing_replicas(redis_server: RedisServer) -> AsyncIterator[ProbingReplicas]:
    clock = SteppedClock()
    config = BreakerConfig(
        fail_max=1,
        open_initial=30.0,
        reset_timeout=60.0,
        probe=ProbeConfig(every=0.2, path="/usage"),
    )
    links = [RedisLink(redis_server.url, "test") for _ in range(2)]
    probers = [Prober([503]), Prober([503])]
    a, b = (
        Breaker(ROUTE, config, clock, ProbeEvents(), link, send_probe=prober)
        for link, prober in zip(links, probers, strict=True)
    )
    await a.start()
    await b.start()
    try:
        yield ProbingReplicas(a, b, probers, clock)
    finally:
        await a.stop()
        await b.stop()
        for link in links:
            await link.close()


async def test_one_replica_at_a_time_probes_and_its_close_reaches_the_other(
    probing_replicas: ProbingReplicas,
) -> None:
    a, b, probers, clock = (
        probing_replicas.a,
        probing_replicas.b,
        probing_replicas.probers,
        probing_replicas.clock,
    )
    await fail(a, Upstream())
    await eventually(lambda: b.state == "open", within=1.0)
    for round_ in range(1, 4):
        await asyncio.sleep(0.25)  # real time: the previous round's lease (0.2 s) has expired
        clock.advance(0.2)  # both replicas' probe loops wake together
        await eventually(lambda r=round_: sum(p.sent for p in probers) >= r)
        await asyncio.sleep(0.05)
        assert sum(p.sent for p in probers) == round_  # the lease let exactly one of them probe
    for prober in probers:
        prober.statuses = [200]
    await asyncio.sleep(0.25)
    clock.advance(0.2)
    await eventually(lambda: a.state == "closed" and b.state == "closed", within=1.5)
    assert sum(p.sent for p in probers) == 4


async def test_the_open_time_level_is_shared_with_the_other_replica(
    redis_server: RedisServer,
) -> None:
    clock = ManualClock()
    links = [RedisLink(redis_server.url, "test") for _ in range(2)]
    a, b = (Breaker(ROUTE, ADAPTIVE, clock, RecordingEvents(), link) for link in links)
    await a.start()
    await b.start()
    try:
        upstream = Upstream()
        await fail(a, upstream)
        for _ in range(2):
            await asyncio.sleep(0.1)  # real time for the last transition to reach Redis
            clock.advance(a.seconds_until_half_open())
            await fail(a, upstream)
        assert (a.level, a.seconds_until_half_open()) == (3, 4.0)
        await eventually(lambda: b.level == 3, within=1.0)
        assert b.seconds_until_half_open() == pytest.approx(4.0, abs=0.05)
    finally:
        await a.stop()
        await b.stop()
        for link in links:
            await link.close()


def test_snapshots_carry_the_level_and_older_five_field_ones_still_parse() -> None:
    snap = Snapshot("open", 1_700_000_000_123_456, 1_700_000_000_000_000, 5, "replica-a", 4)
    assert snap.encode().endswith("|replica-a|4")
    assert parse_snapshot(snap.encode()) == snap
    older = parse_snapshot(b"open|1|2|3|replica-b")
    assert older == Snapshot("open", 1, 2, 3, "replica-b", 0)
    assert parse_snapshot(b"open|1|2|3|o|-1") is None
    assert parse_snapshot(b"open|1|2|3|o|99999") is None


# -- config --------------------------------------------------------------------------------------


def breaker_config(breaker: dict[str, Any]) -> BreakerConfig:
    raw = {"routes": {"t": {"prefix": "/t", "upstream": "https://x.example", "breaker": breaker}}}
    cfg = parse_config(raw, {}).routes["t"].section("breaker")
    assert cfg is not None
    return cfg


def test_config_reads_every_recovery_key_and_prints_them_back() -> None:
    raw = {
        "fail_max": 3,
        "open_initial": "500ms",
        "open_multiplier": 1.5,
        "reset_timeout": "1m",
        "half_open_probes": 3,
        "max_wait": "2s",
        "slow_start": "5s",
        "probe": {
            "every": "1s",
            "method": "post",
            "path": "/health?deep=1",
            "body": {"query": "ping"},
            "expect": 204,
        },
    }
    cfg = breaker_config(raw)
    assert cfg == BreakerConfig(
        fail_max=3,
        open_initial=0.5,
        open_multiplier=1.5,
        reset_timeout=60.0,
        half_open_probes=3,
        max_wait=2.0,
        slow_start=5.0,
        probe=ProbeConfig(
            every=1.0,
            method="POST",
            path="/health?deep=1",
            body='{"query":"ping"}',
            expect=frozenset({204}),
        ),
    )
    full = parse_config(
        {"routes": {"t": {"prefix": "/t", "upstream": "https://x.example", "breaker": raw}}}, {}
    )
    printed = yaml.safe_load(yaml.safe_dump(as_document(full)))
    assert parse_config(printed, {}) == full
    defaults = breaker_config({})
    assert (defaults.open_initial, defaults.max_wait, defaults.slow_start) == (None, 0.0, 0.0)
    assert defaults.probe is None and defaults.open_seconds(3) == defaults.reset_timeout


def test_the_section_prints_back_what_it_parses_on_its_own() -> None:
    raw = {"open_initial": "2s", "slow_start": "1s", "probe": {"every": "3s", "expect": [200, 204]}}
    cfg = SECTION.parse(raw, "breaker")
    assert SECTION.key == "breaker"
    assert SECTION.parse(yaml.safe_load(yaml.safe_dump(SECTION.document(cfg))), "breaker") == cfg
    with pytest.raises(ConfigError, match=r"^breaker\.reset_timeout: expected a duration above 0 "):
        SECTION.parse({"reset_timeout": "25h"}, "breaker")  # the shared record lives a day


@pytest.mark.parametrize(
    ("breaker", "message"),
    [
        (
            {"open_initial": "1m"},
            "routes.t.breaker.open_initial: must not exceed reset_timeout (30s, the default)",
        ),
        ({"open_multiplier": 0.5}, "routes.t.breaker.open_multiplier: expected a number from 1"),
        ({"probe": {"path": "/x"}}, "routes.t.breaker.probe.every: required key is missing"),
        ({"probe": {"every": "1s", "path": "usage"}}, "routes.t.breaker.probe.path: expected a"),
        ({"probe": {"every": "1s", "path": "/../x"}}, "routes.t.breaker.probe.path: expected a"),
        ({"probe": {"every": "1s", "body": "{oops"}}, "routes.t.breaker.probe.body: expected JSON"),
        ({"probe": {"every": "1s", "method": "DELETE"}}, "routes.t.breaker.probe.method: expected"),
        ({"probe": {"every": "1s", "expect": [700]}}, "routes.t.breaker.probe.expect[0]: expected"),
        ({"max_wait": "soon"}, "routes.t.breaker.max_wait: expected a duration"),
    ],
)
def test_config_mistakes_name_their_path(breaker: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        breaker_config(breaker)
    assert message in str(info.value)


# -- through the proxy ---------------------------------------------------------------------------


@pytest.mark.integration
async def test_the_proxy_probes_with_the_route_credentials_and_closes_on_recovery(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    breaker = {
        "fail_max": 2,
        "reset_timeout": "1h",
        "probe": {"every": "50ms", "method": "GET", "path": "/echo/health"},
    }
    raw = {
        "routes": {
            "tavily": route(
                vendor.url,
                "/tavily",
                breaker=breaker,
                headers={"set": {"Authorization": "Bearer route-key"}},
            )
        }
    }
    client = await start_proxy(raw)
    vendor.down(503)
    for _ in range(2):
        assert (await client.post("/tavily/search", json={"query": "q"})).status == 503
    r = await client.post("/tavily/search", json={"query": "q"})
    assert r.status == 503 and r.headers["X-Circuit"] == "open"
    await vendor.wait_for_requests(4, path_prefix="/echo/health")  # probes, failing meanwhile
    vendor.up()

    async def answered() -> bool:
        return (await client.post("/tavily/search", json={"query": "back"})).status == 200

    await eventually(answered, within=2.0)  # closed by a probe, an hour before half-open
    probe = next(rec for rec in vendor.requests if rec.path == "/echo/health")
    assert probe.method == "GET" and probe.headers["Authorization"] == "Bearer route-key"
    text = await (await client.get("/metrics")).text()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    probes = "search_proxy_breaker_probes_total"
    assert samples[(probes, (("result", "ok"), ("route", "tavily")))] == 1.0
    assert samples[(probes, (("result", "failed"), ("route", "tavily")))] >= 4.0
    open_s = samples[("search_proxy_breaker_open_seconds_total", (("route", "tavily"),))]
    assert 0.1 < open_s < 5.0  # from the trip to the probe's close, in real time

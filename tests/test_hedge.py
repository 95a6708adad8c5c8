"""Hedged attempts, on a ManualClock: the latency window `after: auto` reads, the race inside the
retry loop (winner, cancelled losers, failures), what each hedge spends (a rate-limit token, a
retry-budget slot) and which requests are never hedged; and the `hedge:` config section."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from multidict import CIMultiDict

from policies.backoff import RetryBudget
from policies.core.clock import SYSTEM_CLOCK, ManualClock
from policies.core.errors import UpstreamTimeout
from policies.core.events import NullEvents
from policies.core.flow import Flow, Handler, Reply, compose
from policies.core.outcome import Outcome
from policies.hedge import Hedge, HedgeBudgetConfig, HedgeConfig
from policies.latency import BUCKETS, LatencyWindow, bucket_of, bucket_top
from policies.profiles import BUILTIN_PROFILES
from policies.ratelimit import MemoryBuckets, RateLimit, RateLimitConfig
from policies.retry import BackoffConfig, BudgetConfig, Retry, RetryConfig
from policies.search import search_classifier
from proxy.config import ConfigError, as_document, parse_config

TAVILY = BUILTIN_PROFILES["tavily"]
CLASSIFY = search_classifier(TAVILY)
SEARCH = orjson.dumps({"query": "hedged search"})


class Recorder(NullEvents):
    def __init__(self) -> None:
        self.hedges: list[str] = []
        self.attempts: list[Outcome] = []
        self.tokens: list[str] = []
        self.retries: list[str] = []

    def hedge(self, route: str, result: str) -> None:
        self.hedges.append(result)

    def attempt(self, route: str, outcome: Outcome) -> None:
        self.attempts.append(outcome)

    def ratelimit(self, route: str, decision: str, waited_s: float) -> None:
        self.tokens.append(decision)

    def retry(self, route: str, reason: str) -> None:
        self.retries.append(reason)


def answer(status: int = 200, results: int = 1) -> Reply:
    body = {
        "results": [
            {"url": f"https://e.com/{i}", "title": "t", "content": "c"} for i in range(results)
        ]
    }
    return Reply(status, CIMultiDict({"Content-Type": "application/json"}), orjson.dumps(body))


class Vendor:
    """The end of the chain. Each call takes the next scripted answer: a Reply or an error at
    once, or HELD: the call waits until the test calls `answer(i, ...)`. It records calls and
    cancellations (a hedge's loser) and counts connections given back (`Reply.discard`)."""

    def __init__(self, *script: Reply | Exception | None) -> None:
        self.script = list(script)
        self.calls = 0
        self.cancelled = 0
        self.released = 0
        self.held: dict[int, asyncio.Future[Reply]] = {}

    async def __call__(self, flow: Flow) -> Reply:
        index = self.calls
        self.calls += 1
        step = self.script[index] if index < len(self.script) else answer()
        if step is HELD:
            self.held[index] = asyncio.get_running_loop().create_future()
            try:
                reply = await self.held[index]
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        elif isinstance(step, Exception):
            raise step
        else:
            assert step is not None
            reply = step
        reply.release = self._release
        return reply

    def answer(self, index: int, result: Reply | Exception) -> None:
        future = self.held[index]
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result(result)

    def _release(self) -> None:
        self.released += 1


HELD = None  # a vendor call that waits for the test to answer it


async def settle() -> None:
    """Let every task run until it waits on something only the test can give."""
    for _ in range(20):
        await asyncio.sleep(0)


def timed_out() -> UpstreamTimeout:
    return UpstreamTimeout("timed out", route="r")


def make_flow(
    clock: ManualClock,
    method: str = "POST",
    path: str = "/search",
    body: bytes = SEARCH,
    deadline_in: float = 30.0,
) -> Flow:
    now = clock.now()
    return Flow.new(
        route="r",
        method=method,
        path=path,
        query_string="",
        headers=CIMultiDict(),
        body=body,
        request_id="rid",
        client="",
        deadline=now + deadline_in,
        started=now,
    )


def make_hedge(
    clock: ManualClock,
    events: Recorder,
    *,
    after_s: float | str = 0.2,
    retry_budget: RetryBudget | None = None,
    **config: Any,
) -> Hedge:
    cfg = HedgeConfig(after=after_s, **config)  # type: ignore[arg-type]
    return Hedge(
        "r",
        cfg,
        per_try=2.0,
        clock=clock,
        events=events,
        classify=CLASSIFY,
        profile=TAVILY,
        retry_budget=retry_budget,
    )


# ---------------------------------------------------------------------------------------------
# The latency window


def test_buckets_cover_one_ms_to_two_minutes_within_eight_percent() -> None:
    for seconds in (0.0005, 0.001, 0.0123, 0.3, 1.0, 7.7, 119.0):
        top = bucket_top(bucket_of(seconds))
        assert seconds <= top * (1 + 1e-9)
        assert top <= max(seconds, 0.001) * 1.08 * (1 + 1e-9)
    assert bucket_of(1e6) == BUCKETS - 1
    assert bucket_of(float("nan")) == 0


def test_percentile_reads_the_recorded_durations_from_above() -> None:
    clock = ManualClock()
    window = LatencyWindow(clock)
    assert window.percentile(0.95) is None  # nothing known: no hedge
    for i in range(1, 101):
        window.record(i / 100)  # 10 ms .. 1 s
    p95 = window.percentile(0.95)
    p50 = window.percentile(0.5)
    assert p95 is not None and p50 is not None
    assert 0.95 <= p95 <= 0.95 * 1.08
    assert 0.50 <= p50 <= 0.50 * 1.08


def test_percentile_needs_enough_samples() -> None:
    window = LatencyWindow(ManualClock())
    for _ in range(19):
        window.record(0.1)
    assert window.percentile(0.95, min_samples=20) is None
    window.record(0.1)
    assert window.percentile(0.95, min_samples=20) == pytest.approx(0.1, rel=0.08)


def test_old_samples_fade_so_the_window_follows_the_route() -> None:
    clock = ManualClock()
    window = LatencyWindow(clock, half_life=10.0)
    for _ in range(100):
        window.record(2.0)
    clock.advance(100.0)  # ten half-lives: the old samples weigh 1/1024 each
    for _ in range(100):
        window.record(0.1)
    assert window.percentile(0.95) == pytest.approx(0.1, rel=0.08)
    assert 100 < window.samples() < 100.2


def test_weights_are_rescaled_without_changing_percentiles() -> None:
    clock = ManualClock()
    window = LatencyWindow(clock, half_life=1.0)
    for _ in range(50):
        window.record(0.2)
    clock.advance(41.0)  # past the rescale point
    for _ in range(50):
        window.record(0.3)
    assert window.percentile(0.5) == pytest.approx(0.3, rel=0.08)
    assert window.samples() == pytest.approx(50.0, rel=1e-6)


def test_attempts_cut_short_count_as_at_least_that_slow() -> None:
    """A cancelled slow attempt is the tail: leaving it out would pull the percentile down
    until every request is hedged."""
    window = LatencyWindow(ManualClock())
    for _ in range(94):
        window.record(0.1)
    for _ in range(3):
        window.record(0.5)
    for _ in range(3):
        window.record_cut(0.8)  # fewer than 4%: the percentile of the whole is known
    # 6% took 0.5 s or longer, the cut ones included; of the finished ones alone, only 3%.
    assert window.percentile(0.96) == pytest.approx(0.5, rel=0.08)


def test_when_more_attempts_never_finish_than_the_tail_the_finished_ones_decide() -> None:
    """10% of attempts hang: the 95th percentile of all is infinite, so the 95th percentile of
    the attempts that answered is read, and hedges go out early instead of never."""
    window = LatencyWindow(ManualClock())
    for i in range(90):
        window.record(0.01 + i / 10000)
    for _ in range(10):
        window.record_cut(0.05)
    found = window.percentile(0.95)
    assert found is not None and found < 0.025


# ---------------------------------------------------------------------------------------------
# The race


async def test_a_slow_attempt_is_hedged_and_the_first_usable_answer_wins() -> None:
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(HELD, answer(results=3))
    hedge = make_hedge(clock, events, after_s=0.2)
    flow = make_flow(clock)
    # One attempt of the retry loop, which counts the request's attempts, hedged.
    retry = Retry("r", RetryConfig(attempts=1), per_try=2.0, clock=clock, events=NullEvents())
    reply = await compose([retry, hedge], vendor)(flow)
    assert reply.status == 200 and len(orjson.loads(reply.body)["results"]) == 3
    assert vendor.calls == 2 and vendor.cancelled == 1  # the loser was cancelled
    assert clock.sleeps == [pytest.approx(0.2)]  # the hedge waited `after`
    assert events.hedges == ["won"]
    # The request's own attempt count is the retry loop's; the hedge is counted apart.
    assert flow.trace.attempts == 1 and flow.trace.hedges == 1
    assert flow.trace.reply_headers["X-Proxy-Hedges"] == "1"


async def test_a_fast_answer_is_never_hedged() -> None:
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(answer())
    flow = make_flow(clock)
    reply = await compose([make_hedge(clock, events)], vendor)(flow)
    assert reply.status == 200 and vendor.calls == 1
    assert events.hedges == [] and flow.trace.hedges == 0
    assert "X-Proxy-Hedges" not in flow.trace.reply_headers


def held_round() -> tuple[Recorder, Vendor, asyncio.Task[Reply]]:
    """A hedged round running against a vendor that holds both attempts until answered: its
    events, the vendor, and the round's task."""
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(HELD, HELD)
    task = asyncio.ensure_future(compose([make_hedge(clock, events)], vendor)(make_flow(clock)))
    return events, vendor, task


async def test_when_the_first_attempt_wins_the_hedge_is_cancelled() -> None:
    events, vendor, task = held_round()
    await settle()
    assert vendor.calls == 2  # the hedge went out
    first = answer(results=2)
    vendor.answer(0, first)
    assert await task is first
    assert vendor.cancelled == 1 and events.hedges == ["cancelled"]


async def test_a_first_attempt_that_fails_while_a_hedge_runs_waits_for_the_hedge() -> None:
    events, vendor, task = held_round()
    await settle()
    vendor.answer(0, answer(503))
    await settle()
    assert not task.done()
    vendor.answer(1, answer())
    reply = await task
    assert reply.status == 200
    assert events.hedges == ["won"]
    # The loser's outcome; the retry loop counts the winner's.
    assert events.attempts == [Outcome.SERVER_ERROR]
    assert vendor.released == 1  # the failed answer's connection was given back


async def test_a_winning_hedge_interrupts_the_first_attempt_and_leaves_no_cancel_behind() -> None:
    # The first attempt runs in the round's own task: the hedge's win cancels it there, and
    # the round takes that cancellation as the hedge's answer, not as its own end.
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(HELD, HELD)

    async def round_then_more() -> tuple[Reply, int]:
        reply = await compose([make_hedge(clock, events)], vendor)(make_flow(clock))
        await asyncio.sleep(0)  # the task goes on, with no cancellation left pending
        task = asyncio.current_task()
        assert task is not None
        return reply, task.cancelling()

    task = asyncio.ensure_future(round_then_more())
    await settle()
    won = answer(results=4)
    vendor.answer(1, won)
    reply, cancelling = await task
    assert reply is won and cancelling == 0
    assert vendor.cancelled == 1 and events.hedges == ["won"]


async def test_a_round_cancelled_from_outside_cancels_its_hedges_and_ends_cancelled() -> None:
    events, vendor, task = held_round()
    await settle()
    assert vendor.calls == 2
    task.cancel()  # the agent left
    with pytest.raises(asyncio.CancelledError):
        await task
    assert vendor.cancelled == 2 and events.hedges == ["cancelled"]


async def test_cancelled_from_outside_as_a_hedge_wins_the_round_still_ends_cancelled() -> None:
    _, vendor, task = held_round()
    await settle()
    vendor.answer(1, answer())  # the hedge wins ...
    task.cancel()  # ... as the agent leaves: its cancellation is not the round's to take
    with pytest.raises(asyncio.CancelledError):
        await task
    assert vendor.released == 1  # the winner's connection given back all the same


async def test_a_round_cancelled_before_its_hedge_is_due_sends_none() -> None:
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(HELD)
    hedge = make_hedge(clock, events, after_s=5.0)
    task = asyncio.ensure_future(compose([hedge], vendor)(make_flow(clock)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settle()  # the hedge's timer, cancelled with the round, sends nothing later
    assert vendor.calls == 1 and events.hedges == []


async def test_when_every_attempt_fails_the_round_ends_as_the_first_did() -> None:
    events, vendor, task = held_round()
    await settle()
    vendor.answer(1, answer(502))
    vendor.answer(0, timed_out())
    with pytest.raises(UpstreamTimeout):
        await task
    assert events.hedges == ["lost"] and events.attempts == [Outcome.SERVER_ERROR]
    assert vendor.released == 1


async def test_a_quick_failure_goes_back_to_the_retry_loop_without_a_hedge() -> None:
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(answer(503))
    reply = await compose([make_hedge(clock, events)], vendor)(make_flow(clock))
    assert reply.status == 503 and vendor.calls == 1 and events.hedges == []


async def test_max_extra_sends_hedges_one_after_another() -> None:
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(HELD, HELD, answer())
    flow = make_flow(clock)
    budget = HedgeBudgetConfig(min_per_s=2)
    hedge = make_hedge(clock, events, after_s=0.2, max_extra=2, budget=budget)
    reply = await compose([hedge], vendor)(flow)
    assert reply.status == 200 and vendor.calls == 3 and vendor.cancelled == 2
    assert sorted(events.hedges) == ["cancelled", "won"]
    assert flow.trace.hedges == 2 and flow.trace.reply_headers["X-Proxy-Hedges"] == "2"
    assert clock.sleeps == [pytest.approx(0.2), pytest.approx(0.2)]  # at 1x and 2x after


async def test_no_hedge_is_sent_once_the_deadline_is_too_close() -> None:
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(HELD)
    flow = make_flow(clock, deadline_in=0.22)  # 20 ms left when the hedge would go
    task = asyncio.ensure_future(compose([make_hedge(clock, events)], vendor)(flow))
    await settle()
    assert clock.sleeps == [pytest.approx(0.2)] and vendor.calls == 1
    vendor.answer(0, answer())
    assert (await task).status == 200 and flow.trace.hedges == 0


async def test_after_auto_hedges_once_the_window_knows_the_routes_latency() -> None:
    clock = ManualClock()
    events = Recorder()
    hedge = make_hedge(clock, events, after_s="auto", percentile=0.9)

    async def vendor(flow: Flow) -> Reply:
        clock.advance(0.1)
        return answer()

    assert hedge.after() is None
    for _ in range(21):  # no hedge while the window fills (old samples weigh a bit less)
        await compose([hedge], vendor)(make_flow(clock))
    assert events.hedges == [] and clock.sleeps == []
    assert hedge.after() == pytest.approx(0.1, rel=0.08)


async def test_a_cancelled_first_attempt_stays_a_sample_of_the_window() -> None:
    """The hedge's own time is not a sample (it started late and won a race); the attempt it
    beat is, cut short: dropping it would leave out exactly the slow tail."""
    clock = ManualClock()
    hedge = make_hedge(clock, Recorder(), after_s="auto")
    assert hedge.window is not None
    for _ in range(40):
        hedge.window.record(0.1)
    vendor = Vendor(HELD, answer())
    await compose([hedge], vendor)(make_flow(clock))
    assert vendor.cancelled == 1
    assert hedge.window.samples() == pytest.approx(41, rel=0.01)


# ---------------------------------------------------------------------------------------------
# What each hedge spends


def make_chain(
    clock: ManualClock,
    events: Recorder,
    vendor: Vendor,
    *,
    retry_budget: BudgetConfig,
    hedge_budget: HedgeBudgetConfig,
    burst: int = 10,
) -> tuple[Handler, Retry, Hedge]:
    retry = Retry(
        "r",
        RetryConfig(attempts=3, backoff=BackoffConfig(0.01, 0.05), budget=retry_budget),
        per_try=2.0,
        clock=clock,
        events=events,
        classify=CLASSIFY,
    )
    hedge = Hedge(
        "r",
        HedgeConfig(after=0.2, budget=hedge_budget),
        per_try=2.0,
        clock=clock,
        events=events,
        classify=CLASSIFY,
        profile=TAVILY,
        retry_budget=retry.budget,
    )
    limit = RateLimit(
        "r", RateLimitConfig(rate=1.0, burst=burst), MemoryBuckets(1.0, burst, clock), clock, events
    )
    return compose([retry, hedge, limit], vendor), retry, hedge


async def test_each_hedge_spends_a_rate_limit_token() -> None:
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(HELD, answer())
    handler, _, _ = make_chain(
        clock,
        events,
        vendor,
        retry_budget=BudgetConfig(ratio=1.0, min_per_s=5),
        hedge_budget=HedgeBudgetConfig(ratio=1.0, min_per_s=5),
    )
    flow = make_flow(clock)
    reply = await handler(flow)
    assert reply.status == 200
    assert events.tokens == ["allowed", "allowed"]  # the attempt's token and the hedge's
    assert flow.trace.attempts == 1 and flow.trace.hedges == 1
    assert events.retries == []  # a hedge is no retry


async def test_a_hedge_waits_for_its_token_like_any_attempt() -> None:
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(HELD, answer())
    handler, _, _ = make_chain(
        clock,
        events,
        vendor,
        retry_budget=BudgetConfig(ratio=1.0, min_per_s=5),
        hedge_budget=HedgeBudgetConfig(ratio=1.0, min_per_s=5),
        burst=1,
    )
    reply = await handler(make_flow(clock))
    assert reply.status == 200
    assert events.tokens == ["allowed", "delayed"]  # one token in the bucket: the hedge queued


async def test_each_hedge_spends_a_retry_budget_slot() -> None:
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(HELD, answer())
    handler, retry, _ = make_chain(
        clock,
        events,
        vendor,
        retry_budget=BudgetConfig(ratio=0.0, min_per_s=1),  # one retry (or hedge) per second
        hedge_budget=HedgeBudgetConfig(ratio=1.0, min_per_s=5),
    )
    await handler(make_flow(clock))
    assert events.hedges == ["won"]
    assert not retry.budget.try_acquire_retry()  # the hedge took this second's slot


async def test_a_spent_retry_budget_refuses_the_hedge() -> None:
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(HELD)
    handler, retry, _ = make_chain(
        clock,
        events,
        vendor,
        retry_budget=BudgetConfig(ratio=0.0, min_per_s=1),
        hedge_budget=HedgeBudgetConfig(ratio=1.0, min_per_s=5),
    )
    assert retry.budget.try_acquire_retry()  # a retry elsewhere took this second's slot
    task = asyncio.ensure_future(handler(make_flow(clock)))
    await settle()
    assert vendor.calls == 1 and events.hedges == ["refused"]
    first = answer(results=2)
    vendor.answer(0, first)
    assert await task is first


async def test_the_hedge_budget_caps_hedges_at_its_ratio_above_its_floor() -> None:
    """ratio 0.1 with a floor of 1/s: over the 10 s window, max(10% of requests, 10) hedges."""
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(*[HELD, answer()] * 10, HELD, HELD)
    handler, _, _ = make_chain(
        clock,
        events,
        vendor,
        retry_budget=BudgetConfig(ratio=1.0, min_per_s=20),
        hedge_budget=HedgeBudgetConfig(ratio=0.1, min_per_s=1),
        burst=100,
    )
    for _ in range(12):
        task = asyncio.ensure_future(handler(make_flow(clock)))
        await settle()
        if events.hedges[-1] == "refused":
            vendor.answer(vendor.calls - 1, answer())
        assert (await task).status == 200
    assert events.hedges == ["won"] * 10 + ["refused"] * 2
    assert clock.now() - 1000.0 < 10  # all within one window


# ---------------------------------------------------------------------------------------------
# Only idempotent work


@pytest.mark.parametrize(
    ("method", "path", "body", "methods", "hedged"),
    [
        pytest.param("POST", "/search", SEARCH, {"GET"}, True, id="a search POST"),
        pytest.param("GET", "/usage", b"", {"GET"}, True, id="GET"),
        pytest.param("POST", "/extract", b'{"urls": ["https://a.b"]}', {"GET"}, False, id="POST"),
        pytest.param("POST", "/search", b'{"query": 5}', {"GET"}, False, id="no text query"),
        pytest.param("DELETE", "/x", b"", {"GET"}, False, id="DELETE"),
        pytest.param("POST", "/extract", b"{}", {"GET", "POST"}, True, id="POST marked safe"),
    ],
)
async def test_only_idempotent_requests_are_hedged(
    method: str, path: str, body: bytes, methods: set[str], hedged: bool
) -> None:
    clock = ManualClock()
    events = Recorder()
    vendor = Vendor(HELD, answer())
    hedge = make_hedge(clock, events, methods=frozenset(methods))
    assert hedge.hedgeable(make_flow(clock, method, path, body)) is hedged
    task = asyncio.ensure_future(compose([hedge], vendor)(make_flow(clock, method, path, body)))
    await settle()
    if not hedged:
        assert vendor.calls == 1 and clock.sleeps == []
        vendor.answer(0, answer())
    assert (await task).status == 200
    assert vendor.calls == (2 if hedged else 1)
    assert events.hedges == (["won"] if hedged else [])


async def test_a_route_without_a_search_profile_hedges_get_only() -> None:
    clock = ManualClock()
    hedge = Hedge(
        "r", HedgeConfig(after=0.2), per_try=2.0, clock=clock, events=NullEvents(), profile=None
    )
    assert hedge.hedgeable(make_flow(clock, "GET", "/q", b""))
    assert not hedge.hedgeable(make_flow(clock, "POST", "/search", SEARCH))


# ---------------------------------------------------------------------------------------------
# The `hedge:` section


def routes(**hedge: Any) -> dict[str, Any]:
    tavily: dict[str, Any] = {
        "prefix": "/tavily",
        "upstream": "https://api.tavily.com",
        "search": {"vendor": "tavily"},
        "timeouts": {"per_try": "2s", "total": "10s"},
        "hedge": hedge,
    }
    return {"routes": {"tavily": tavily}}


def test_hedge_section_defaults_and_round_trip() -> None:
    config = parse_config(routes())
    hedge = config.routes["tavily"].section("hedge")
    assert hedge == HedgeConfig()
    assert hedge.after == "auto" and hedge.percentile == 0.95 and hedge.max_extra == 1
    assert hedge.budget == HedgeBudgetConfig(ratio=0.05, min_per_s=1)
    config = parse_config(
        routes(after="150ms", max_extra=2, budget={"ratio": 0.1, "min_per_s": 0}, methods=["POST"])
    )
    assert parse_config(as_document(config), {}) == config
    assert config.routes["tavily"].section("hedge") == HedgeConfig(
        after=0.15,
        max_extra=2,
        budget=HedgeBudgetConfig(0.1, 0),
        methods=frozenset({"POST"}),
    )


@pytest.mark.parametrize(
    ("hedge", "where", "says"),
    [
        ({"after": "soon"}, "hedge.after", "expected auto or a duration"),
        ({"after": "0s"}, "hedge.after", "expected auto or a duration"),
        ({"after": "2s"}, "hedge.after", "shorter than timeouts.per_try"),
        ({"percentile": 95}, "hedge.percentile", "from 0.5 to 0.999"),
        ({"max_extra": 0}, "hedge.max_extra", "from 1 to 3"),
        ({"to": "fallback"}, "hedge.to", "needs the route's fallback section"),
        ({"to": "elsewhere"}, "hedge.to", "expected one of same, fallback"),
        ({"budget": {"ratio": -1}}, "hedge.budget.ratio", "from 0.0 to 3.0"),
        ({"methods": ["FETCH"]}, "hedge.methods[0]", "expected an HTTP method"),
        ({"delay": "1s"}, "hedge.delay", "unknown key"),
    ],
)
def test_hedge_section_errors_name_the_key(hedge: dict[str, Any], where: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(routes(**hedge))
    assert f"routes.tavily.{where}" in str(caught.value)
    assert says in str(caught.value)


async def test_a_race_timer_on_the_system_clock_is_a_loop_timer_not_a_task() -> None:
    """The hedge's timer: the work usually wins, and a cancelled timer must not wake the loop."""
    loop = asyncio.get_running_loop()
    tasks_before = len(asyncio.all_tasks())
    due = SYSTEM_CLOCK.timer(0.001)
    assert not isinstance(due, asyncio.Task) and not due.done()
    assert len(asyncio.all_tasks()) == tasks_before
    await asyncio.wait_for(due, 5)  # the loop timer fires
    assert SYSTEM_CLOCK.timer(0).done()  # nothing to wait for

    def far() -> list[asyncio.TimerHandle]:  # the loop's pending timers an hour out
        handles = loop._scheduled  # type: ignore[attr-defined]
        return [h for h in handles if not h.cancelled() and h.when() > loop.time() + 3000]

    late = SYSTEM_CLOCK.timer(3600)
    assert len(far()) == 1
    late.cancel()
    await asyncio.sleep(0)  # the future's done callbacks run
    assert far() == []


async def test_a_race_timer_on_a_manual_clock_is_its_sleep() -> None:
    clock = ManualClock()
    await clock.timer(2.5)
    assert clock.sleeps == [2.5]


async def test_a_later_call_on_the_system_clock_is_a_loop_timer_that_cancels_quietly() -> None:
    """The hedge's timer: no task and no future, so a round its first attempt wins (nearly
    all) cancels it without scheduling anything."""
    loop = asyncio.get_running_loop()
    tasks_before = len(asyncio.all_tasks())
    fired = asyncio.Event()
    handle = SYSTEM_CLOCK.later(0.001, fired.set)
    assert isinstance(handle, asyncio.TimerHandle)
    assert len(asyncio.all_tasks()) == tasks_before
    await asyncio.wait_for(fired.wait(), 5)
    called: list[int] = []
    late = SYSTEM_CLOCK.later(3600, lambda: called.append(1))
    ready = len(loop._ready)  # type: ignore[attr-defined]
    late.cancel()
    assert late.cancelled() and len(loop._ready) == ready  # type: ignore[attr-defined]
    assert called == []


async def test_a_later_call_on_a_manual_clock_is_its_sleep() -> None:
    clock = ManualClock()
    called: list[float] = []
    await clock.later(1.5, lambda: called.append(clock.now()))  # type: ignore[misc]
    assert clock.sleeps == [1.5] and called == [clock.now()]


async def test_a_hedge_answering_as_the_first_attempt_fails_in_one_step_wins() -> None:
    # Both answers in one loop step, the hedge's first: its task is done but its settling
    # (a done callback) comes a step later; the round must not end with the first's failure.
    events, vendor, task = held_round()
    await settle()
    assert vendor.calls == 2
    vendor.answer(1, answer(results=4))
    vendor.answer(0, answer(503))
    reply = await task
    assert reply.status == 200 and events.hedges == ["won"]
    assert events.attempts == [Outcome.SERVER_ERROR] and vendor.released == 1


async def test_a_round_cancelled_from_outside_keeps_its_first_attempt_as_a_cut_sample() -> None:
    clock = ManualClock()
    events = Recorder()
    window = LatencyWindow(clock)
    for _ in range(40):
        window.record(0.1)
    before = window.samples()
    vendor = Vendor(HELD, HELD)
    hedge = make_hedge(clock, events, after_s="auto")
    hedge.window = window
    task = asyncio.ensure_future(compose([hedge], vendor)(make_flow(clock)))
    await settle()
    task.cancel()  # the agent left: the attempt was at least this slow
    with pytest.raises(asyncio.CancelledError):
        await task
    assert window.samples() - before > 0.5


async def test_a_hedge_answering_while_it_is_cancelled_counts_once_as_cancelled() -> None:
    clock = ManualClock()
    events = Recorder()
    late = answer()
    released: list[int] = []
    first: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
    calls = 0

    async def vendor(flow: Flow) -> Reply:
        nonlocal calls
        calls += 1
        if calls == 1:
            return await first
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            late.release = lambda: released.append(1)
            return late  # answered while being cancelled
        raise AssertionError("never woken")

    task = asyncio.ensure_future(compose([make_hedge(clock, events)], vendor)(make_flow(clock)))
    await settle()
    first.set_result(answer())
    await task
    await settle()
    assert events.hedges == ["cancelled"] and events.attempts == []
    assert released == [1]  # its connection given back

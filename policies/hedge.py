"""Hedged attempts: while an attempt is slower than the route usually is, send another and take
the first usable answer (tower's `hedge`, gRPC's and Envoy's hedging policies).

It sits inside the retry loop, above the rate limiter: each hedge spends a token and a slot of
the retry budget like any attempt, and the retry loop, the breaker and the cache see one answer
per round, the winner's. Losers are cancelled, which closes their connections; their bodies are
never read further. Only idempotent work is hedged: searches (the route's profile finds the
query), GET, and the methods the route marks safe.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import structlog

from policies.backoff import RetryBudget
from policies.core.clock import Cancellable, Clock
from policies.core.errors import ProxyError, VendorFailure, seconds_text
from policies.core.events import Events
from policies.core.flow import Classifier, Flow, Handler, Reply, Trace, status_outcome
from policies.core.outcome import Outcome
from policies.core.route import RouteConfig
from policies.core.section import Budget, Build, Link, Provider, Section
from policies.core.settings import (
    ConfigError,
    calls_per_s,
    join,
    methods,
    number_in,
    one_of,
    positive_duration,
    section,
    whole_in,
)
from policies.latency import LatencyWindow
from policies.profiles import VendorProfile, request_query
from policies.providers import Answer, Search, answered_by, ask, read_search, skipped, translated

log = structlog.get_logger("search_proxy")

# The shortest delay `after: auto` uses: below it a hedge is noise, not a rescue.
MIN_AFTER_S = 0.001
# A hedge is not sent unless this much of the request's deadline is left.
MIN_ATTEMPT_S = 0.05
# Samples the latency window needs before `after: auto` sends any hedge.
MIN_SAMPLES = 20.0
# How long a percentile read from the window stands before it is read again.
AFTER_REFRESH_S = 0.05


@dataclass(frozen=True)
class HedgeBudgetConfig:
    ratio: float = 0.05  # hedges per hedgeable attempt at most, over a sliding 10 s window
    min_per_s: int = 1  # ... or this many per second of the window, if more (quiet routes)


@dataclass(frozen=True)
class HedgeConfig:
    """A route's `hedge:` section."""

    after: float | Literal["auto"] = "auto"  # seconds, or the route's recent percentile
    percentile: float = 0.95
    max_extra: int = 1  # hedges per attempt at most
    budget: HedgeBudgetConfig = HedgeBudgetConfig()
    to: Literal["same", "fallback"] = "same"  # fallback: the route's first fallback provider
    methods: frozenset[str] = frozenset({"GET"})  # hedged besides the searches the profile finds


class Hedge:
    """Races an attempt against the hedges sent while it is slow; see the module docstring."""

    def __init__(
        self,
        route: str,
        config: HedgeConfig,
        *,
        per_try: float,
        clock: Clock,
        events: Events,
        classify: Classifier = status_outcome,
        profile: VendorProfile | None = None,
        retry_budget: Budget | None = None,
        fallback: Callable[[], Provider | None] | None = None,
        window: LatencyWindow | None = None,
    ) -> None:
        self.route = route
        self.config = config
        self.per_try = per_try
        self.clock = clock
        self.events = events
        self.classify = classify
        self.profile = profile
        # Hedges spend the retry budget too, so hedges and retries together stay within it.
        self.retry_budget = retry_budget
        self.fallback = fallback
        b = config.budget
        # The floor is for quiet routes: on a busy one, `ratio` is the whole of the extra load.
        self.budget = RetryBudget(b.ratio, b.min_per_s, clock, floor="least")
        # With `after: auto`, the route's recent attempt latencies (`window`: kept by a reload).
        self.window = (window or LatencyWindow(clock)) if config.after == "auto" else None
        self._after_at = -math.inf  # when `after` was last read from the window
        self._after: float | None = None

    def hedgeable(self, flow: Flow) -> bool:
        """Whether sending this request twice is safe (a pure decision)."""
        if flow.request.method in self.config.methods:
            return True
        if self.profile is None:
            return False
        ref = request_query(self.profile, flow.request)
        return ref is not None and ref.is_text

    def after(self) -> float | None:
        """Seconds an attempt runs alone before a hedge joins it; None: no hedge (the window
        knows too little yet, or the attempt would time out first). Read from the window at
        most every AFTER_REFRESH_S: it moves with a half-life of seconds, and a busy route
        would otherwise walk its histogram on every request."""
        if self.window is None:
            return float(self.config.after)
        now = self.clock.now()
        if now - self._after_at < AFTER_REFRESH_S:
            return self._after
        found = self.window.percentile(self.config.percentile, MIN_SAMPLES)
        after = None if found is None or found >= self.per_try else max(MIN_AFTER_S, found)
        self._after_at, self._after = now, after
        return after

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        if not self.hedgeable(flow):
            return await call_next(flow)
        self.budget.record_request()
        return await _Race(self, flow, call_next).run()

    def spend(self) -> bool:
        """Take a hedge slot from the hedge budget and the retry budget; False if either is out."""
        if not self.budget.try_acquire_retry():
            return False
        return self.retry_budget is None or self.retry_budget.try_acquire_retry()


@dataclass(eq=False)
class _Attempt:
    task: asyncio.Task[Reply] | None  # None: the round's first attempt, in the round's own task
    started: float
    hedge: bool
    provider: str | None = None  # the fallback route a hedge went to
    dropped: list[str] = field(default_factory=list)  # options that fallback could not honour
    # A hedge's end was looked at (`_Race._ended`: a callback, a loop step after its task
    # ended), or the round cancelled it: it counts as running until then.
    settled: bool = False

    @property
    def running(self) -> bool:
        return self.task is not None and not self.settled


@dataclass(eq=False)
class _Race:
    """One round: the attempt, the hedges sent while nothing has answered, and the winner.

    The first attempt runs in the round's own task, as it would without hedging (no task to
    start, no wait to set up: most rounds send no hedge); hedges run in tasks of their own, sent
    by a timer. A hedge that wins while the first attempt still runs interrupts it as
    asyncio.timeout does: it cancels the round's task and the round turns that cancellation
    into the hedge's answer, unless the task was cancelled from outside too."""

    policy: Hedge
    flow: Flow
    call_next: Handler
    attempts: list[_Attempt] = field(default_factory=list)
    sent: int = 0  # hedges sent this round
    hedging: bool = True  # false once a hedge was refused: none follows this round
    failure: Reply | ProxyError | None = None  # the first attempt's, if it failed
    winner: _Attempt | None = None
    decided: bool = False  # the round has its answer (or failed): hedges ending now are dropped
    first_running: bool = False
    interrupted: bool = False  # a hedge won and cancelled the round's task
    after: float = 0.0
    task: asyncio.Task[Any] | None = None  # the round's own
    timer: Cancellable | None = None  # when the next hedge is due
    wake: asyncio.Future[None] | None = None  # the round waits on its hedges

    async def run(self) -> Reply:
        p = self.policy
        after = p.after()
        if after is None:
            return await self._alone()
        self.after, self.task = after, asyncio.current_task()
        first = _Attempt(None, p.clock.now(), hedge=False)
        self.attempts.append(first)
        self._arm()
        answered = False
        try:
            reply = await self._round(first)
            answered = True
            return reply
        finally:
            self.decided = True
            if self.timer is not None:
                self.timer.cancel()
            if not answered and self.winner is not None and self.winner.task is not None:
                self.winner.task.result().discard()  # cancelled from outside after it won
            await self._cancel_rest()
            if self.flow.trace.hedges:
                self.flow.trace.reply_headers["X-Proxy-Hedges"] = str(self.flow.trace.hedges)

    async def _round(self, first: _Attempt) -> Reply:
        p = self.policy
        self.first_running = True
        try:
            reply = await self.call_next(self.flow)
        except asyncio.CancelledError:
            self.first_running = False
            self._observe(first, cut=True)  # cut short: it took at least this long
            task = self.task
            if not self.interrupted or task is None or task.uncancel() > 0:
                raise  # cancelled from outside (the agent left, shutdown, a deadline)
            assert self.winner is not None  # interrupted by the hedge that won
            return self._won(self.winner)
        except ProxyError as exc:
            self.first_running = False
            self._lost(first, exc, exc.outcome if isinstance(exc, VendorFailure) else None)
        else:
            self.first_running = False
            outcome = p.classify(reply)
            if not outcome.is_vendor_failure:
                if outcome in (Outcome.OK, Outcome.EMPTY):
                    self._observe(first, cut=False)
                return reply
            self._lost(first, reply, outcome)
        # The first attempt failed: a hedge still running may answer yet (one that ended this
        # very step is looked at first: its callback has not run yet).
        while self.winner is None and any(a.running for a in self.attempts):
            self.wake = asyncio.get_running_loop().create_future()
            await self.wake
        if self.winner is not None:
            return self._won(self.winner)
        return self._no_winner()  # failed before its hedge was due: a retry's turn

    def _arm(self) -> None:
        """Set the timer of the next hedge, if one may follow."""
        p = self.policy
        if self.decided or not self.hedging or self.sent >= p.config.max_extra:
            return
        due = self.attempts[0].started + (self.sent + 1) * self.after
        self.timer = p.clock.later(due - p.clock.now(), self._due)

    def _due(self) -> None:
        self.timer = None
        if self.decided or self.winner is not None:
            return
        if self.first_running or any(a.running for a in self.attempts):
            try:
                self._hedge()
            except Exception:  # a bug: this round goes on without hedges, and says so
                log.exception("hedge_failed", route=self.policy.route)
                self.hedging = False
                return
            self._arm()

    def _ended(self, attempt: _Attempt, task: asyncio.Task[Reply]) -> None:
        """A hedge ended: it wins if it is the first usable answer; else it is dropped."""
        if attempt.settled:  # cancelled by the round (`_cancel_rest` counts it)
            if not task.cancelled() and task.exception() is None:
                task.result().discard()  # it answered while being cancelled
            return
        attempt.settled = True
        try:
            self._judge(attempt, task)
        except Exception:  # a bug: the hedge counts as lost, the round goes on
            log.exception("hedge_failed", route=self.policy.route)
        finally:
            if self.wake is not None and not self.wake.done():
                self.wake.set_result(None)

    def _judge(self, attempt: _Attempt, task: asyncio.Task[Reply]) -> None:
        if task.cancelled():
            return
        p = self.policy
        exc = task.exception()
        if isinstance(exc, ProxyError):
            self._lost(attempt, exc, exc.outcome if isinstance(exc, VendorFailure) else None)
            return
        if exc is not None:
            self._lost(attempt, ProxyError(str(exc)), None)
            return
        reply = task.result()
        outcome = reply.outcome if attempt.provider is not None else p.classify(reply)
        if self.decided or self.winner is not None or outcome is None or outcome.is_vendor_failure:
            self._lost(attempt, reply, outcome)
            return
        self.winner = attempt
        if self.first_running and self.task is not None:
            self.interrupted = True
            self.task.cancel()  # the first attempt's wait ends here: see `_round`

    async def _alone(self) -> Reply:
        """The attempt without a hedge (nothing to time it against yet), timed for the window."""
        p = self.policy
        if self.flow.context.fault_test:  # injected latency is not the route's
            return await self.call_next(self.flow)
        started = p.clock.now()
        try:
            reply = await self.call_next(self.flow)
        except VendorFailure as exc:
            if exc.outcome is Outcome.TIMEOUT and p.window is not None:
                p.window.record_cut(p.clock.now() - started)
            raise
        if p.window is not None and p.classify(reply) in (Outcome.OK, Outcome.EMPTY):
            p.window.record(p.clock.now() - started)
        return reply

    def _start(
        self,
        work: Awaitable[Reply],
        *,
        hedge: bool,
        provider: str | None = None,
        dropped: list[str] | None = None,
    ) -> None:
        task = asyncio.ensure_future(work)
        now = self.policy.clock.now()
        attempt = _Attempt(task, now, hedge, provider, dropped or [])
        self.attempts.append(attempt)
        task.add_done_callback(lambda done: self._ended(attempt, done))

    def _hedge(self) -> None:
        """Send the next hedge, if the deadline, the target and the budgets allow."""
        p = self.policy
        now = p.clock.now()
        if self.flow.context.deadline - now < MIN_ATTEMPT_S:
            self.hedging = False
            return
        if p.config.to == "fallback":
            self._hedge_to_fallback(now)
            return
        calls = self.flow.context.calls  # a hedge is one more vendor call of the request
        if calls is not None and not calls.spend():
            self._refused()
            return
        if not p.spend():
            if calls is not None:
                calls.refund()
            self._refused()
            return
        self.sent += 1
        self.flow.trace.hedges += 1
        # The same request and attempt, with a trace of its own: its timings are not the
        # request's.
        flow = self.flow
        twin = Flow(flow.request, flow.context, Trace(), flow.attempt, flow.max_attempts)
        self._start(self.call_next(twin), hedge=True)

    def _hedge_to_fallback(self, now: float) -> None:
        p = self.policy
        provider = p.fallback() if p.fallback is not None else None
        if provider is None or p.profile is None:
            self._refused()
            return
        ref = request_query(p.profile, self.flow.request)
        if ref is None or not ref.is_text:
            self.hedging = False  # not a search another vendor can be asked
            return
        wall = datetime.fromtimestamp(p.clock.wall(), UTC)
        search = read_search(p.profile, self.flow, ref, wall)
        # No key, or its circuit is open; else the budget. The fallback route's own retry loop
        # spends the request's vendor call.
        if skipped(provider, search) is not None or not p.spend():
            self._refused()
            return
        self.sent += 1
        self.flow.trace.hedges += 1
        answer = ask(
            provider,
            search,
            request_id=self.flow.request.request_id,
            now=now,
            wall=wall,
            deadline=self.flow.context.deadline,
            calls=self.flow.context.calls,
            as_fallback=True,
        )
        dropped: list[str] = []
        work = _reply_of(answer, p.profile, search, dropped)
        self._start(work, hedge=True, provider=provider.name, dropped=dropped)

    def _refused(self) -> None:
        self.hedging = False
        self.policy.events.hedge(self.policy.route, "refused")

    def _lost(
        self, attempt: _Attempt, failure: Reply | ProxyError, outcome: Outcome | None
    ) -> None:
        """An attempt ended without winning."""
        p = self.policy
        if not attempt.hedge:
            self.failure = failure  # the round's answer unless a hedge wins
            if outcome is Outcome.TIMEOUT:
                self._observe(attempt, cut=True)
            return
        if isinstance(failure, Reply):
            failure.discard()
        if attempt.provider is None and outcome is not None and not failure.injected:
            p.events.attempt(p.route, outcome)  # a fallback counts its own attempts
        p.events.hedge(p.route, "lost")

    def _observe(self, attempt: _Attempt, *, cut: bool) -> None:
        """Time the round's first attempt: hedges start late and race, so they would skew it."""
        window = self.policy.window
        if window is None or self.flow.context.fault_test:
            return
        elapsed = self.policy.clock.now() - attempt.started
        if cut:
            window.record_cut(elapsed)
        else:
            window.record(elapsed)

    def _won(self, winner: _Attempt) -> Reply:
        p = self.policy
        assert winner.task is not None  # the first attempt's answer returns in `_round`
        reply = winner.task.result()
        p.events.hedge(p.route, "won")
        first = self.failure
        if first is not None:  # the first attempt failed before the hedge won: count it
            outcome = first.outcome if isinstance(first, VendorFailure) else None
            if isinstance(first, Reply):
                outcome = p.classify(first)
                first.discard()
            if outcome is not None:
                p.events.attempt(p.route, outcome)
            self.failure = None
        if winner.provider is not None:
            answered_by(self.flow, winner.provider, winner.dropped)
        return reply

    def _no_winner(self) -> Reply:
        """Every attempt failed: the round ends as the first attempt did (the retry loop decides
        what next), the hedges' answers dropped."""
        first = self.failure
        assert first is not None
        self.failure = None
        if isinstance(first, Reply):
            return first
        raise first

    async def _cancel_rest(self) -> None:
        """Cancel the hedges still running and wait for them to let go of their connections."""
        p = self.policy
        running = []
        for attempt in self.attempts:
            if attempt.running and attempt.task is not None:
                attempt.settled = True  # counted here as cancelled, not by `_ended`
                attempt.task.cancel()
                running.append(attempt.task)
        if running:
            await asyncio.wait(running)
        for task in running:
            if not task.cancelled() and task.exception() is None:
                task.result().discard()  # it answered while being cancelled
            p.events.hedge(p.route, "cancelled")
        if self.failure is not None and isinstance(self.failure, Reply):
            self.failure.discard()  # a hedge won: the first attempt's failed answer goes


async def _reply_of(
    answer: Awaitable[Answer], primary: VendorProfile, search: Search, dropped: list[str]
) -> Reply:
    """A hedge to a fallback as an attempt: its answer in the primary's shape (the options it
    dropped go into `dropped`), or a failure."""
    found = await answer
    if not found.usable:
        raise _FallbackFailed(f"{found.provider}: no usable answer")
    dropped.extend(found.dropped)
    return translated(primary, found, search.count)


class _FallbackFailed(ProxyError):
    """A hedge to the fallback provider got no usable answer (never shown to an agent)."""


# ---------------------------------------------------------------------------------------------
# The `hedge:` section


def _after(value: Any, path: str) -> float | str:
    if value == "auto":
        return "auto"
    try:
        return positive_duration(value, path)
    except ConfigError:
        raise ConfigError(path, f"expected auto or a duration like 200ms, got {value!r}") from None


def parse(raw: Any, path: str) -> HedgeConfig:
    return section(
        raw,
        path,
        HedgeConfig,
        {
            "after": _after,
            "percentile": number_in(0.5, 0.999),
            # Each extra is one more call per slow request: more than 3 only adds load.
            "max_extra": whole_in(1, 3),
            "budget": lambda v, p: section(
                v, p, HedgeBudgetConfig, {"ratio": number_in(0.0, 3.0), "min_per_s": calls_per_s}
            ),
            "to": one_of("same", "fallback"),
            "methods": methods,
        },
    )


def check(cfg: HedgeConfig, route: RouteConfig, path: str) -> list[ConfigError]:
    problems = []
    if cfg.to == "fallback" and not route.has("fallback"):
        problems.append(
            ConfigError(join(path, "to"), "fallback needs the route's fallback section")
        )
    per_try = route.timeouts.per_try
    if cfg.after != "auto" and cfg.after >= per_try:
        problems.append(
            ConfigError(
                join(path, "after"),
                f"must be shorter than timeouts.per_try ({seconds_text(per_try)}): "
                "the attempt times out before its hedge would be sent",
            )
        )
    return problems


SECTION = Section("hedge", parse, check)


def build(cfg: HedgeConfig, route: Build) -> Hedge:
    """The route's hedge; with `to: fallback` it sends hedges to the first fallback provider."""
    fallback = route.route.section("fallback")
    first: Callable[[], Sequence[Provider]] | None = None
    if cfg.to == "fallback" and fallback is not None:
        first = route.providers(fallback.providers[:1])
    return Hedge(
        route.route.name,
        cfg,
        per_try=route.route.timeouts.per_try,
        clock=route.clock,
        events=route.events,
        classify=route.classify,
        profile=route.profile,
        retry_budget=route.retry_budget,
        fallback=(lambda: next(iter(first()), None)) if first is not None else None,
        window=route.keep(
            "hedge window", (cfg, route.route.upstream), lambda: LatencyWindow(route.clock)
        ),
    )


LINK = Link("hedge", SECTION, build)

"""The attempt loop: retry the failures worth retrying, at a jittered pace, inside a deadline
and a budget (Envoy's router retry state, in a few dozen lines).

Every route runs its upstream call through `Retry`; a route without a `retry` section gets one
attempt. Only listed conditions are retried; a vendor's 4xx never is, nor a vendor-declared
terminal answer (quota exhausted), even when its status looks like a rate limit.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from policies.backoff import (
    Backoff,
    GiveUpRetryAfterTooLong,
    RandomLike,
    RetryBudget,
    fits_deadline,
    parse_retry_after,
    wait_for_retry,
)
from policies.core.clock import Clock
from policies.core.errors import (
    AttemptFailed,
    UpstreamMalformed,
    UpstreamRetryAfterTooLong,
    seconds_text,
)
from policies.core.events import Events
from policies.core.flow import Flow, Handler, Reply
from policies.core.outcome import Classifier, Outcome, status_outcome


@dataclass(frozen=True)
class BackoffConfig:
    initial: float = 0.2
    max: float = 5.0
    multiplier: float = 2.0
    jitter: Literal["full", "decorrelated", "none"] = "full"


@dataclass(frozen=True)
class RetryAfterConfig:
    honor: bool = True
    max_wait: float = 10.0  # a longer Retry-After fails at once, saying how long to wait


@dataclass(frozen=True)
class BudgetConfig:
    ratio: float = 0.2  # retries allowed per request, over a sliding window
    min_per_s: int = 3  # retries always allowed per second, however few requests


@dataclass(frozen=True)
class RetryConfig:
    """A route's `retry:` section."""

    attempts: int = 3
    on_statuses: frozenset[int] = frozenset({429, 500, 502, 503, 504})
    on_conditions: frozenset[Outcome] = frozenset(
        {Outcome.TIMEOUT, Outcome.CONNECT_ERROR, Outcome.RESET, Outcome.MALFORMED}
    )
    backoff: BackoffConfig = BackoffConfig()
    retry_after: RetryAfterConfig = RetryAfterConfig()
    budget: BudgetConfig = BudgetConfig()
    methods: frozenset[str] = frozenset({"GET", "POST"})


# The shortest time an attempt is assumed to need; with a learned typical latency, twice that.
MIN_ATTEMPT_S = 0.05
NO_RETRY = RetryConfig(attempts=1)


class Retry:
    """Runs a flow's attempts: decides which failures to retry and how long to wait first."""

    def __init__(
        self,
        route: str,
        config: RetryConfig,
        *,
        per_try: float,
        clock: Clock,
        events: Events,
        classify: Classifier = status_outcome,
        rng: RandomLike | None = None,
        halt: Callable[[], bool] | None = None,
    ) -> None:
        self.route = route
        self.config = config
        self.per_try = per_try
        self.clock = clock
        self.events = events
        self.classify = classify
        # Asked before each retry: true once retrying is pointless (the route's breaker opened).
        self.halt = halt
        self.rng = rng or random.Random()
        b = config.backoff
        self.backoff = Backoff(b.initial, b.max, b.multiplier, b.jitter)
        self.budget = RetryBudget(config.budget.ratio, config.budget.min_per_s, clock)
        self._typical_s = 0.0  # moving average of successful attempt durations

    def reason(self, reply: Reply, outcome: Outcome) -> str | None:
        """Why this reply should be retried, or None when it should not (a pure decision)."""
        if outcome in (Outcome.OK, Outcome.EMPTY, Outcome.TERMINAL):
            return None
        if outcome is Outcome.MALFORMED:
            return outcome.value if outcome in self.config.on_conditions else None
        if reply.status in self.config.on_statuses:
            if outcome in (Outcome.RATE_LIMITED, Outcome.SERVER_ERROR):
                return outcome.value
            return str(reply.status)
        return None

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        cfg = self.config
        flow.max_attempts = cfg.attempts if flow.method in cfg.methods else 1
        if flow.max_attempts > 1:
            self.budget.record_request()
        prev_delay: float | None = None
        while True:
            started = self.clock.now()
            reply: Reply | None = None
            try:
                reply = await call_next(flow)
            except AttemptFailed as exc:
                failure: Reply | AttemptFailed = exc
                retryable = exc.transient and exc.outcome in cfg.on_conditions
                reason: str | None = exc.outcome.value if retryable else None
                self.events.attempt(self.route, exc.outcome)
            else:
                outcome = self.classify(reply)
                self.events.attempt(self.route, outcome)
                reason = self.reason(reply, outcome)
                if outcome is Outcome.OK:
                    elapsed = self.clock.now() - started
                    self._typical_s += 0.2 * (elapsed - self._typical_s)
                if reason is None:
                    return reply
                failure = reply

            if reason is None or flow.attempts >= flow.max_attempts:
                return self._give_up(flow, failure)
            delay = self.backoff.delay(flow.attempts, prev_delay, self.rng)
            prev_delay = delay
            retry_after = None
            if reply is not None and "Retry-After" in reply.headers:
                retry_after = parse_retry_after(reply.headers["Retry-After"], self.clock.wall())
            decision = wait_for_retry(
                delay, retry_after, cfg.retry_after.honor, cfg.retry_after.max_wait
            )
            if isinstance(decision, GiveUpRetryAfterTooLong):
                if reply is not None:
                    reply.discard()
                raise UpstreamRetryAfterTooLong(
                    f"{self.route}: upstream is rate limiting and asks to retry after "
                    f"{seconds_text(decision.retry_after)}, longer than this route waits "
                    f"({seconds_text(cfg.retry_after.max_wait)}); retry after "
                    f"{seconds_text(decision.retry_after)} or use another provider",
                    route=self.route,
                    attempts=flow.attempts,
                    upstream_status=reply.status if reply is not None else None,
                    retry_after_s=decision.retry_after,
                )
            min_attempt = min(self.per_try, max(MIN_ATTEMPT_S, 2 * self._typical_s))
            if not fits_deadline(self.clock.now(), flow.deadline, decision.seconds, min_attempt):
                return self._give_up(flow, failure)
            if not self.budget.try_acquire_retry():
                self.events.budget_exhausted(self.route)
                return self._give_up(flow, failure)
            await self.clock.sleep(decision.seconds)
            flow.waited_seconds += decision.seconds
            # The breaker counts a request only after its retries, so it often opens while
            # this one waits: once it has, this retry would only hit a vendor known to be down.
            if self.halt is not None and self.halt():
                return self._give_up(flow, failure)
            if reply is not None:
                reply.discard()
            self.events.retry(self.route, reason)
            flow.retry_reasons.append(reason)

    def _give_up(self, flow: Flow, failure: Reply | AttemptFailed) -> Reply:
        """The last answer: a vendor reply passes through; our own errors are raised."""
        if isinstance(failure, AttemptFailed):
            failure.attempts = flow.attempts
            raise failure
        if self.classify(failure) is Outcome.MALFORMED:
            failure.discard()
            raise UpstreamMalformed(
                f"{self.route}: upstream answered {failure.status} with a body that is not a "
                f"usable search response (attempt {flow.attempts} of {flow.max_attempts}); "
                "try again shortly or use another provider",
                route=self.route,
                attempts=flow.attempts,
                upstream_status=failure.status,
            )
        return failure

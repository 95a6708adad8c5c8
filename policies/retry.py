"""The attempt loop: retry the failures worth retrying, at a jittered pace, inside a deadline
and a budget (Envoy's router retry state, in a few dozen lines).

Every route runs its upstream call through `Retry`; a route without a `retry` section gets one
attempt. Only listed conditions are retried; a vendor's 4xx never is, nor a vendor-declared
terminal answer (quota exhausted), even when its status looks like a rate limit.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from policies.backoff import (
    Backoff,
    GiveUpRetryAfterTooLong,
    RandomLike,
    RetryBudget,
    fits_deadline,
    parse_retry_after,
    wait_for_retry,
)
from policies.clock import Clock
from policies.events import Events
from policies.flow import Flow, Handler, Reply
from proxy.config import RetryConfig
from proxy.errors import (
    UpstreamMalformed,
    UpstreamRetryAfterTooLong,
    UpstreamTimeout,
    UpstreamUnreachable,
    seconds_text,
)

# The shortest time an attempt is assumed to need; with a learned typical latency, twice that.
MIN_ATTEMPT_S = 0.05
NO_RETRY = RetryConfig(attempts=1)

# What an answer was, as far as retrying goes: ok, client_error, 429, 5xx, malformed, empty,
# terminal, or another status code as text.
Classifier = Callable[[Reply], str]


def status_outcome(reply: Reply) -> str:
    """Classify a reply by its status alone."""
    return outcome_of_status(reply.status)


def outcome_of_status(status: int) -> str:
    """ok, 429, 5xx or client_error."""
    if status < 400:
        return "ok"
    if status == 429:
        return "429"
    if status >= 500:
        return "5xx"
    return "client_error"


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
        self.backoff = Backoff(b.initial, b.max, b.multiplier, b.jitter)  # type: ignore[arg-type]
        self.budget = RetryBudget(config.budget.ratio, config.budget.min_per_s, clock)
        self._typical_s = 0.0  # moving average of successful attempt durations

    def reason(self, reply: Reply, outcome: str) -> str | None:
        """Why this reply should be retried, or None when it should not (a pure decision)."""
        if outcome in ("ok", "empty", "terminal"):
            return None
        if outcome == "malformed":
            return "malformed" if "malformed" in self.config.on_conditions else None
        if reply.status in self.config.on_statuses:
            return outcome if outcome in ("429", "5xx") else str(reply.status)
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
            except (UpstreamTimeout, UpstreamUnreachable, UpstreamMalformed) as exc:
                failure: Reply | Exception = exc
                reason: str | None = exc.condition
                if reason not in cfg.on_conditions:
                    reason = None
                self.events.attempt(self.route, exc.condition)
            else:
                outcome = self.classify(reply)
                self.events.attempt(self.route, outcome)
                reason = self.reason(reply, outcome)
                if outcome == "ok":
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

    def _give_up(self, flow: Flow, failure: Reply | Exception) -> Reply:
        """The last answer: a vendor reply passes through; our own errors are raised."""
        if isinstance(failure, Exception):
            if hasattr(failure, "attempts"):
                failure.attempts = flow.attempts
            raise failure
        if self.classify(failure) == "malformed":
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

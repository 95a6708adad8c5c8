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
from typing import Any, Literal

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
    CallBudgetSpent,
    LocalRefusal,
    OutOfTime,
    UpstreamMalformed,
    UpstreamRetryAfterTooLong,
    seconds_text,
)
from policies.core.events import Events
from policies.core.flow import Classifier, Flow, Handler, Reply, status_outcome
from policies.core.outcome import RETRY_CONDITIONS, Outcome
from policies.core.section import Build, Link, Section, plain
from policies.core.settings import (
    ConfigError,
    boolean,
    calls_per_s,
    fields,
    join,
    methods,
    number,
    number_in,
    one_of,
    parse_duration,
    positive_duration,
    section,
    whole_in,
)


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
        trace, calls = flow.trace, flow.context.calls
        max_attempts = cfg.attempts if flow.request.method in cfg.methods else 1
        if max_attempts > 1:
            self.budget.record_request()
        prev_delay: float | None = None
        attempt = 0
        while True:
            attempt += 1
            if calls is not None and not calls.spend():
                raise CallBudgetSpent(
                    f"{self.route}: this request already made its {calls.limit} vendor "
                    f"calls ({calls.setting}); {calls.advice}",
                    route=self.route,
                    attempts=trace.attempts,
                )
            started = self.clock.now()
            reply: Reply | None = None
            try:
                reply = await call_next(flow.for_attempt(attempt, max_attempts))
            except (LocalRefusal, OutOfTime):
                # Refused inside the proxy (its limiter, its pool, the deadline before the
                # attempt could start): nothing reached the vendor.
                if calls is not None:
                    calls.refund()
                raise
            except AttemptFailed as exc:
                trace.attempts += 1
                failure: Reply | AttemptFailed = exc
                retryable = exc.transient and exc.outcome in cfg.on_conditions
                reason: str | None = exc.outcome.value if retryable else None
                if not exc.injected:  # injected faults are counted apart (fault injection)
                    self.events.attempt(self.route, exc.outcome)
            except BaseException:
                trace.attempts += 1  # it reached the vendor: the agent left, or time ran out
                raise
            else:
                trace.attempts += 1
                outcome = self.classify(reply)
                if not reply.injected:
                    self.events.attempt(self.route, outcome)
                reason = self.reason(reply, outcome)
                if outcome is Outcome.OK:
                    elapsed = self.clock.now() - started
                    self._typical_s += 0.2 * (elapsed - self._typical_s)
                if reason is None:
                    return reply
                failure = reply

            # A failed attempt held the request as a wait would have (wait_at_most counts both).
            flow.context.waited(self.clock.now() - started)
            if reason is None or attempt >= max_attempts:
                return self._give_up(flow, failure, attempt, max_attempts)
            delay = self.backoff.delay(attempt, prev_delay, self.rng)
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
                    attempts=trace.attempts,
                    upstream_status=reply.status if reply is not None else None,
                    retry_after_s=decision.retry_after,
                    reason=str(reply.status) if reply is not None else None,  # a 503 says so
                )
            if decision.seconds > flow.context.wait_at_most:
                # A fallback can answer sooner than this wait: failover asks it now.
                return self._give_up(flow, failure, attempt, max_attempts)
            min_attempt = min(self.per_try, max(MIN_ATTEMPT_S, 2 * self._typical_s))
            deadline = flow.context.deadline
            if not fits_deadline(self.clock.now(), deadline, decision.seconds, min_attempt):
                return self._give_up(flow, failure, attempt, max_attempts)
            if not self.budget.try_acquire_retry():
                self.events.budget_exhausted(self.route)
                return self._give_up(flow, failure, attempt, max_attempts)
            await self.clock.sleep(decision.seconds)
            trace.waited_seconds += decision.seconds
            flow.context.waited(decision.seconds)
            # The breaker counts a request only after its retries, so it often opens while
            # this one waits: once it has, this retry would only hit a vendor known to be down.
            if self.halt is not None and self.halt():
                return self._give_up(flow, failure, attempt, max_attempts)
            if reply is not None:
                reply.discard()
            self.events.retry(self.route, reason)
            trace.retry_reasons.append(reason)

    def _give_up(
        self, flow: Flow, failure: Reply | AttemptFailed, attempt: int, max_attempts: int
    ) -> Reply:
        """The last answer: a vendor reply passes through; our own errors are raised."""
        if isinstance(failure, AttemptFailed):
            failure.attempts = flow.trace.attempts
            raise failure
        if self.classify(failure) is Outcome.MALFORMED:
            failure.discard()
            raise UpstreamMalformed(
                f"{self.route}: upstream answered {failure.status} with a body that is not a "
                f"usable search response (attempt {attempt} of {max_attempts}); "
                "try again shortly or use another provider",
                route=self.route,
                attempts=flow.trace.attempts,
                upstream_status=failure.status,
            )
        return failure


# ---------------------------------------------------------------------------------------------
# The `retry:` section

# More attempts than this only multiply the load on a vendor that is already failing.
MAX_ATTEMPTS = 10
# The words a retry `on:` list takes besides status codes.
RETRY_WORDS = ("429", "5xx", *RETRY_CONDITIONS)
SERVER_ERRORS = frozenset({500, 502, 503, 504})  # what `5xx` stands for


def parse_on(value: Any, path: str) -> tuple[frozenset[int], frozenset[Outcome]]:
    """`on: [429, 5xx, timeout, ...]`: the statuses and the conditions retried."""
    found: set[int] = set()
    conditions: set[Outcome] = set()
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list like [429, 5xx, timeout], got {value!r}")
    for i, item in enumerate(value):
        item_path = f"{path}[{i}]"
        if isinstance(item, int) and not isinstance(item, bool):
            if not 400 <= item <= 599:
                raise ConfigError(item_path, f"expected a 4xx or 5xx status, got {item}")
            found.add(item)
        elif item == "5xx":
            found.update(SERVER_ERRORS)
        elif item == "429":
            found.add(429)
        elif item in RETRY_CONDITIONS:
            conditions.add(Outcome(item))
        else:
            raise ConfigError(
                item_path,
                f"expected a status code or one of {', '.join(RETRY_WORDS)}, got {item!r}",
            )
    return frozenset(found), frozenset(conditions)


def parse_backoff(raw: Any, path: str) -> BackoffConfig:
    cfg = section(
        raw,
        path,
        BackoffConfig,
        {
            "initial": positive_duration,
            "max": parse_duration,
            "multiplier": lambda v, p: number(v, p, 1.0, 100.0),
            "jitter": one_of("full", "decorrelated", "none"),
        },
    )
    if cfg.initial > cfg.max:
        given = raw if isinstance(raw, dict) else {}
        key, other = ("max", "initial") if "max" in given else ("initial", "max")
        default = "" if other in given else ", the default"
        bound = "at least" if key == "max" else "at most"
        shown = seconds_text(getattr(cfg, other))
        raise ConfigError(join(path, key), f"must be {bound} backoff.{other} ({shown}{default})")
    return cfg


_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "attempts": whole_in(1, MAX_ATTEMPTS),
    "on": parse_on,
    "backoff": parse_backoff,
    "retry_after": lambda v, p: section(
        v, p, RetryAfterConfig, {"honor": boolean, "max_wait": parse_duration}
    ),
    # A ratio is retries per request: above 1 the budget would allow more retries than requests.
    "budget": lambda v, p: section(
        v, p, BudgetConfig, {"ratio": number_in(0.0, 1.0), "min_per_s": calls_per_s}
    ),
    "methods": methods,
}


def parse(raw: Any, path: str) -> RetryConfig:
    kwargs = fields(raw, path, _PARSERS)
    if "on" in kwargs:
        kwargs["on_statuses"], kwargs["on_conditions"] = kwargs.pop("on")
    return RetryConfig(**kwargs)


def document(cfg: RetryConfig) -> dict[str, Any]:
    """The section as YAML: `on` as the list it is written as, 5xx where all four are in."""
    doc: dict[str, Any] = plain(cfg)
    del doc["on_statuses"], doc["on_conditions"]
    statuses: list[int | str] = sorted(cfg.on_statuses)
    if SERVER_ERRORS <= cfg.on_statuses:
        statuses = [s for s in statuses if s not in SERVER_ERRORS] + ["5xx"]
    on = [*statuses, *sorted(c.value for c in cfg.on_conditions)]
    return {"attempts": doc.pop("attempts"), "on": on, **doc}


SECTION = Section("retry", parse, document=document)


def retry_reasons(cfg: RetryConfig) -> tuple[str, ...]:
    """Every reason `Retry.reason` can give under this config, as the retries metric labels it:
    its conditions, 429, 5xx and any other status it names."""
    reasons = {condition.value for condition in cfg.on_conditions}
    for status in cfg.on_statuses:
        outcome = Outcome.of_status(status)
        rated = outcome in (Outcome.RATE_LIMITED, Outcome.SERVER_ERROR)
        reasons.add(outcome.value if rated else str(status))
    return tuple(sorted(reasons))


def build(cfg: RetryConfig, route: Build) -> Retry:
    """Every route runs its attempts through a Retry; without a section, one attempt."""
    retry = Retry(
        route.route.name,
        cfg,
        per_try=route.route.timeouts.per_try,
        clock=route.clock,
        events=route.events,
        classify=route.classify,
        halt=route.halt_retries,
    )
    # A route without a retry section has no retry budget for its hedges to share.
    if route.route.has(SECTION.key):
        route.retry_budget = retry.budget
    return retry


LINK = Link("retry", SECTION, build, default=NO_RETRY)

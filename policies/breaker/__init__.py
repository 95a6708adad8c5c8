"""Circuit breakers per route."""

from policies.breaker.config import SECTION, BreakerConfig, ProbeConfig, open_seconds
from policies.breaker.policy import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    Breaker,
    ProbeSender,
    RedisBreakerState,
    Snapshot,
    parse_snapshot,
)

__all__ = [
    "CLOSED",
    "HALF_OPEN",
    "OPEN",
    "SECTION",
    "Breaker",
    "BreakerConfig",
    "ProbeConfig",
    "ProbeSender",
    "RedisBreakerState",
    "Snapshot",
    "open_seconds",
    "parse_snapshot",
]

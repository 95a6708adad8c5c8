"""Circuit breakers per route: fail fast while a vendor is unwell, and let it back in carefully.

`machine` holds every transition, free of I/O; `admission`, `fleet` (Redis) and `probe` (active
probes) are thin adapters around it, and `policy` is the Breaker the route's chain calls.

pybreaker's part: its `CircuitBreakerStorage` interface is where a circuit's state (by
pybreaker's state names) and counters live (`storage`), with pybreaker's meaning: consecutive
failures that a success resets, half-open successes, a UTC `opened_at`. Ours: the transitions.
pybreaker's `CircuitBreaker` decides inside `call()` around a synchronous function, while our
outcomes arrive after an await and each must count only in the state that admitted it; its open
time is fixed and its half-open admits everyone, where ours grows while the vendor stays down
and admits a bounded trial that survives unlucky probes. So its CircuitBreaker and listeners are
not used: the machine returns each transition and the policy does the side effects.
"""

from policies.breaker.config import SECTION, BreakerConfig, ProbeConfig, open_seconds
from policies.breaker.fleet import RedisBreakerState
from policies.breaker.machine import Change, Circuit
from policies.breaker.policy import LINK, Breaker
from policies.breaker.probe import ProbeSender
from policies.breaker.snapshot import CLOSED, HALF_OPEN, OPEN, Snapshot, parse_snapshot

__all__ = [
    "CLOSED",
    "HALF_OPEN",
    "LINK",
    "OPEN",
    "SECTION",
    "Breaker",
    "BreakerConfig",
    "Change",
    "Circuit",
    "ProbeConfig",
    "ProbeSender",
    "RedisBreakerState",
    "Snapshot",
    "open_seconds",
    "parse_snapshot",
]

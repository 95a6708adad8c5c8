"""Hooks through which policies report what they did; metrics and logs implement them.

Policies never import Prometheus: they call these methods, and the server wires in an
implementation (see proxy.metrics.Metrics). `NullEvents` is the do-nothing default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from policies.core.outcome import Outcome


class Events(Protocol):
    def attempt(self, route: str, outcome: Outcome) -> None:
        """One upstream attempt ended, as the route's classifier (or the failure) says."""

    def retry(self, route: str, reason: str) -> None:
        """A retry was scheduled for `reason` (429, 5xx, timeout, connect_error, reset ...)."""

    def budget_exhausted(self, route: str) -> None:
        """A retry was refused by the retry budget."""

    def ratelimit(self, route: str, decision: str, waited_s: float) -> None:
        """decision: allowed, delayed or rejected; waited_s: time spent waiting for a token."""

    def buckets(self, route: str, held: int, evicted: int) -> None:
        """The route's limiter made a bucket: it now holds `held` in this process, having just
        evicted `evicted` least-recently-used ones to stay within `rate_limit.max_clients`."""

    def breaker_transition(self, route: str, state: str) -> None:
        """The route's breaker moved to `state` (closed, half_open, open)."""

    def breaker_probe(self, route: str, result: str) -> None:
        """The route's breaker sent an active probe while open: result is ok or failed."""

    def cache(self, route: str, result: str) -> None:
        """result: hit, miss, stale, bypass or store."""

    def coalesced(self, route: str) -> None:
        """A request was answered by another identical in-flight request's vendor call."""

    def search_variant(self, route: str, outcome: str) -> None:
        """A simplified query variant was tried: outcome is results, empty or failed."""

    def failover(self, route: str, provider: str, result: str) -> None:
        """A fallback provider was asked for `route`: answered, empty, failed or skipped."""

    def hedge(self, route: str, result: str) -> None:
        """A hedged attempt ended: won, lost (failed), cancelled (another won); refused: the
        budget or the fallback's state stopped one from being sent."""

    def key_call(self, route: str, key: str, result: str) -> None:
        """A vendor call made with key `key` (its short hash) of the route's pool: result is
        used (its answer went on), rate_limited or exhausted (the key was benched)."""

    def keys_benched(self, route: str) -> None:
        """A request found every key of the route's pool benched: no call was made for it."""

    def fault(self, route: str, fault: str, at: str) -> None:
        """A fault the agent asked for was injected (fault injection): `fault` is its kind
        (a status, timeout, empty, malformed, latency), `at` vendor or agent."""

    def redis_state(self, up: bool) -> None:
        """Redis became reachable (True) or unreachable (False); shared state degrades meanwhile."""

    def redis_nodes(self, nodes: Sequence[tuple[str, str]]) -> None:
        """The Redis nodes in use are now these (address, role) pairs."""

    def redis_failover(self) -> None:
        """The master in use changed (Sentinel promoted another, or a cluster's did)."""

    def redis_busy(self) -> None:
        """A command found every connection of the link busy for as long as it could wait, and
        its caller used in-process state instead (Redis itself was not marked down)."""


class NullEvents:
    """Events that go nowhere (tests and tools that do not care)."""

    def attempt(self, route: str, outcome: Outcome) -> None:
        pass

    def retry(self, route: str, reason: str) -> None:
        pass

    def budget_exhausted(self, route: str) -> None:
        pass

    def ratelimit(self, route: str, decision: str, waited_s: float) -> None:
        pass

    def buckets(self, route: str, held: int, evicted: int) -> None:
        pass

    def breaker_transition(self, route: str, state: str) -> None:
        pass

    def breaker_probe(self, route: str, result: str) -> None:
        pass

    def cache(self, route: str, result: str) -> None:
        pass

    def coalesced(self, route: str) -> None:
        pass

    def search_variant(self, route: str, outcome: str) -> None:
        pass

    def failover(self, route: str, provider: str, result: str) -> None:
        pass

    def hedge(self, route: str, result: str) -> None:
        pass

    def key_call(self, route: str, key: str, result: str) -> None:
        pass

    def keys_benched(self, route: str) -> None:
        pass

    def fault(self, route: str, fault: str, at: str) -> None:
        pass

    def redis_state(self, up: bool) -> None:
        pass

    def redis_nodes(self, nodes: Sequence[tuple[str, str]]) -> None:
        pass

    def redis_failover(self) -> None:
        pass

    def redis_busy(self) -> None:
        pass

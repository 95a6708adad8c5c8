"""What walks a route's policy chain, one way, and the reply that comes back.

A route is built once into a chain of policies wrapping the upstream call (httpx-transport
style). Each policy is `async def handle(flow, call_next) -> Reply`: it may answer itself,
pass on (the same flow, or one with another request or attempt), or act on the reply. A flow
is the immutable request, its context (deadline, call budget, interim messages) and its
append-only trace, which the server turns into answer headers and a log line.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from multidict import CIMultiDict

from policies.core.outcome import Outcome


@dataclass(slots=True)
class Reply:
    """An upstream (or cached) answer. `stream` is set for bodies passed through chunk by chunk."""

    status: int
    headers: CIMultiDict[str]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    release: Callable[[], None] | None = None
    outcome: Outcome | None = None  # set once by the route's classifier, so the body is parsed once
    provider: str | None = None  # another route that answered for this one (failover)
    # What to send the agent before the connection closes when this stream is cut mid-way
    # (an SSE error event, an MCP JSON-RPC error); None: the server's default for the type.
    cut_tail: Callable[[Exception], bytes] | None = None
    injected: bool = False  # a fault the agent asked for (fault injection), not the vendor's

    def discard(self) -> None:
        """Give back the upstream connection of a reply we will not send."""
        if self.release is not None:
            self.release()
            self.release = None


class CallBudget:
    """How many vendor calls one agent request may still make, shared by every flow it starts
    (a route request's retries, hedges, variants and failovers; a /v1/search request's queries
    and providers and all of theirs). The retry loop takes one per attempt and the hedge one
    per hedge; a call refused inside the proxy (its limiter, its connection pool) gives its one
    back. `setting` names the config key of `limit`, `advice` what the agent can do."""

    __slots__ = ("advice", "limit", "setting", "spent")

    def __init__(
        self,
        limit: int,
        setting: str = "search_api.max_calls_per_request",
        advice: str = "send fewer queries or providers",
    ) -> None:
        self.limit = limit
        self.setting = setting
        self.advice = advice
        self.spent = 0

    def spend(self) -> bool:
        """Take one call; False, taking nothing, when all are spent."""
        if self.spent >= self.limit:
            return False
        self.spent += 1
        return True

    def refund(self) -> None:
        """Give back a call that never reached the vendor."""
        self.spent = max(0, self.spent - 1)


@dataclass(frozen=True, slots=True)
class Request:
    """What the agent asked, as the route sends it upstream. Never changed once the chain runs:
    a policy that sends something else (a simpler query, an MCP attempt under its own id) sends
    a copy (`Flow.with_request`)."""

    route: str
    method: str
    path: str  # upstream path, already confined to the route
    query_string: str
    # Outbound headers: hop-by-hop stripped, route headers applied. Read-only from here on.
    headers: CIMultiDict[str]
    body: bytes
    request_id: str
    client: str  # hash of the caller's credentials (or the known client's name); "" if none
    # What the cache keys on instead of `body`, when the body carries per-call noise (an MCP
    # tools/call's JSON-RPC id and progress token); None: the body itself.
    key_body: bytes | None = None
    # The caller's own key for this vendor (/v1/search `credentials`): a key pool leaves it be.
    own_key: bool = False


@dataclass(slots=True)
class Context:
    """What bounds one agent request, shared by every flow it starts (a /v1/search request's
    queries and providers, their retries, variants and failovers)."""

    deadline: float  # clock.now() value after which no attempt may run
    started: float
    calls: CallBudget | None = None  # the request's bound on vendor calls; None: no bound
    # A flow sent to a route serving as another route's fallback: its own fallbacks are not
    # followed (failover is one level deep, so a graph of fallbacks cannot multiply a request).
    fallback: bool = False
    # Where interim messages of a long answer go while it is still running (an MCP server's
    # progress notifications), relayed to the agent at once; None: they are dropped.
    interim: Callable[[bytes], Awaitable[None]] | None = None
    # How much longer the policies may hold the request for the vendor, in all (failed
    # attempts, a Retry-After or backoff, the limiter's queue, the breaker's max_wait or slow
    # start, a benched key), before they fail it so failover answers now; set by failover while
    # a fallback can be asked, spent by each (`waited`); without a fallback no bound but the
    # deadline.
    wait_at_most: float = math.inf
    # The agent asked for injected faults (X-Search-Proxy-Fault): the request stays out of what
    # the route shares with other callers (breaker counts, limiter pauses, cache entries, benches).
    fault_test: bool = False

    def waited(self, seconds: float) -> None:
        """A policy held the request `seconds` for its vendor: that much less may follow."""
        self.wait_at_most = max(0.0, self.wait_at_most - seconds)


@dataclass(slots=True)
class Trace:
    """What was done for one route request, for its answer's headers and its log line. Only
    ever added to: counters grow, a field once set is the answer's (the last policy to set
    `cache` or `provider` is the one nearest the agent)."""

    attempts: int = 0  # attempts of the retry loop that reached the vendor (hedges not included)
    hedges: int = 0  # hedged attempts sent besides them (policies/hedge.py)
    upstream_seconds: float = 0.0  # time spent in upstream attempts
    waited_seconds: float = 0.0  # time spent deliberately waiting (backoff, rate limit)
    retry_reasons: list[str] = field(default_factory=list)
    cache: str | None = None  # hit, miss, stale, bypass
    breaker: str | None = None
    query_used: str | None = None
    provider: str | None = None  # the fallback route that answered, when failover did
    reply_headers: dict[str, str] = field(default_factory=dict)  # added to the agent's answer
    rpc: str | None = None  # an MCP route's JSON-RPC method (and tool), for the log line
    rpc_attempts: list[str] = field(default_factory=list)  # the JSON-RPC ids attempts went under
    # The type of an error the proxy answered inside a 200 (an MCP tool error), for the log.
    error: str | None = None
    # The cache key and entry a fresh hit answered from (the cache's `replay` can answer the
    # identical request again from them without the chain: proxy/replay.py).
    cached: tuple[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Flow:
    """One route request as the policies see it: the request, what bounds it, what was done,
    and which attempt of the retry loop this is (0 outside the loop)."""

    request: Request
    context: Context
    trace: Trace
    attempt: int = 0
    max_attempts: int = 1

    @classmethod
    def new(
        cls,
        *,
        route: str,
        method: str,
        path: str,
        query_string: str,
        headers: CIMultiDict[str],
        body: bytes,
        request_id: str,
        client: str,
        deadline: float,
        started: float,
        calls: CallBudget | None = None,
    ) -> Flow:
        """A new request's flow: its request, its own context and an empty trace."""
        request = Request(route, method, path, query_string, headers, body, request_id, client)
        return cls(request, Context(deadline, started, calls), Trace())

    def with_request(self, request: Request) -> Flow:
        """This flow sending `request` instead (same context, same trace)."""
        return Flow(request, self.context, self.trace, self.attempt, self.max_attempts)

    def for_attempt(self, attempt: int, max_attempts: int) -> Flow:
        """This flow as attempt `attempt` of `max_attempts` of the retry loop."""
        return Flow(self.request, self.context, self.trace, attempt, max_attempts)

    @property
    def attempt_text(self) -> str:
        """`(attempt 2 of 3)`, for the messages of a failed attempt."""
        return f"(attempt {self.attempt} of {self.max_attempts})"


Handler = Callable[[Flow], Awaitable[Reply]]
# A route's reading of its replies: once per reply, cached on it (`Reply.outcome`).
Classifier = Callable[[Reply], Outcome]


def status_outcome(reply: Reply) -> Outcome:
    """The classifier of a route without a search profile: the status alone decides."""
    return Outcome.of_status(reply.status)


class Policy(Protocol):
    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        """Answer `flow`, calling `call_next` zero or more times."""
        ...


def compose(policies: Sequence[Policy], terminal: Handler) -> Handler:
    """Wrap `terminal` in `policies`, the first one outermost."""
    handler = terminal
    for policy in reversed(policies):
        handler = partial(policy.handle, call_next=handler)
    return handler

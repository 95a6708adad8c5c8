"""The per-request state that walks a route's policy chain, and the reply that comes back.

A route is built once into a chain of policies wrapping the upstream call (httpx-transport
style). Each policy is `async def handle(flow, call_next) -> Reply`: it may answer itself,
pass on, or act on the reply. Policies annotate the flow; the server turns it into a log line.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

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

    def discard(self) -> None:
        """Give back the upstream connection of a reply we will not send."""
        if self.release is not None:
            self.release()
            self.release = None


class CallBudget:
    """How many vendor calls one agent request may still make, shared by every flow it starts
    (a /v1/search request's queries and providers, their retries, variants and failovers)."""

    __slots__ = ("limit", "spent")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.spent = 0

    def spend(self) -> bool:
        """Take one call; False, taking nothing, when all are spent."""
        if self.spent >= self.limit:
            return False
        self.spent += 1
        return True


@dataclass(slots=True)
class Flow:
    """One agent request as the policies see it."""

    route: str
    method: str
    path: str  # upstream path, already confined to the route
    query_string: str
    headers: CIMultiDict[str]  # outbound headers: hop-by-hop stripped, route headers applied
    body: bytes
    request_id: str
    client: str  # hash of the caller's credentials; "" when it sent none
    deadline: float  # clock.now() value after which no attempt may run
    started: float
    attempts: int = 0  # upstream attempts of the retry loop (hedges not included)
    max_attempts: int = 1
    hedges: int = 0  # hedged attempts sent besides them (policies/hedge.py)
    upstream_seconds: float = 0.0  # time spent in upstream attempts
    waited_seconds: float = 0.0  # time spent deliberately waiting (backoff, rate limit)
    retry_reasons: list[str] = field(default_factory=list)
    cache: str | None = None  # hit, miss, stale, bypass
    breaker: str | None = None
    query_used: str | None = None
    provider: str | None = None  # the fallback route that answered, when failover did
    reply_headers: dict[str, str] = field(default_factory=dict)  # added to the agent's answer
    calls: CallBudget | None = None  # the request's bound on vendor calls; None: no bound
    # What the cache keys on instead of `body`, when the body carries per-call noise (an MCP
    # tools/call's JSON-RPC id and progress token); None: the body itself.
    key_body: bytes | None = None
    # Where interim messages of a long answer go while it is still running (an MCP server's
    # progress notifications), relayed to the agent at once; None: they are dropped.
    interim: Callable[[bytes], Awaitable[None]] | None = None
    rpc: str | None = None  # an MCP route's JSON-RPC method (and tool), for the log line
    rpc_attempt: str | None = None  # the JSON-RPC id the current upstream attempt carries
    # The type of an error the proxy answered inside a 200 (an MCP tool error), for the log.
    error: str | None = None


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

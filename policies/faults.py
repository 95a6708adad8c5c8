"""Fault injection an agent asks for, to test its own error handling: on a route with
`fault_injection: {enabled: true, clients: [...]}`, a listed client's request carrying
`X-Search-Proxy-Fault: 503` (`429;retry_after=2`, `timeout`, `empty`, `malformed`, `latency=2s`,
with `rate=0.3` and `at=vendor|agent`) gets that fault instead of the vendor's answer.

`at=vendor` (the default) replaces the vendor's answer to each attempt (the last link of the
chain), so the route's retries, stale answers and failover act on it as on a real one; `at=agent`
answers the agent at once (the first link), in the vendor's own error or answer shape. Such a
request stays out of what the route shares with other callers (Context.fault_test): no breaker
count, limiter pause, cache entry or bench. The header never reaches a vendor (the server drops
it from every outbound request) and is ignored where injection is not enabled for the caller.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from multidict import CIMultiDict

from policies.backoff import attempt_timeout
from policies.core.clock import Clock
from policies.core.errors import BadRequest, ProxyError, UpstreamTimeout, seconds_text
from policies.core.events import Events
from policies.core.flow import Flow, Handler, Reply
from policies.core.profile import SearchResult, VendorProfile
from policies.core.route import RouteConfig
from policies.core.section import Build, Link, Section
from policies.core.settings import ConfigError, boolean, number, parse_duration, section, texts
from policies.profiles import render_answer, request_query

HEADER = "X-Search-Proxy-Fault"
KINDS = ("timeout", "empty", "malformed")  # besides a status and latency=<duration>
EXAMPLES = "503, 429;retry_after=2, timeout, empty, malformed, latency=2s (rate=0.3, at=agent)"
# The result a malformed answer is cut from.
_SAMPLE = SearchResult("https://example.com/injected-fault", "Injected fault", "Not a result.")


@dataclass(frozen=True)
class FaultInjectionConfig:
    """A route's `fault_injection:` section."""

    enabled: bool = False
    clients: tuple[str, ...] | None = None  # the `clients:` names allowed; None: every caller


@dataclass(frozen=True)
class Fault:
    """One `X-Search-Proxy-Fault` spec, parsed."""

    text: str  # as the agent wrote it, for messages
    kind: Literal["status", "timeout", "empty", "malformed", "latency"]
    status: int = 0
    retry_after: float | None = None
    seconds: float = 0.0  # latency
    rate: float = 1.0  # the share of requests (at=agent) or attempts (at=vendor) it hits
    at: Literal["vendor", "agent"] = "vendor"

    @property
    def label(self) -> str:
        """The metric's `fault` label: the status, or the kind."""
        return str(self.status) if self.kind == "status" else self.kind


def parse_fault(value: str) -> Fault:
    """The spec in an `X-Search-Proxy-Fault` header; BadRequest saying what is wrong."""
    found: dict[str, Any] = {"text": value.strip()}
    for part in (p.strip() for p in value.split(";") if p.strip()):
        name, eq, arg = (s.strip() for s in part.partition("="))
        try:
            if not eq and name.isdigit() and 400 <= int(name) <= 599 and "kind" not in found:
                found.update(kind="status", status=int(name))
            elif not eq and name in KINDS and "kind" not in found:
                found["kind"] = name
            elif name == "latency" and "kind" not in found:
                found.update(kind="latency", seconds=parse_duration(arg, HEADER))
            elif name == "retry_after":
                found["retry_after"] = parse_duration(arg, "")
            elif name == "rate":
                found["rate"] = number(_number(arg), "", 0.0, 1.0)
            elif name == "at" and arg in ("vendor", "agent"):
                found["at"] = arg
            else:
                raise ConfigError("", f"{part!r} is not part of a fault spec")
        except (ConfigError, ValueError) as exc:
            reason = exc.reason if isinstance(exc, ConfigError) else str(exc)
            raise _bad(f"{HEADER}: {reason} (examples: {EXAMPLES})") from None
    if "kind" not in found:
        raise _bad(f"{HEADER}: name one fault (examples: {EXAMPLES})")
    if found.get("retry_after") is not None and found["kind"] != "status":
        raise _bad(f"{HEADER}: retry_after goes with a status, as in 429;retry_after=2")
    return Fault(**found)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError("", f"rate must be a number from 0 to 1, got {text!r}") from None


def _bad(message: str) -> BadRequest:
    return BadRequest(message)


class InjectedFault(ProxyError):
    """An error status the agent asked for; its class carries the status (see `injected_error`)."""

    type = "injected_fault"
    injected = True


class InjectedTimeout(UpstreamTimeout):
    """A timeout the agent asked for."""

    injected = True


_BY_STATUS: dict[int, type[InjectedFault]] = {}


def injected_error(status: int, message: str, **details: Any) -> InjectedFault:
    """An InjectedFault answering `status` (one class per status, made once: at most 200)."""
    cls = _BY_STATUS.get(status)
    if cls is None:
        cls = _BY_STATUS[status] = type(
            f"InjectedFault{status}", (InjectedFault,), {"status": status}
        )
    return cls(message, **details)


class FaultInjector:
    """Both places a fault is injected; `at` says which this link is."""

    def __init__(
        self,
        route: str,
        config: FaultInjectionConfig,
        at: Literal["vendor", "agent"],
        *,
        profile: VendorProfile | None,
        per_try: float,
        clock: Clock,
        events: Events,
        rng: random.Random | None = None,
    ) -> None:
        self.route = route
        self.clients = frozenset(config.clients) if config.clients is not None else None
        self.at = at
        self.profile = profile
        self.per_try = per_try
        self.clock = clock
        self.events = events
        self.rng = rng or random.Random()

    async def handle(self, flow: Flow, call_next: Handler) -> Reply:
        if self.at == "agent":
            return await self._at_agent(flow, call_next)
        fault = self._asked(flow) if flow.context.fault_test else None
        if fault is None or fault.at != "vendor" or not self._hits(fault):
            return await call_next(flow)
        self.events.fault(self.route, fault.label, "vendor")
        if fault.kind in ("timeout", "latency"):
            budget = attempt_timeout(self.clock.now(), flow.context.deadline, self.per_try)
            if fault.kind == "latency" and fault.seconds < budget:
                await self.clock.sleep(fault.seconds)
                return await call_next(flow)
            await self.clock.sleep(budget)  # the vendor sends nothing until the attempt ends
            raise InjectedTimeout(
                f"{self.route}: upstream timed out after {seconds_text(budget)} "
                f"{flow.attempt_text} (a fault injected by {HEADER}); try again shortly",
                route=self.route,
                attempts=flow.attempt,
                reason=f"timed out after {seconds_text(budget)}",
            )
        if fault.kind == "status":
            err = self._error(fault, flow)
            shape = self.profile.error_shape if self.profile is not None else None
            body = shape(err, flow.request.request_id) if shape is not None else err.payload()
            headers = CIMultiDict({"Content-Type": "application/json"})
            if fault.retry_after is not None:
                headers["Retry-After"] = f"{fault.retry_after:g}"
            return Reply(fault.status, headers, orjson.dumps(body), injected=True)
        return self._answer(fault, flow)

    async def _at_agent(self, flow: Flow, call_next: Handler) -> Reply:
        """The first link: is this request a fault test? Answer the agent's fault at once."""
        fault = self._asked(flow)
        if fault is None:
            return await call_next(flow)
        flow.context.fault_test = True
        if fault.at != "agent" or not self._hits(fault):
            return await call_next(flow)
        self.events.fault(self.route, fault.label, "agent")
        if fault.kind == "latency":
            await self.clock.sleep(
                max(0.0, min(fault.seconds, flow.context.deadline - self.clock.now()))
            )
            return await call_next(flow)
        if fault.kind == "timeout":
            raise InjectedTimeout(
                f"{self.route}: upstream timed out (a fault injected by {HEADER}); try again "
                "shortly",
                route=self.route,
                reason="timed out",
            )
        if fault.kind == "status":
            raise self._error(fault, flow)
        return self._answer(fault, flow)

    def _asked(self, flow: Flow) -> Fault | None:
        """The fault this request asks for, if its caller may ask for one here."""
        value = flow.request.headers.get(HEADER)
        if value is None or (self.clients is not None and flow.request.client not in self.clients):
            return None
        return parse_fault(value)

    def _hits(self, fault: Fault) -> bool:
        return fault.rate >= 1.0 or self.rng.random() < fault.rate

    def _error(self, fault: Fault, flow: Flow) -> InjectedFault:
        return injected_error(
            fault.status,
            f"{self.route}: the vendor answered {fault.status} (a fault injected by {HEADER}: "
            f"{fault.text}), not a real failure",
            route=self.route,
            attempts=flow.attempt,
            upstream_status=fault.status,
            retry_after_s=fault.retry_after,
            reason=f"{fault.status} (injected)",
        )

    def _answer(self, fault: Fault, flow: Flow) -> Reply:
        """An empty answer in the vendor's own shape, or one cut short (malformed)."""
        if self.profile is None:
            raise _bad(f"{HEADER}: {fault.kind} needs a route with a search section")
        ref = request_query(self.profile, flow.request)
        query = ref.text if ref is not None else ""
        results = [] if fault.kind == "empty" else [_SAMPLE]
        body = orjson.dumps(render_answer(self.profile, results, query))
        if fault.kind == "malformed":
            body = body[: len(body) // 2]
        headers = CIMultiDict({"Content-Type": "application/json"})
        return Reply(200, headers, body, injected=True)


# ---------------------------------------------------------------------------------------------
# The `fault_injection:` section


def parse(raw: Any, path: str) -> FaultInjectionConfig:
    return section(raw, path, FaultInjectionConfig, {"enabled": boolean, "clients": texts})


def check(cfg: FaultInjectionConfig, route: RouteConfig, path: str) -> list[ConfigError]:
    if route.has("mcp"):  # its answers are JSON-RPC, not a vendor's shapes
        return [ConfigError(path, "not available on an MCP route; remove fault_injection")]
    return []


SECTION = Section("fault_injection", parse, check)


def _build(at: Literal["vendor", "agent"]) -> Any:
    def build(cfg: FaultInjectionConfig, route: Build) -> FaultInjector | None:
        if not cfg.enabled:
            return None
        return FaultInjector(
            route.route.name,
            cfg,
            at,
            profile=route.profile,
            per_try=route.route.timeouts.per_try,
            clock=route.clock,
            events=route.events,
        )

    return build


# First in the chain: a request is known to be a fault test before any policy acts on it, and a
# fault at the agent is answered before any of them. Last: a fault at the vendor is its answer.
AT_AGENT = Link("fault injection", SECTION, _build("agent"))
AT_VENDOR = Link("fault injection", SECTION, _build("vendor"))

"""What the agent's own code sees when the proxy fails a call: each vendor SDK, pointed at its
route, raises an exception that carries the proxy's message (it is rendered in the vendor's
error shape and reason phrase), and a passing cause never raises the SDK's out-of-credits class.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import scavio
from langchain_tavily import TavilySearch
from linkup import LinkupBudgetLimitExceededError, LinkupInsufficientCreditError
from tavily.errors import ForbiddenError

from testkit.fakevendor import FakeVendor, Fault
from testkit.procs import free_port
from tests.conftest import route
from tests.test_sdks import KEY, SDKS, Sdk

FAST_RETRY = {"attempts": 2, "backoff": {"initial": "10ms", "max": "20ms"}}

# The SDKs' classes for an exhausted plan: a passing failure must never become one of them.
PLAN_EXHAUSTED: tuple[type[BaseException], ...] = (
    ForbiddenError,
    scavio.InsufficientCreditsError,
    LinkupInsufficientCreditError,
    LinkupBudgetLimitExceededError,
)


@dataclass(frozen=True)
class Failure:
    """One way the proxy fails a call: the route's policies, the vendor's behaviour, and a
    phrase of the proxy's message that must reach the agent."""

    name: str
    status: int
    phrase: str
    policies: Callable[[], dict[str, Any]]
    vendor: Callable[[FakeVendor], object]
    warm_up: bool = False  # one call first (it trips the breaker or spends the token)
    dead_upstream: bool = False


FAILURES = [
    Failure(
        "unreachable",
        502,
        "cannot connect to the upstream",
        lambda: {"retry": FAST_RETRY},
        lambda v: None,
        dead_upstream=True,
    ),
    Failure(
        "timeout",
        504,
        "upstream timed out after 300ms",
        lambda: {
            "retry": {"attempts": 1},
            "timeouts": {"connect": "1s", "per_try": "300ms", "total": "3s"},
        },
        lambda v: v.set_default(Fault.hang(5)),
    ),
    Failure(
        "deadline",
        504,
        "total deadline of 500ms exceeded",
        lambda: {
            "retry": FAST_RETRY,
            "timeouts": {"connect": "1s", "per_try": "400ms", "total": "500ms"},
        },
        lambda v: v.set_default(Fault.hang(5)),
    ),
    Failure(
        "breaker_open",
        503,
        "circuit open",
        lambda: {"retry": {"attempts": 1}, "breaker": {"fail_max": 1, "reset_timeout": "60s"}},
        lambda v: v.set_default(Fault.status(503)),
        warm_up=True,
    ),
    Failure(
        "our_limiter",
        429,
        "search-proxy's own rate limit",
        lambda: {"rate_limit": {"rate": "1/m", "burst": 1, "max_wait": "0s"}},
        lambda v: None,
        warm_up=True,
    ),
    Failure(
        "vendor_retry_after_too_long",
        429,
        "asks to retry after",
        lambda: {"retry": {"attempts": 3, "retry_after": {"max_wait": "10s"}}},
        lambda v: v.set_default(Fault.status(429, retry_after=3600)),
    ),
    Failure(
        "malformed",
        502,
        "not a usable search response",
        lambda: {"retry": FAST_RETRY},
        lambda v: v.set_default(Fault.malformed()),
    ),
]


async def _proxy_for(sdk: Sdk, failure: Failure, vendor: FakeVendor, start_proxy: Any) -> Any:
    upstream = f"http://127.0.0.1:{free_port()}" if failure.dead_upstream else vendor.url
    body = route(f"{upstream}/{sdk.name}", f"/{sdk.name}", search={"vendor": sdk.name})
    body.update(failure.policies())
    return await start_proxy({"routes": {sdk.name: body}})


async def _sdk_error(sdk: Sdk, mode: str, client: Any) -> BaseException:
    base = str(client.make_url(f"/{sdk.name}"))
    fn = sdk.calls[mode]
    try:
        if mode == "async":
            await fn(base, "proxy errors reach the agent", sdk.n)
        else:
            await asyncio.to_thread(fn, base, "proxy errors reach the agent", sdk.n)
    except Exception as exc:
        return exc
    raise AssertionError(f"{sdk.name} {mode}: the SDK returned results instead of raising")


async def _warm_up(sdk: Sdk, mode: str, client: Any) -> None:
    base = str(client.make_url(f"/{sdk.name}"))
    fn = sdk.calls[mode]
    try:
        if mode == "async":
            await fn(base, "warm up", sdk.n)
        else:
            await asyncio.to_thread(fn, base, "warm up", sdk.n)
    except Exception:
        pass  # the breaker case: the vendor's own 503 trips it


CASES = [
    pytest.param(sdk, mode, failure, id=f"{sdk.name}-{mode}-{failure.name}")
    for failure in FAILURES
    for sdk in SDKS
    for mode in sdk.calls
]


@pytest.mark.parametrize(("sdk", "mode", "failure"), CASES)
async def test_sdk_exception_carries_the_proxy_message(
    sdk: Sdk, mode: str, failure: Failure, vendor: FakeVendor, start_proxy: Any
) -> None:
    failure.vendor(vendor)
    client = await _proxy_for(sdk, failure, vendor, start_proxy)
    if failure.warm_up:
        await _warm_up(sdk, mode, client)
    exc = await _sdk_error(sdk, mode, client)
    assert not isinstance(exc, PLAN_EXHAUSTED), f"{type(exc).__name__}: {exc}"
    if sdk.name == "brave":
        # LangChain's Brave wrapper reads neither body nor reason: only the status survives.
        assert str(exc) == f"HTTP error {failure.status}"
        return
    assert failure.phrase in str(exc), f"{type(exc).__name__}: {exc}"


def _tavily_tool(base: str) -> TavilySearch:
    return TavilySearch(tavily_api_key=KEY, api_base_url=base, max_results=2)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("failure", FAILURES, ids=[f.name for f in FAILURES])
async def test_langchain_tavily_tool_output_carries_the_proxy_message(
    mode: str, failure: Failure, vendor: FakeVendor, start_proxy: Any
) -> None:
    """langchain-tavily turns the error into the tool's output: that string is what the LLM
    reads, so it must say what happened."""
    tavily_sdk = next(s for s in SDKS if s.name == "tavily")
    failure.vendor(vendor)
    client = await _proxy_for(tavily_sdk, failure, vendor, start_proxy)
    tool = _tavily_tool(str(client.make_url("/tavily")))
    for attempt in range(2 if failure.warm_up else 1):
        query = {"query": "warm up" if attempt == 0 and failure.warm_up else "tool errors"}
        if mode == "async":
            output = await tool.ainvoke(query)
        else:
            output = await asyncio.to_thread(tool.invoke, query)
    assert isinstance(output, dict) and "error" in output, output
    text = str(output)
    assert failure.phrase in text, text
    assert re.search(rf"Error {failure.status}\b", text), text

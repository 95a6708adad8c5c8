"""Fault injection an agent asks for (`X-Search-Proxy-Fault`), to test its own error handling:
at the vendor (the route's policies act on it), at the agent (answered at once in the vendor's
shape), only for the listed clients of a route that enables it, never forwarded, counted apart,
and never changing what the route shares with other callers."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from policies.core.clock import ManualClock
from policies.core.errors import BadRequest
from policies.faults import HEADER, Fault, parse_fault
from testkit.fakevendor import FakeVendor
from tests.conftest import route

CI_TOKEN = "ci-7e3a9c1f5b2d8e4a60"  # generated-looking: a guessable token is refused
OTHER_TOKEN = "other-4b8e2d6f1a9c3e7b05"
CONFIGURATION = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
RETRY = {"attempts": 3, "backoff": {"initial": "10ms", "max": "20ms"}}


def config(vendor: FakeVendor, *, injection: bool = True, **extra: Any) -> dict[str, Any]:
    tavily = route(
        f"{vendor.url}/tavily",
        "/tavily",
        search={"vendor": "tavily"},
        headers={"set": {"Authorization": "Bearer tavily-route-key"}},
        **{"retry": RETRY, **extra},
    )
    if injection:
        tavily["fault_injection"] = {"enabled": True, "clients": ["ci"]}
    exa = route(
        f"{vendor.url}/exa",
        "/exa",
        search={"vendor": "exa"},
        headers={"set": {"x-api-key": "exa-route-key"}},
    )
    return {
        "clients": {"ci": CI_TOKEN, "other": OTHER_TOKEN},
        "routes": {"tavily": tavily, "exa": exa},
    }


async def search(client: Any, fault: str | None, *, token: str = CI_TOKEN, q: str = "q") -> Any:
    headers = {"Authorization": f"Bearer {token}"}
    if fault is not None:
        headers[HEADER] = fault
    return await client.post("/tavily/search", json={"query": q}, headers=headers)


async def metric_lines(client: Any, name: str) -> list[str]:
    text = await (await client.get("/metrics")).text()
    return [line for line in text.splitlines() if line.startswith(name)]


async def test_at_the_vendor_the_routes_retries_act_and_the_agent_sees_their_result(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(config(vendor))
    r = await search(client, "503")
    assert r.status == 503 and r.headers["X-Proxy-Attempts"] == "3"
    body = await r.json()
    assert "a fault injected by X-Search-Proxy-Fault: 503" in body["detail"]["error"]
    assert vendor.count("/tavily") == 0  # every attempt's answer was the injected one
    injected = await metric_lines(client, "search_proxy_faults_injected_total")
    assert injected == [
        'search_proxy_faults_injected_total{at="vendor",fault="503",route="tavily"} 3.0'
    ]
    # The route's series are declared at zero; no injected attempt counts as a vendor's.
    attempts = await metric_lines(client, "search_proxy_upstream_attempts_total")
    assert attempts and all(line.endswith(" 0.0") for line in attempts), attempts


async def test_at_the_vendor_failover_answers_a_failed_primary(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(config(vendor, fallback={"providers": ["exa"]}))
    r = await search(client, "429;retry_after=30")
    assert r.status == 200 and r.headers["X-Search-Provider"] == "exa"
    assert (await r.json())["results"]


async def test_a_vendor_timeout_takes_the_attempts_time_then_is_retried(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    clock = ManualClock()
    client = await start_proxy(config(vendor), clock=clock)
    r = await search(client, "timeout;rate=1")
    assert r.status == 504 and r.headers["X-Proxy-Error"] == "upstream_timeout"
    assert clock.sleeps.count(2.0) == 2  # per_try, twice; the third fits the deadline left
    latency = await search(client, "latency=1500ms")
    assert latency.status == 200 and 1.5 in clock.sleeps
    assert vendor.count("/tavily") == 1  # the latency fault then asked the vendor


@pytest.mark.parametrize(
    ("spec", "status", "check"),
    [
        ("429;retry_after=2;at=agent", 429, "detail"),
        ("503;at=agent", 503, "detail"),
        ("timeout;at=agent", 504, "detail"),
        ("empty;at=agent", 200, "empty"),
        ("malformed;at=agent", 200, "malformed"),
    ],
)
async def test_at_the_agent_it_is_answered_at_once_in_the_vendors_shape(
    vendor: FakeVendor, start_proxy: Any, spec: str, status: int, check: str
) -> None:
    client = await start_proxy(config(vendor, fallback={"providers": ["exa"]}))
    r = await search(client, spec)
    assert r.status == status
    body = await r.read()
    if check == "detail":  # Tavily's error shape: tavily-python shows the message
        assert "X-Search-Proxy-Fault" in (await r.json())["detail"]["error"]
        assert r.headers["X-Proxy-Error"] in ("injected_fault", "upstream_timeout")
    elif check == "empty":
        assert (await r.json())["results"] == [] and (await r.json())["query"] == "q"
    else:
        assert body.startswith(b'{"query"') and not body.endswith(b"}")
    if status == 429:
        assert r.headers["Retry-After"] == "2"
    assert vendor.count() == 0  # neither the vendor nor the fallback was asked


async def test_without_fault_injection_the_header_is_removed_and_ignored(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(config(vendor, injection=False))
    r = await search(client, "503")
    assert r.status == 200 and (await r.json())["results"]
    assert HEADER not in vendor.last.headers


async def test_a_client_not_listed_is_not_injected_and_the_header_not_forwarded(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(config(vendor))
    r = await search(client, "503;at=agent", token=OTHER_TOKEN)
    assert r.status == 200 and (await r.json())["results"]
    assert HEADER not in vendor.last.headers
    r = await search(client, "not a fault", token=OTHER_TOKEN)
    assert r.status == 200  # not even read for a caller it is not for


async def test_a_listed_clients_bad_spec_is_a_bad_request_naming_the_header(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(config(vendor))
    r = await search(client, "504;at=nowhere")
    assert r.status == 400
    assert "X-Search-Proxy-Fault: 'at=nowhere' is not part of a fault spec" in await r.text()
    assert vendor.count() == 0


async def test_injected_faults_leave_the_routes_shared_state_alone(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    """A test request's faults open no circuit, pause no limiter, store no entry and bench no
    vendor: the other callers of the route see none of them."""
    clock = ManualClock()
    raw = config(
        vendor,
        breaker={"fail_max": 1, "reset_timeout": "30s"},
        rate_limit={"rate": "100/s", "burst": 100},
        cache={"ttl": "10m"},
        fallback={"providers": ["exa"]},
    )
    client = await start_proxy(raw, clock=clock)
    assert (await search(client, "503")).headers["X-Search-Provider"] == "exa"
    assert (await search(client, "429;retry_after=60")).headers["X-Search-Provider"] == "exa"
    assert (await search(client, "432")).headers["X-Search-Provider"] == "exa"
    assert (await search(client, "empty", q="cached?")).status == 200
    ok = await search(client, None, token=OTHER_TOKEN, q="cached?")
    assert ok.status == 200 and "X-Search-Provider" not in ok.headers
    assert ok.headers["X-Cache"] == "MISS" and (await ok.json())["results"]
    assert max(clock.sleeps) < 1  # backoff only: no limiter paused by the injected Retry-After
    assert vendor.count("/tavily") == 1


def test_fault_specs_parse_and_mistakes_say_what_is_wrong() -> None:
    assert parse_fault("429;retry_after=2") == Fault("429;retry_after=2", "status", 429, 2.0)
    assert parse_fault(" latency=2s ; at=agent ; rate=0.3") == Fault(
        "latency=2s ; at=agent ; rate=0.3", "latency", seconds=2.0, rate=0.3, at="agent"
    )
    assert parse_fault("rate=0.5;timeout").kind == "timeout"
    for bad, why in [
        ("", "name one fault"),
        ("200", "'200' is not part of a fault spec"),
        ("503;empty", "'empty' is not part of a fault spec"),
        ("503;rate=2", "rate"),
        ("latency=soon", "expected a duration"),
        ("empty;retry_after=2", "retry_after goes with a status"),
    ]:
        with pytest.raises(BadRequest, match=why):
            parse_fault(bad)


async def test_rate_injects_that_share_of_attempts(vendor: FakeVendor, start_proxy: Any) -> None:
    client = await start_proxy(config(vendor, retry={"attempts": 1}))
    injected = 0
    for i in range(40):
        r = await search(client, "503;rate=0.5", q=f"rate {i}")
        injected += r.status == 503
    assert 8 <= injected <= 32  # about half, whatever the seed
    assert vendor.count("/tavily") == 40 - injected


def test_config_refuses_clients_that_do_not_exist(vendor: FakeVendor) -> None:
    from proxy.config import ConfigErrors, parse_config

    raw = config(vendor)
    raw["routes"]["tavily"]["fault_injection"]["clients"] = ["ci", "nobody"]
    with pytest.raises(ConfigErrors) as info:
        parse_config(raw, {})
    assert str(info.value) == (
        "routes.tavily.fault_injection.clients[1]: 'nobody' is not a client under clients:"
    )
    del raw["clients"]
    with pytest.raises(ConfigErrors, match=r"clients\[0\]: 'ci' is not a client"):
        parse_config(raw, {})
    mcp = route(vendor.url, "/mcp-tavily", mcp={"server": "tavily"}, fault_injection={})
    with pytest.raises(ConfigErrors, match="fault_injection: not available on an MCP route"):
        parse_config({"routes": {"m": mcp}}, {})


async def test_the_docs_example_raises_the_sdks_rate_limit_error(
    vendor: FakeVendor, start_proxy: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/configuration.md's snippet, run as written but for the proxy's address and the
    token."""
    text = CONFIGURATION.read_text(encoding="utf-8")
    part = text[
        text.index("## `routes.<name>.fault_injection`") : text.index("## `routes.<name>.mcp`")
    ]
    (code,) = re.findall(r"```python\n(.*?)```", part, re.DOTALL)
    client = await start_proxy(config(vendor))
    code = code.replace("http://localhost:8080", str(client.make_url("")).rstrip("/"))
    await asyncio.to_thread(
        exec, compile(code, "docs/configuration.md", "exec"), {"ci_agent_token": CI_TOKEN}
    )
    printed = capsys.readouterr().out
    assert "tavily: the vendor answered 429 (a fault injected by X-Search-Proxy-Fault" in printed
    assert vendor.count() == 0

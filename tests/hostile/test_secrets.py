"""Keys the proxy holds never reach an agent, and an agent's key never reaches the vendor beside
the route's, against real proxy processes: tavily-mcp's `api_key` in the JSON body (a client
token there is removed; the agent's own key is replaced by the injected one), a vendor echoing
the injected key in its body or a header, and OAuth-shaped query parameters in the log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from testkit.fakevendor import FakeVendor, Fault
from testkit.proxyprocess import ProxyProcess
from testkit.waiting import wait_until
from tests.conftest import route

ROUTE_KEY = "tvly-route-7c2e9a4f1b8d3e6a"
ECHO_KEY = "echo-key-5b1f8d2c9e4a7f30"
AGENT_KEY = "tvly-agent-3d8a1f6c9b2e5a74"
CLIENT_TOKEN = "agent-9e3b7d1f5a2c8e46b0"


def routes(url: str) -> dict[str, Any]:
    bearer = {"set": {"Authorization": f"Bearer {ROUTE_KEY}"}}
    return {
        "tavily": route(f"{url}/tavily", "/tavily", search={"vendor": "tavily"}, headers=bearer),
        "echo": route(url, "/echo", headers={"set": {"X-Api-Key": ECHO_KEY}}),
    }


@pytest.fixture(scope="module")
def proxy(fake: FakeVendor) -> Iterator[ProxyProcess]:
    process = ProxyProcess({"routes": routes(fake.url)}).start()  # type: ignore[attr-defined]
    yield process
    process.stop()


@pytest.fixture(scope="module")
def gated(fake: FakeVendor) -> Iterator[ProxyProcess]:
    config = {"routes": routes(fake.url), "clients": {"agent": CLIENT_TOKEN}}  # type: ignore[attr-defined]
    process = ProxyProcess(config).start()
    yield process
    process.stop()


async def post(url: str, body: dict[str, Any], **headers: str) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


def received(fake: FakeVendor) -> tuple[str, dict[str, Any]]:
    """What the vendor got last: its whole request as text, and its JSON body."""
    last = fake.last
    text = "\n".join(f"{k}: {v}" for k, v in last.headers.items()) + "\n" + last.text
    return text, json.loads(last.body)


async def as_tavily_mcp(proxy: ProxyProcess, fake: FakeVendor, key: str) -> tuple[str, Any]:
    """A search as tavily-mcp sends it through the proxy (its key in the header and in the
    body): what the vendor got, as `received` reads it. The header holds the route's key."""
    body = {"query": "one key", "api_key": key}
    status, _, _ = await post(f"{proxy.url}/tavily/search", body, Authorization=f"Bearer {key}")
    assert status == 200
    assert fake.last.headers["Authorization"] == f"Bearer {ROUTE_KEY}"
    return received(fake)


async def test_without_clients_the_agents_key_in_the_body_is_replaced_by_the_routes(
    proxy: ProxyProcess, fake: FakeVendor
) -> None:
    text, sent = await as_tavily_mcp(proxy, fake, AGENT_KEY)
    assert sent["api_key"] == ROUTE_KEY
    assert AGENT_KEY not in text  # one key reaches the vendor: the route's


async def test_a_client_token_in_the_body_is_recognised_and_removed(
    gated: ProxyProcess, fake: FakeVendor
) -> None:
    text, sent = await as_tavily_mcp(gated, fake, CLIENT_TOKEN)
    assert CLIENT_TOKEN not in text
    assert "api_key" not in sent
    # The token in the body alone identifies the caller too, and is removed all the same.
    body = {"query": "one key", "api_key": CLIENT_TOKEN}
    status, _, _ = await post(f"{gated.url}/tavily/search", body)
    assert status == 200 and CLIENT_TOKEN not in received(fake)[0]
    status, _, _ = await post(f"{gated.url}/tavily/search", {"query": "x", "api_key": "nope"})
    assert status == 401


async def test_a_vendor_echoing_the_injected_key_hands_it_to_no_agent(
    proxy: ProxyProcess, fake: FakeVendor
) -> None:
    # The fake's /echo answers with every header it got, the injected key among them.
    status, headers, data = await post(f"{proxy.url}/echo/echo", {"q": "echo"})
    assert status == 200 and fake.last.headers["X-Api-Key"] == ECHO_KEY  # it was sent
    assert ECHO_KEY.encode() not in data and b"<redacted>" in data
    # A vendor echoing it in a header and in a search answer.
    echoed = {"results": [], "you_sent": f"Bearer {ROUTE_KEY}"}
    fake.script(Fault.status(200, echoed, {"X-Echo": ROUTE_KEY}), path_prefix="/tavily")
    status, headers, data = await post(f"{proxy.url}/tavily/search", {"query": "echo"})
    assert status == 200
    assert ROUTE_KEY.encode() not in data and ROUTE_KEY not in json.dumps(headers)
    assert headers["X-Echo"] == "<redacted>"
    expected = {("echo", "body"), ("tavily", "body"), ("tavily", "header")}

    def redactions() -> set[tuple[str, str]] | None:
        # Every one expected, not the first to come through the log pipe.
        seen = {(e["route"], e["where"]) for e in proxy.events("secret_redacted")}
        return seen if seen >= expected else None

    assert wait_until(redactions, 5) >= expected
    assert all(ROUTE_KEY not in line and ECHO_KEY not in line for line in proxy.lines)


async def test_a_vendor_echoing_the_key_in_a_stream_hands_it_to_no_agent(
    proxy: ProxyProcess, fake: FakeVendor
) -> None:
    # Each chunk of the fake's stream ends with the key the route injected.
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{proxy.url}/echo/stream?chunks=5&echo=X-Api-Key") as r,
    ):
        assert r.status == 200 and "Content-Length" not in r.headers  # passed on as a stream
        data = await r.read()
    assert fake.last.headers["X-Api-Key"] == ECHO_KEY  # it was sent
    assert data.count(b"<redacted>") == 5 and ECHO_KEY.encode() not in data
    assert wait_until(
        lambda: [e for e in proxy.events("secret_redacted") if e["where"] == "stream"] or None, 5
    )


async def test_a_key_echoed_across_two_chunks_of_a_stream_reaches_no_agent(
    proxy: ProxyProcess, fake: FakeVendor
) -> None:
    # Each echo is cut in two chunks written 50 ms apart, so the proxy reads them apart.
    url = f"{proxy.url}/echo/stream?chunks=3&echo=X-Api-Key&split=1&pause_ms=50"
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        assert r.status == 200
        pieces = [piece async for piece in r.content.iter_any()]
    data = b"".join(pieces)
    assert ECHO_KEY.encode() not in data and ECHO_KEY[:12].encode() not in data
    assert data == b"".join(f"chunk-{i} <redacted>\n".encode() for i in range(3))
    assert len(pieces) > 1  # still a stream: each line went out as it came


async def test_oauth_shaped_query_parameters_are_redacted_in_the_log(
    proxy: ProxyProcess, fake: FakeVendor
) -> None:
    async with aiohttp.ClientSession() as http:
        url = f"{proxy.url}/echo/echo/cb?code=oauth-code-4f9a&refresh=rt-2c7e&state=kept"
        async with http.get(url) as r:
            assert r.status == 200
    line = wait_until(
        lambda: [e for e in proxy.events("request") if e["path"] == "/echo/echo/cb"], 5
    )[-1]
    assert line["query"] == "code=<redacted>&refresh=<redacted>&state=kept"
    assert not any("oauth-code-4f9a" in text or "rt-2c7e" in text for text in proxy.lines)

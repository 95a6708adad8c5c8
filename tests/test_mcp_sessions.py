"""The sessions of an MCP route end to end, with the official mcp client and the fake MCP server:
each belongs to the credentials that opened it, an `initialize` rides out a blip and, while the
server is down, is answered by the proxy itself, a server that is gone ends its sessions the
way clients expect, an upstream's trailing-slash redirect is followed inside the proxy, and a
plain route's cache never replays a session."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import httpx
import pytest
from yarl import URL

from policies.core.clock import ManualClock
from testkit.fakemcp import FakeMcp, serve_fake_mcp
from testkit.waiting import eventually
from tests.conftest import route
from tests.test_mcp_route import Start, connect, results_of, session_headers, start, text_of

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "raw", "version": "1"},
    },
}
INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}
LIST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
ACCEPT = {"Accept": "application/json, text/event-stream"}


async def test_another_caller_can_neither_use_nor_end_a_session(
    start_proxy: Start,
) -> None:
    fake = FakeMcp()
    async with serve_fake_mcp(fake):
        url = await start(start_proxy, fake, cache={"ttl": "60s"})
        async with connect(url, "alice-key") as (alice, alice_id):
            await eventually(lambda: fake.gets == 1)  # the client's handshake is done
            sent = len(fake.requests)
            theirs = session_headers(alice_id())
            async with httpx.AsyncClient(timeout=10) as bob:
                for key in ("bob-key", None):  # another key, and none at all
                    auth = {"Authorization": f"Bearer {key}"} if key else {}
                    used = await bob.post(url, json=LIST, headers={**theirs, **auth})
                    ended = await bob.delete(url, headers={**theirs, **auth})
                    for answer in (used, ended):
                        assert answer.status_code == 404
                        assert answer.headers["X-Proxy-Error"] == "session_not_found"
                    error = used.json()["error"]
                    assert (
                        used.json()["id"] == 1
                        and "belongs to the credentials" in (error["message"])
                    )
            assert len(fake.requests) == sent and fake.deletes == 0  # nothing reached it
            assert results_of(await alice.call_tool("tavily_search", {"query": "still mine"}))
    assert fake.deletes == 1  # alice's own DELETE, on leaving


async def test_a_session_stays_its_callers_when_the_server_sets_a_cookie(
    start_proxy: Start,
) -> None:
    """A load balancer's sticky cookie comes back on every later request: it is state the
    server handed the client, not another caller."""
    fake = FakeMcp(set_cookie="lb=node-7; Path=/")
    async with serve_fake_mcp(fake):
        url = await start(start_proxy, fake)
        async with connect(url, "alice-key") as (alice, _):
            assert results_of(await alice.call_tool("tavily_search", {"query": "sticky"}))
            assert (await alice.list_tools()).tools


async def test_initialize_and_initialized_are_retried_through_a_blip(
    start_proxy: Start,
) -> None:
    fake = FakeMcp(fail_initialize=2)
    async with serve_fake_mcp(fake):
        retry = {"attempts": 3, "backoff": {"initial": "10ms", "max": "20ms"}}
        url = await start(start_proxy, fake, retry=retry)
        async with connect(url) as (session, _):
            assert results_of(await session.call_tool("tavily_search", {"query": "after"}))
    assert fake.initializes == 3
    assert fake.requests[:4] == ["POST initialize"] * 3 + ["POST notifications/initialized"]


async def test_an_agent_starting_during_an_outage_gets_stale_answers_then_fresh_ones(
    start_proxy: Start,
) -> None:
    clock = ManualClock()
    fake = FakeMcp()
    async with serve_fake_mcp(fake) as endpoint:
        port = URL(endpoint).port
        cache = {"ttl": "1m", "stale_ttl": "1h"}
        url = await start(start_proxy, fake, clock=clock, cache=cache, retry={"attempts": 2})
        async with connect(url) as (first, _):  # the proxy sees the server answer once
            warm = await first.call_tool("tavily_search", {"query": "remember this"})
    clock.advance(120)  # past ttl: only stale answers now, and the server is gone
    async with contextlib.AsyncExitStack() as stack:
        agent, session_id = await stack.enter_async_context(connect(url))
        assert session_id().startswith("sp-offline-")
        tools = await agent.list_tools()
        assert {t.name for t in tools.tools} == {"tavily_search", "tavily_extract"}
        stale = await agent.call_tool("tavily_search", {"query": "remember this"})
        assert text_of(stale) == text_of(warm)
        assert (stale.meta or {})["search-proxy/cache"] == "stale"
        unknown = await agent.call_tool("tavily_search", {"query": "never asked"})
        assert unknown.isError and "cannot connect" in text_of(unknown)
        known = set(fake.session_ids)
        async with serve_fake_mcp(fake, port=port):  # the server is back
            fresh = await agent.call_tool("tavily_search", {"query": "new question"})
            assert json.loads(text_of(fresh))["query"] == "new question"
            assert results_of(await agent.call_tool("tavily_search", {"query": "another"}))
            # One session of the server's own opened behind the agent's, then used.
            behind = fake.session_ids - known
            assert len(behind) == 1 and {c.session_id for c in fake.calls[-2:]} == behind
            await stack.aclose()  # the agent leaves: its DELETE ends the server's session
            assert fake.deletes == 2


async def test_the_offline_initialize_is_marked(start_proxy: Start) -> None:
    fake = FakeMcp()
    async with serve_fake_mcp(fake):
        url = await start(start_proxy, fake, cache={"ttl": "1m"})
        async with httpx.AsyncClient(timeout=10) as http:
            seen = await http.post(url, json=INITIALIZE, headers=ACCEPT)
            in_it = session_headers(seen.headers["Mcp-Session-Id"])
            await http.post(url, json=INITIALIZED, headers=in_it)
            assert (await http.post(url, json=LIST, headers=in_it)).status_code == 200
    async with httpx.AsyncClient(timeout=10) as http:
        opened = await http.post(url, json=INITIALIZE, headers=ACCEPT)
        headers = session_headers(opened.headers["Mcp-Session-Id"])
        listed = await http.post(url, json=LIST, headers=headers)
        stream = await http.get(url, headers={**headers, "Accept": "text/event-stream"})
        ended = await http.delete(url, headers=headers)
        after = await http.post(url, json=LIST, headers=headers)
    result = opened.json()["result"]
    assert result["_meta"]["search-proxy/offline"] is True
    assert result["serverInfo"]["name"] == "fake-tavily"
    assert opened.headers["X-Proxy-Error"] == "upstream_unreachable"
    assert listed.json()["result"]["_meta"]["search-proxy/offline"] is True
    assert stream.status_code == 405 and ended.status_code == 200
    # Forgotten: the session id now goes to the server, which is gone.
    assert "cannot connect" in after.json()["error"]["message"]


async def test_without_a_cache_no_session_is_opened_offline(start_proxy: Start) -> None:
    fake = FakeMcp()
    async with serve_fake_mcp(fake):
        url = await start(start_proxy, fake)
        async with connect(url):
            pass
    async with httpx.AsyncClient(timeout=10) as http:
        refused = await http.post(url, json=INITIALIZE, headers=ACCEPT)
    assert refused.status_code == 200 and "cannot connect" in refused.json()["error"]["message"]


async def test_delete_and_the_get_stream_on_a_dead_server(start_proxy: Start) -> None:
    fake = FakeMcp()
    async with serve_fake_mcp(fake):
        url = await start(start_proxy, fake)
        async with connect(url) as (_, session_id):
            headers = session_headers(session_id())
            await fake.stop()
            async with httpx.AsyncClient(timeout=10) as http:
                stream = await http.get(url, headers={**headers, "Accept": "text/event-stream"})
                ended = await http.delete(url, headers=headers)
            # The client's own DELETE on leaving is answered the same way: no error raised.
    assert stream.status_code == 405 and stream.headers["Allow"] == "POST, DELETE"
    assert "no event stream" in stream.json()["error"]["message"]
    assert ended.status_code == 200 and ended.headers["X-Proxy-Error"] == "upstream_unreachable"


async def test_an_upstream_redirect_to_its_trailing_slash_is_followed_inside(
    start_proxy: Start,
) -> None:
    """Starlette answers /mcp with a 307 to its own absolute /mcp/: the agent, at /tmcp/mcp,
    never sees it (nor the upstream's address), and the route's key goes with every hop."""
    fake = FakeMcp(path="/mcp/", api_key="route-key")
    async with serve_fake_mcp(fake) as endpoint:
        origin = str(URL(endpoint).origin())
        body = route(origin, "/tmcp", mcp={"server": "tavily"})
        body["headers"] = {"set": {"Authorization": "Bearer route-key"}}
        proxy = await start_proxy({"routes": {"tmcp": body}})
        url = str(proxy.make_url("/tmcp/mcp"))  # no slash
        async with httpx.AsyncClient(timeout=10) as http:
            raw = await http.post(url, json=INITIALIZE, headers=ACCEPT, follow_redirects=False)
        assert raw.status_code == 200 and "Location" not in raw.headers
        async with connect(url) as (session, _):
            assert results_of(await session.call_tool("tavily_search", {"query": "slash"}))
    assert fake.calls[0].authorization == "Bearer route-key"


async def test_a_plain_routes_cache_never_replays_a_session(start_proxy: Start) -> None:
    """A route without an mcp: section caching POSTs: two agents of one key get a session each,
    and the second one's calls work."""
    fake = FakeMcp()
    async with serve_fake_mcp(fake) as endpoint:
        cache = {"ttl": "10m", "methods": ["GET", "POST"]}
        raw = {"routes": {"plain": route(str(URL(endpoint).origin()), "/plain", cache=cache)}}
        proxy = await start_proxy(raw)
        url = str(proxy.make_url("/plain/mcp"))
        async with connect(url, "one-key") as (first, first_id):
            async with connect(url, "one-key") as (second, second_id):
                assert first_id() != second_id()
                for agent in (first, second):
                    found = await agent.call_tool("tavily_search", {"query": "same"})
                    assert results_of(found)
    assert fake.initializes == 2 and len(fake.calls) == 2


@pytest.mark.parametrize("strip", [True, False])
async def test_a_redirect_a_plain_route_passes_on_points_at_the_route(
    aiohttp_server: Any, start_proxy: Start, strip: bool
) -> None:
    from aiohttp import web

    async def moved(request: web.Request) -> web.Response:
        target = request.url.with_path(request.path + "/").with_query("page=2")
        return web.Response(status=302, headers={"Location": str(target)})

    async def elsewhere(request: web.Request) -> web.Response:
        return web.Response(status=302, headers={"Location": "https://cdn.example/x"})

    app = web.Application()
    app.router.add_get("/api/{tail:.*}/old", moved)
    app.router.add_get("/api/{tail:.*}/away", elsewhere)
    upstream = await aiohttp_server(app)
    base = str(upstream.make_url("/api")).rstrip("/")
    raw = {"routes": {"r": route(base, "/r", strip_prefix=strip)}}
    proxy = await start_proxy(raw)
    answer = await proxy.get("/r/x/old", allow_redirects=False)
    assert answer.status == 302
    assert answer.headers["Location"] == "/r/x/old/?page=2"
    away = await proxy.get("/r/x/away", allow_redirects=False)
    assert away.headers["Location"] == "https://cdn.example/x"  # another host: as it was


async def test_an_oauth_client_is_told_the_proxy_takes_a_static_token(
    start_proxy: Start,
) -> None:
    """Where an OAuth-capable MCP client looks after a 401: no path the proxy answers sends
    it to the upstream's own metadata, and each says what to send instead."""
    fake = FakeMcp(api_key="vendor-key")
    async with serve_fake_mcp(fake) as endpoint:
        url = await start(start_proxy, fake)
        async with httpx.AsyncClient(timeout=10) as http:
            refused = await http.post(url, json=INITIALIZE, headers=ACCEPT)
            assert refused.status_code == 401
            challenge = refused.headers["WWW-Authenticate"]
            assert "static bearer token" in challenge
            assert str(URL(endpoint).origin()) not in challenge  # not the server's metadata
            origin = URL(url).origin()
            for path in (
                "/.well-known/oauth-protected-resource/tmcp/mcp",
                "/.well-known/oauth-protected-resource",
                "/.well-known/oauth-authorization-server",
                "/.well-known/openid-configuration",
            ):
                found = await http.get(str(origin.with_path(path)))
                assert found.status_code == 404, path
                assert found.json()["error"] == "invalid_request"
            registered = await http.post(str(origin.with_path("/register")), json={})
    assert registered.status_code == 400
    error = registered.json()
    assert error["error"] == "invalid_request"
    assert "static bearer token" in error["error_description"]
    assert "Authorization: Bearer <token>" in error["error_description"]

"""The pure parts of MCP routes (policies/mcp/): SSE framing, what a tool call's final
response means, the errors the proxy answers in JSON-RPC, who owns a session (in-process and
shared through a real redis-server), and the `mcp:` config section."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from multidict import CIMultiDict

from policies.core.clock import ManualClock
from policies.core.errors import UpstreamUnreachable
from policies.core.flow import Flow, Reply
from policies.core.outcome import Outcome
from policies.core.redislink import RedisLink
from policies.mcp import (
    KNOWN_SERVERS,
    McpConfig,
    SessionOwners,
    SseParser,
    assess,
    encode,
    rpc_error,
    sse_event,
    tool_error,
)
from policies.mcp.lifecycle import HANDSHAKE_S, SessionLifecycle
from policies.mcp.offline import OfflineSessions, noting
from policies.mcp.sessions import Recent
from proxy.config import ConfigErrors, parse_config

TAVILY = McpConfig(
    idempotent_tools=frozenset(KNOWN_SERVERS["tavily"].idempotent_tools),
    search_tools=KNOWN_SERVERS["tavily"].search_tools,
)


def result(text: str, *, is_error: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"content": [{"type": "text", "text": text}]}
    if is_error:
        body["isError"] = True
    return {"jsonrpc": "2.0", "id": 1, "result": body}


def test_sse_parser_splits_events_across_chunks_and_line_endings() -> None:
    parser = SseParser()
    stream = (
        b'event: message\r\ndata: {"a":\r\ndata: 1}\r\n\r\n: comment\n\nid: 7\ndata: {"b":2}\n\n'
    )
    events: list[bytes] = []
    for i in range(0, len(stream), 5):  # 5-byte chunks cut events, lines and CRLFs apart
        events += parser.feed(stream[i : i + 5])
    assert events == [b'{"a":\n1}', b'{"b":2}']  # the comment block carries no data


def test_sse_event_round_trips_through_the_parser() -> None:
    message = {"jsonrpc": "2.0", "id": "x", "result": {"text": "line one\nline two"}}
    data = encode(message)
    assert b"\n" not in data  # one data line, whatever the text holds
    assert SseParser().feed(sse_event(data)) == [data]


@pytest.mark.parametrize(
    ("message", "outcome"),
    [
        (result(json.dumps({"results": [{"url": "https://a"}]})), Outcome.OK),
        (result(json.dumps({"query": "q", "results": []})), Outcome.EMPTY),
        (result("plain text, not JSON"), Outcome.OK),
        (result("Search temporarily unavailable", is_error=True), Outcome.SERVER_ERROR),
        (result("Invalid argument: max_results", is_error=True), Outcome.CLIENT_ERROR),
        (
            {"jsonrpc": "2.0", "id": 1, "error": {"code": -32603, "message": "x"}},
            Outcome.SERVER_ERROR,
        ),
        (
            {"jsonrpc": "2.0", "id": 1, "error": {"code": -32602, "message": "x"}},
            Outcome.CLIENT_ERROR,
        ),
        ({"jsonrpc": "2.0", "id": 1, "result": "not an object"}, Outcome.MALFORMED),
    ],
)
def test_assess_reads_the_tool_result(message: dict[str, Any], outcome: Outcome) -> None:
    assert assess(TAVILY, "tavily_search", message) is outcome


def test_empty_results_count_only_for_search_tools() -> None:
    empty = result(json.dumps({"results": []}))
    assert assess(TAVILY, "tavily_search", empty) is Outcome.EMPTY
    assert assess(TAVILY, "tavily_extract", empty) is Outcome.OK  # nothing to simplify there


def test_structured_content_empty_results_are_empty() -> None:
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "result": {"content": [], "structuredContent": {"results": []}},
    }
    assert assess(TAVILY, "tavily_search", message) is Outcome.EMPTY


def test_proxy_failures_carry_the_callers_id_and_message() -> None:
    err = UpstreamUnreachable("tmcp: cannot connect; try again shortly", route="tmcp", attempts=3)
    err.retry_after_s = 2.0
    tool = tool_error(41, err)
    assert tool["id"] == 41
    assert tool["result"]["isError"] is True
    assert tool["result"]["content"][0]["text"] == err.message
    assert tool["result"]["_meta"]["search-proxy/error"] == {
        "type": "upstream_unreachable",
        "attempts": 3,
        "retry_after_s": 2.0,
    }
    rpc = rpc_error("abc", err)
    assert rpc["id"] == "abc" and rpc["error"]["message"] == err.message
    assert rpc["error"]["data"]["type"] == "upstream_unreachable"


def _route(**mcp: Any) -> dict[str, Any]:
    return {"routes": {"m": {"prefix": "/m", "upstream": "http://127.0.0.1:9", "mcp": mcp}}}


def test_config_preset_and_overrides() -> None:
    cfg = parse_config(_route(server="tavily"), {}).routes["m"].section("mcp")
    assert cfg is not None
    assert "tavily_search" in cfg.idempotent_tools and dict(cfg.search_tools) == {
        "tavily_search": "query"
    }
    cfg = (
        parse_config(_route(server="tavily", idempotent_tools=["tavily_search"]), {})
        .routes["m"]
        .section("mcp")
    )
    assert cfg is not None and cfg.idempotent_tools == frozenset({"tavily_search"})
    cfg = (
        parse_config(_route(transient_tool_errors=["Backend DOWN"]), {}).routes["m"].section("mcp")
    )
    assert cfg is not None and cfg.transient_tool_errors == ("backend down",)
    assert cfg.idempotent_tools == frozenset()  # no preset: nothing goes through the policies
    assert (cfg.max_sessions, cfg.session_idle, cfg.offline_sessions) == (10_000, 86_400, True)
    given = {"max_sessions": 50, "session_idle": "30m", "offline_sessions": False}
    cfg = parse_config(_route(**given), {}).routes["m"].section("mcp")
    assert cfg is not None and (cfg.max_sessions, cfg.session_idle) == (50, 1800)
    assert cfg.offline_sessions is False


@pytest.mark.parametrize(
    ("mcp", "path", "words"),
    [
        ({"server": "bing"}, "routes.m.mcp.server", "expected one of tavily"),
        ({"idempotent_tools": ["bad tool"]}, "routes.m.mcp.idempotent_tools[0]", "tool name"),
        ({"transient_errors": "-32603"}, "routes.m.mcp.transient_errors", "list of JSON-RPC"),
        ({"transient_errors": [1.5]}, "routes.m.mcp.transient_errors[0]", ""),
        ({"search_tools": {"s": "query"}}, "routes.m.mcp.search_tools.s", "idempotent_tools"),
        ({"cache_initialize": True}, "routes.m.mcp.cache_initialize", "unknown key"),
        ({"max_sessions": 0}, "routes.m.mcp.max_sessions", "from 1 to 10000000"),
        ({"session_idle": "0s"}, "routes.m.mcp.session_idle", "above 0"),
        ({"offline_sessions": "yes"}, "routes.m.mcp.offline_sessions", "true or false"),
    ],
)
def test_config_errors_name_the_yaml_path(mcp: dict[str, Any], path: str, words: str) -> None:
    with pytest.raises(ConfigErrors) as caught:
        parse_config(_route(**mcp), {})
    text = str(caught.value)
    assert path in text and words in text


@pytest.mark.parametrize("section", ["search", "fallback", "hedge"])
def test_config_refuses_request_level_sections_on_an_mcp_route(section: str) -> None:
    raw = _route(server="tavily")
    raw["routes"]["m"][section] = {
        "search": {"vendor": "tavily"},
        "fallback": {"providers": ["m"]},
        "hedge": {"after": "1s"},
    }[section]
    with pytest.raises(ConfigErrors) as caught:
        parse_config(raw, {})
    assert f"routes.m.{section}: not available on an MCP route" in str(caught.value)


# --- who owns a session ------------------------------------------------------------------------


def test_recent_forgets_the_idle_and_the_least_recently_used() -> None:
    clock = ManualClock()
    recent: Recent[str] = Recent(2, 10.0, clock)
    recent.put("a", "1")
    recent.put("b", "2")
    clock.advance(6)
    assert recent.get("a") == "1"  # used again: its idle time starts over
    clock.advance(6)
    assert recent.get("b") is None and recent.get("a") == "1"  # b idled 12 s
    recent.put("c", "3")
    recent.put("d", "4")  # full: a, the least recently used, goes
    assert recent.get("a") is None and len(recent) == 2


async def test_a_session_is_its_openers_and_an_unknown_one_its_first_users() -> None:
    clock = ManualClock()
    owners = SessionOwners("m", 100, 60.0, clock)
    await owners.bind("s-1", "alice")
    assert await owners.allows("s-1", "alice")
    assert not await owners.allows("s-1", "bob") and not await owners.allows("s-1", "")
    assert await owners.allows("s-2", "bob") and not await owners.allows("s-2", "alice")
    await owners.forget("s-1")
    assert await owners.allows("s-1", "bob")  # ended, then unknown: bob's now
    clock.advance(61)
    assert await owners.allows("s-2", "alice")  # idled out, then unknown again
    assert "alice" not in repr(owners.local._items) and "s-1" not in repr(owners.local._items)


async def test_replicas_share_the_owner_of_a_session_through_redis(
    links: tuple[RedisLink, RedisLink],
) -> None:
    clock = ManualClock()
    a, b = (SessionOwners("m", 100, 60.0, clock, link) for link in links)
    await a.bind("s-1", "alice")
    assert not await b.allows("s-1", "bob")  # opened on a, refused on b
    assert await b.allows("s-1", "alice")
    assert await b.allows("s-2", "bob")  # unknown everywhere: bound on b to bob ...
    assert not await a.allows("s-2", "alice")  # ... and a knows it
    await a.forget("s-2")
    raw = links[0].client
    stored = [k async for k in raw.scan_iter("test:mcp-session:*")]
    assert len(stored) == 1 and b"s-1" not in stored[0]  # digests only
    assert 0 < await raw.ttl(stored[0]) <= 60
    assert b"alice" not in (await raw.get(stored[0]) or b"")


async def test_owners_work_on_without_redis() -> None:
    link = RedisLink("redis://127.0.0.1:1", "test", timeout=0.05)
    owners = SessionOwners("m", 100, 60.0, ManualClock(), link)
    await owners.bind("s-1", "alice")
    assert await owners.allows("s-1", "alice") and not await owners.allows("s-1", "bob")
    await link.close()


# --- what the route remembers of its server ------------------------------------------------


async def test_noting_keeps_the_result_of_a_json_or_streamed_answer() -> None:
    kept: list[dict[str, Any]] = []
    answer = encode({"jsonrpc": "2.0", "id": 7, "result": {"tools": []}})
    json_reply = Reply(200, CIMultiDict({"Content-Type": "application/json"}), answer)
    assert noting(json_reply, 7, kept.append) is json_reply and kept == [{"tools": []}]

    async def chunks() -> AsyncIterator[bytes]:
        progress = encode({"jsonrpc": "2.0", "method": "notifications/progress"})
        for part in (sse_event(progress), sse_event(answer)[:9], sse_event(answer)[9:]):
            yield part

    streamed = noting(Reply(200, CIMultiDict(), stream=chunks()), 7, kept.append)
    assert streamed.stream is not None
    passed = b"".join([chunk async for chunk in streamed.stream])
    assert passed.endswith(sse_event(answer)) and kept == [{"tools": []}] * 2
    noting(Reply(200, CIMultiDict(), answer), 8, kept.append)  # another request's
    noting(Reply(503, CIMultiDict(), answer), 7, kept.append)
    assert len(kept) == 2


def test_a_session_opened_offline_keeps_a_bounded_part_of_the_agents_params() -> None:
    async def never(flow: Any) -> Reply:
        raise AssertionError("no upstream call")

    sessions = OfflineSessions("m", never, 10, 60.0, ManualClock())
    params = {
        "protocolVersion": "2025-06-18",
        "capabilities": {"roots": {}},
        "clientInfo": {"name": "agent", "version": "1"},
        "extra": "x" * 100_000,
    }
    opened = sessions.get(sessions.open(params))
    assert opened is not None and opened.params == {k: params[k] for k in list(params)[:3]}
    huge = {**params, "clientInfo": {"name": "y" * 100_000, "version": "1"}}
    opened = sessions.get(sessions.open(huge))
    assert opened is not None and len(encode(opened.params)) < 200
    assert opened.params["protocolVersion"] == "2025-06-18"
    assert sessions.get("not-ours") is None


async def test_the_handshake_keeps_under_the_clients_own_timeout() -> None:
    """initialize may take a route's timeouts.total (300 s shipped): not while a client waits
    60 s for it."""
    clock = ManualClock()
    seen: list[float] = []

    async def session(flow: Flow) -> Reply:
        seen.append(flow.context.deadline)
        return Reply(202, CIMultiDict())

    offline = OfflineSessions("m", session, 10, 60.0, clock)
    owners = SessionOwners("m", 10, 60.0, clock)
    life = SessionLifecycle("m", owners, offline, session, session, stand_in=True)
    for total in (300.0, 5.0):
        flow = Flow.new(
            route="m",
            method="POST",
            path="/mcp",
            query_string="",
            headers=CIMultiDict(),
            body=b"{}",
            request_id="r",
            client="",
            deadline=clock.now() + total,
            started=clock.now(),
        )
        await life.handshake(flow)
    assert seen == [clock.now() + HANDSHAKE_S, clock.now() + 5.0]

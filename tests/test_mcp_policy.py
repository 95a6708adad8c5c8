"""The pure parts of MCP routes (policies/mcp.py): SSE framing, what a tool call's final
response means, the errors the proxy answers in JSON-RPC, and the `mcp:` config section."""

from __future__ import annotations

import json
from typing import Any

import pytest

from policies.core.errors import UpstreamUnreachable
from policies.core.outcome import Outcome
from policies.mcp import (
    KNOWN_SERVERS,
    McpConfig,
    SseParser,
    assess,
    encode,
    rpc_error,
    sse_event,
    tool_error,
)
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


@pytest.mark.parametrize(
    ("mcp", "path", "words"),
    [
        ({"server": "bing"}, "routes.m.mcp.server", "expected one of tavily"),
        ({"idempotent_tools": ["bad tool"]}, "routes.m.mcp.idempotent_tools[0]", "tool name"),
        ({"transient_errors": "-32603"}, "routes.m.mcp.transient_errors", "list of JSON-RPC"),
        ({"transient_errors": [1.5]}, "routes.m.mcp.transient_errors[0]", ""),
        ({"search_tools": {"s": "query"}}, "routes.m.mcp.search_tools.s", "idempotent_tools"),
        ({"cache_initialize": True}, "routes.m.mcp.cache_initialize", "unknown key"),
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

"""Agents on the official TypeScript MCP SDK (testkit/mcpts.mjs, a node process of its own)
through an MCP route and the proxy's own /mcp: what IDE and Node agents meet. `make test`
installs the SDK into .venv/node_modules."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import structlog
from yarl import URL

from testkit.fakemcp import FakeMcp, serve_fake_mcp
from testkit.fakevendor import FakeVendor
from testkit.waiting import eventually
from tests.conftest import route
from tests.test_mcp_calls import hanging
from tests.test_mcp_server import served_as_in_production

ROOT = Path(__file__).resolve().parent.parent
MODULES = ROOT / ".venv" / "node_modules"
SDK = MODULES / "@modelcontextprotocol" / "sdk"


class TsAgent:
    """testkit/mcpts.mjs as a child process: `send` a command, get its answer."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            answer = json.loads(line)
            waiting = self._waiting.pop(answer["id"], None)
            if waiting is not None and not waiting.done():
                waiting.set_result(answer)

    def start(self, op: str, **fields: Any) -> asyncio.Future[dict[str, Any]]:
        """Send a command; its answer, when it is done."""
        assert self.process.stdin is not None
        command_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._waiting[command_id] = answer
        line = json.dumps({"id": command_id, "op": op, **fields}) + "\n"
        self.process.stdin.write(line.encode())
        return answer

    async def send(self, op: str, **fields: Any) -> dict[str, Any]:
        return await asyncio.wait_for(self.start(op, **fields), 20)


@contextlib.asynccontextmanager
async def ts_agent() -> AsyncIterator[TsAgent]:
    assert (SDK / "package.json").is_file(), (
        f"the TypeScript MCP SDK is not in {MODULES}: run `make test` (it installs it)"
    )
    process = await asyncio.create_subprocess_exec(
        "node",
        str(ROOT / "testkit" / "mcpts.mjs"),
        env={**os.environ, "MCP_TS_MODULES": str(MODULES)},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    agent = TsAgent(process)
    try:
        assert (await agent.send("version"))["version"].startswith("1.")
        yield agent
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 10)
        finally:
            if process.returncode is None:
                process.kill()
            agent._reader.cancel()


def mcp_route(endpoint: str, **extra: Any) -> dict[str, Any]:
    body = route(str(URL(endpoint).origin()), "/tmcp", mcp={"server": "tavily"}, **extra)
    body["timeouts"] = {"connect": "1s", "per_try": "2s", "idle": "5s", "total": "10s"}
    return {"routes": {"tmcp": body}}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_ts_agent_through_an_mcp_route_with_a_blip_and_a_slash_redirect(
    start_proxy: Any,
) -> None:
    """The server wants /mcp/ (a 307 from /mcp) and fails the first initialize: the agent,
    at /tmcp/mcp, connects, lists and calls."""
    fake = FakeMcp(path="/mcp/", fail_initialize=1)
    async with serve_fake_mcp(fake) as endpoint, ts_agent() as ts:
        proxy = await start_proxy(mcp_route(endpoint, retry={"attempts": 2}))
        url = str(proxy.make_url("/tmcp/mcp"))
        connected = await ts.send("connect", name="a", url=url, headers=auth("alice"))
        assert connected["ok"], connected
        assert (await ts.send("list", name="a"))["tools"] == ["tavily_extract", "tavily_search"]
        found = await ts.send(
            "call", name="a", tool="tavily_search", arguments={"query": "typescript"}
        )
        assert found["ok"] and not found["isError"]
        assert json.loads(found["text"])["results"]
    # The refused one, then one at /mcp (redirected, inside the proxy) and one at /mcp/.
    assert fake.initializes == 3 and fake.session_ids


async def test_a_ts_agent_cannot_use_or_end_another_agents_session(start_proxy: Any) -> None:
    fake = FakeMcp()
    async with serve_fake_mcp(fake) as endpoint, ts_agent() as ts:
        proxy = await start_proxy(mcp_route(endpoint))
        url = str(proxy.make_url("/tmcp/mcp"))
        alice = await ts.send("connect", name="alice", url=url, headers=auth("alice"))
        await eventually(lambda: fake.gets == 1)
        joined = await ts.send(
            "connect", name="bob", url=url, headers=auth("bob"), sessionId=alice["sessionId"]
        )
        assert joined["ok"]  # no request yet: joining sends nothing
        used = await ts.send("list", name="bob")
        ended = await ts.send("terminate", name="bob")
        for refused in (used, ended):
            assert not refused["ok"] and refused["code"] == 404, refused
        assert "belongs to the credentials" in used["error"]
        assert fake.deletes == 0
        assert (await ts.send("list", name="alice"))["ok"]
        assert (await ts.send("terminate", name="alice"))["ok"]
        assert fake.deletes == 1


async def test_two_ts_agents_of_one_key_through_a_cached_plain_route(start_proxy: Any) -> None:
    """No mcp: section, a cache on POST: each agent gets a session of its own, and works."""
    fake = FakeMcp()
    async with serve_fake_mcp(fake) as endpoint, ts_agent() as ts:
        cache = {"ttl": "10m", "methods": ["GET", "POST"]}
        plain = route(str(URL(endpoint).origin()), "/plain", cache=cache)
        proxy = await start_proxy({"routes": {"plain": plain}})
        url = str(proxy.make_url("/plain/mcp"))
        opened = [
            await ts.send("connect", name=name, url=url, headers=auth("one-key"))
            for name in ("a", "b")
        ]
        assert opened[0]["sessionId"] != opened[1]["sessionId"]
        for name in ("a", "b"):
            found = await ts.send("call", name=name, tool="tavily_search", arguments={"query": "q"})
            assert found["ok"] and not found["isError"], found
    assert fake.initializes == 2


async def test_a_ts_agent_ends_its_session_on_a_dead_server_without_an_error(
    start_proxy: Any,
) -> None:
    fake = FakeMcp()
    async with serve_fake_mcp(fake) as endpoint, ts_agent() as ts:
        proxy = await start_proxy(mcp_route(endpoint))
        url = str(proxy.make_url("/tmcp/mcp"))
        assert (await ts.send("connect", name="a", url=url))["ok"]
        await eventually(lambda: fake.gets == 1)  # its GET stream is open
        with structlog.testing.capture_logs() as logs:
            await fake.stop()
            # The stream is cut; the SDK opens it again (after its 1 s delay) and takes the
            # 405 as "no stream offered", rather than a failure to retry until it gives up.
            await eventually(
                lambda: any(e.get("method") == "GET" and e.get("status") == 405 for e in logs), 5
            )
        terminated = await ts.send("terminate", name="a")
        assert terminated["ok"], terminated
        errors = (await ts.send("errors", name="a"))["errors"]
    assert len(errors) == 1 and "SSE stream disconnected" in errors[0]  # the cut, only


async def test_a_ts_agent_with_an_oauth_provider_is_told_to_send_a_static_token(
    start_proxy: Any,
) -> None:
    fake = FakeMcp(api_key="vendor-key")
    async with serve_fake_mcp(fake) as endpoint, ts_agent() as ts:
        proxy = await start_proxy(mcp_route(endpoint))
        refused = await ts.send("oauth", url=str(proxy.make_url("/tmcp/mcp")))
    assert not refused["ok"]
    assert "static bearer token" in refused["error"], refused
    assert "Invalid OAuth error response" not in refused["error"]


async def test_a_ts_agent_that_gives_up_or_leaves_stops_the_vendor_calls_of_mcp(
    vendor: FakeVendor,
) -> None:
    """The SDK's own request timeout sends notifications/cancelled (on a POST of its own), and
    close() aborts the request: each stops the web_search and its vendor attempt."""
    async with served_as_in_production(hanging(vendor)) as base, ts_agent() as ts:
        assert (await ts.send("connect", name="a", url=f"{base}/mcp"))["ok"]
        timed_out = await ts.send(
            "call", name="a", tool="web_search", arguments={"query": "slow"}, timeout=300
        )
        assert not timed_out["ok"] and timed_out["code"] == -32001  # the SDK's RequestTimeout
        await eventually(lambda: vendor.pauses and vendor.pauses[0].ended == "cancelled")
        pending = ts.start("call", name="a", tool="web_search", arguments={"query": "again"})
        await eventually(lambda: vendor.count() == 2)
        closed = await ts.send("close", name="a")
        assert closed["ok"] and not (await pending)["ok"]
        await eventually(lambda: vendor.pauses[1].ended == "cancelled", within=3)
    assert vendor.count() == 2  # one vendor call each: none after the agent gave up


def mcp_doc_section(title: str) -> str:
    text = (ROOT / "docs" / "mcp.md").read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


async def test_the_documented_typescript_example_runs_as_written(
    start_proxy: Any, tmp_path: Path
) -> None:
    """docs/mcp.md's "Connecting MCP clients", its TypeScript block run by node against a route
    named as the shipped one, the agent's own key passing through; its other blocks parse."""
    section = mcp_doc_section("Connecting MCP clients")
    code = section.split("```ts\n", 1)[1].split("```", 1)[0]
    fake = FakeMcp(path="/mcp/", api_key="tvly-docs-key")
    async with serve_fake_mcp(fake) as endpoint:
        body = route(str(URL(endpoint).origin()), "/tavily-mcp", mcp={"server": "tavily"})
        proxy = await start_proxy({"routes": {"tavily-mcp": body}})
        base = str(proxy.make_url("")).rstrip("/")
        script = tmp_path / "example.mjs"
        script.write_text(code.replace("http://localhost:8080", base), encoding="utf-8")
        (tmp_path / "node_modules").symlink_to(MODULES)  # where the example's imports resolve
        node = await asyncio.create_subprocess_exec(
            "node",
            str(script),
            env={**os.environ, "TAVILY_API_KEY": "tvly-docs-key"},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(node.communicate(), 30)
    assert node.returncode == 0, err.decode()[-2000:]
    assert json.loads(out)["results"] and fake.calls[0].authorization == "Bearer tvly-docs-key"
    config = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    assert config["mcpServers"]["tavily"]["url"] == "http://localhost:8080/tavily-mcp/mcp/"
    inspector = section.split("```shell\n", 1)[1].split("```", 1)[0]
    assert "--server-url http://localhost:8080/tavily-mcp/mcp/" in inspector
    assert '--header "Authorization: Bearer' in inspector

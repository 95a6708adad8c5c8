"""An agent on the mcp SDK's 2.x line (its own process: the project pins mcp<2) through an MCP
route, against the FastMCP server of 1.x: what agents upgrading their SDK meet."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from yarl import URL

from testkit.fakemcp import FakeMcp, serve_fake_mcp
from testkit.fakevendor import FakeVendor
from testkit.procs import free_port
from tests.conftest import route

ROOT = Path(__file__).resolve().parent.parent
MCP2 = ROOT / ".venv" / "mcp2"  # `make test` installs mcp 2.x here


async def run_agent(url: str, *args: str) -> dict[str, Any]:
    assert (MCP2 / "mcp").is_dir(), f"mcp 2.x is not in {MCP2}: run `make test` (it installs it)"
    env = {**os.environ, "PYTHONPATH": str(MCP2)}
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "testkit" / "mcp2client.py"),
        url,
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(agent.communicate(), 60)
    assert agent.returncode == 0, err.decode()[-2000:]
    found: dict[str, Any] = json.loads(out)
    return found


async def test_an_mcp2_agent_through_an_mcp_route(start_proxy: Any) -> None:
    fake = FakeMcp(progress_gaps=[0.05, 0.05], empty_over_words=3, fail_rate=0.3, fail_mode="mixed")
    async with serve_fake_mcp(fake) as endpoint:
        retry = {
            "attempts": 4,
            "backoff": {"initial": "10ms", "max": "50ms"},
            "budget": {"ratio": 1.0, "min_per_s": 50},
        }
        raw = {
            "routes": {
                "tmcp": route(
                    str(URL(endpoint).origin()),
                    "/tmcp",
                    retry=retry,
                    cache={"ttl": "60s"},
                    mcp={"server": "tavily"},
                    timeouts={"connect": "1s", "per_try": "2s", "idle": "5s", "total": "15s"},
                )
            }
        }
        proxy = await start_proxy(raw)
        seen = await run_agent(str(proxy.make_url("/tmcp/mcp")))
    assert seen["version"].startswith("2.")
    assert seen["tools"] == ["tavily_extract", "tavily_search"]
    assert not seen["one"]["is_error"] and seen["one"]["progress"] == 2  # relayed live
    assert json.loads(seen["one"]["text"])["results"]
    for i, answer in enumerate(seen["many"]):  # 30% fail upstream; every one answered
        assert not answer["is_error"], answer
        assert json.loads(answer["text"])["query"] == f"topic {i}"
    assert fake.failures > 0
    long = json.loads(seen["long"]["text"])
    assert long["results"] and len(long["query"].split()) <= 3  # simplified


async def test_an_mcp2_agent_on_the_proxys_own_web_search(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    """/mcp's web_search from the 2.x client, the first provider down: the next one answers."""
    vendor.empty_when_words_over(3)
    down = f"http://127.0.0.1:{free_port()}"
    raw = {
        "routes": {
            "tavily": route(down, "/tavily", search={"vendor": "tavily"}),
            "brave": route(f"{vendor.url}/brave", "/brave", search={"vendor": "brave"}),
        },
        "search_api": {"providers": ["tavily", "brave"]},
    }
    proxy = await start_proxy(raw)
    seen = await run_agent(str(proxy.make_url("/mcp")), "--tool", "web_search")
    assert seen["version"].startswith("2.") and seen["tools"] == ["fetch_page", "web_search"]
    answers = [seen["one"], *seen["many"], seen["long"]]
    assert all(not a["is_error"] and a["structured"]["results"] for a in answers), answers
    assert all(r["provider"] == "brave" for a in answers for r in a["structured"]["results"])
    assert "brave" in seen["one"]["text"] and "tavily" in seen["one"]["text"]

"""An agent on the mcp SDK's 2.x line (``mcp.Client``), run as its own process with 2.x on its
path (``make test`` installs it into .venv/mcp2; the project itself pins mcp<2):

    PYTHONPATH=.venv/mcp2 python testkit/mcp2client.py URL [--tool web_search]

It lists the tools, makes one call of the tool (tavily_search by default) with a progress
callback, ten in parallel and one with a long query, and prints what it saw as one JSON
object. Only the standard library and the mcp 2.x package are imported.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import time
from typing import Any

from mcp import Client


def _seen(result: Any) -> dict[str, Any]:
    first = result.content[0] if result.content else None
    return {
        "is_error": result.is_error,
        "text": getattr(first, "text", ""),
        "structured": result.structured_content,
    }


async def run(url: str, tool: str) -> dict[str, Any]:
    progress: list[float] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(time.monotonic())

    async with Client(url, read_timeout_seconds=20) as client:
        tools = await client.list_tools()
        one = await client.call_tool(
            tool, {"query": "python asyncio"}, progress_callback=on_progress
        )
        many = await asyncio.gather(
            *(client.call_tool(tool, {"query": f"topic {i}"}) for i in range(10))
        )
        long = await client.call_tool(
            tool, {"query": "what is the newest stable python asyncio release"}
        )
    return {
        "version": importlib.metadata.version("mcp"),
        "tools": sorted(t.name for t in tools.tools),
        "one": {**_seen(one), "progress": len(progress)},
        "many": [_seen(r) for r in many],
        "long": _seen(long),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--tool", default="tavily_search")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.url, args.tool))))


if __name__ == "__main__":
    main()

"""The repo's config.yaml as a user runs it, with only the vendors' origins swapped for the fake
vendor: an agent's burst of parallel tool calls gets answers, not refusals."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tavily

from proxy.app import build_app
from proxy.config import Config, load_config
from testkit.fakevendor import FakeVendor

SHIPPED = Path(__file__).resolve().parent.parent / "config.yaml"


def shipped_config(vendor_url: str, env: Mapping[str, str] | None = None) -> Config:
    """config.yaml with every route's upstream pointed at the fake vendor, nothing else changed;
    ``env`` is the environment its ``${VAR}``s read (empty unless given: no vendor keys)."""
    config = load_config(SHIPPED, env=dict(env or {}))
    routes = {
        name: dataclasses.replace(
            r, upstream=f"{vendor_url}/{r.section('search').vendor if r.has('search') else name}"
        )
        for name, r in config.routes.items()
    }
    return dataclasses.replace(config, routes=MappingProxyType(routes))


async def test_fifty_parallel_tavily_searches_all_get_results(
    vendor: FakeVendor, aiohttp_client: Any
) -> None:
    vendor.latency(0.3)
    client = await aiohttp_client(build_app(shipped_config(vendor.url)))
    base = str(client.make_url("/tavily"))

    async def one(i: int) -> dict[str, Any]:
        async with tavily.AsyncTavilyClient(api_key="tvly-test", api_base_url=base) as sdk:
            return await sdk.search(f"parallel tool call number {i}", max_results=2)

    answers = await asyncio.gather(*(one(i) for i in range(50)), return_exceptions=True)
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert not errors, errors[:3]
    assert all(len(a["results"]) == 2 for a in answers if isinstance(a, dict))
    assert vendor.count() == 50

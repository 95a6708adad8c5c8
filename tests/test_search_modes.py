"""`/v1/search` and `/mcp` `web_search` modes: `merge` (several providers at once, one list
deduplicated by canonical URL and ranked by reciprocal rank fusion, each result naming the
providers that found it) and `race` (two at once, the first with results answers, the loser's
call cancelled)."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import orjson
import pytest

from policies.fusion import canonical_url, fuse
from proxy.app import STATE
from testkit.fakevendor import FakeVendor, Fault, expected_urls
from testkit.waiting import eventually
from tests.conftest import route
from tests.test_search_api import _validator

PROVIDERS = ("tavily", "exa", "brave")


def config(vendor: FakeVendor, **search_api: Any) -> dict[str, Any]:
    routes = {
        name: route(
            f"{vendor.url}/{name}",
            f"/{name}",
            search={"vendor": name},
            headers={"set": {"Authorization": f"Bearer {name}-key"}},
        )
        for name in PROVIDERS
    }
    return {"routes": routes, "search_api": {"providers": list(PROVIDERS), **search_api}}


def item(url: str, text: str = "about it") -> dict[str, str]:
    return {"url": url, "title": f"Title of {url}", "content": text, "text": text}


# Each vendor's own answer, in its own shape; some pages spelt differently by each.
TAVILY = [
    "https://www.a.example/x/?utm_source=agent",
    "https://b.example/y",
    "https://c.example/z",
]
EXA = ["https://b.example/y#top", "https://d.example/w", "https://A.example/x"]
BRAVE = ["https://e.example/v", "https://B.EXAMPLE/y/?gclid=123"]


def answers(vendor: FakeVendor) -> None:
    vendor.script(Fault.status(200, {"results": [item(u) for u in TAVILY]}), path_prefix="/tavily")
    vendor.script(Fault.status(200, {"results": [item(u) for u in EXA]}), path_prefix="/exa")
    brave = {"web": {"results": [{"url": u, "title": u, "description": "d"} for u in BRAVE]}}
    vendor.script(Fault.status(200, brave), path_prefix="/brave")


async def test_merge_dedupes_by_canonical_url_ranks_by_rrf_and_names_the_providers(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(config(vendor))
    answers(vendor)
    r = await client.post("/v1/search", json={"query": "merged", "mode": "merge"})
    assert r.status == 200
    body = await r.json()
    pages = [canonical_url(x["url"]) for x in body["results"]]
    # b: ranks 2, 1, 2; a: 1 and 3; then e (a first place), d (a second), c (a third).
    assert pages == [
        "https://b.example/y",
        "https://a.example/x",
        "https://e.example/v",
        "https://d.example/w",
        "https://c.example/z",
    ]
    assert [x["providers"] for x in body["results"]] == [
        ["tavily", "exa", "brave"],
        ["tavily", "exa"],
        ["brave"],
        ["exa"],
        ["tavily"],
    ]
    assert body["providers"] == ["tavily", "exa", "brave"]
    assert body["provider"] == "tavily"
    assert [a["outcome"] for a in body["attempts"]] == ["results"] * 3
    assert vendor.count() == 3  # one call each, at once
    document = await (await client.get("/openapi.json")).json()
    _validator(document, "SearchAnswer").validate(body)


async def test_a_merge_waiting_on_its_slowest_provider_keeps_no_vendors_whole_answer(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    # Each answer's memory charge ends once it is read; what a part keeps until the slowest
    # provider answers must then be its few results, not the vendor's whole answer parsed.
    client = await start_proxy(config(vendor))
    pad = b",".join([b'{"kept_by_merge": [1]}'] * 2000)  # a list in it: the GC sees it
    for name in ("tavily", "exa"):
        found = orjson.dumps(item(f"https://{name}.example/a"))
        body = b'{"results": [' + found + b'], "pad": [' + pad + b"]}"
        vendor.script(Fault.status(200, body), path_prefix=f"/{name}")
    vendor.script(Fault.hang(5), path_prefix="/brave")
    outcomes = client.app[STATE].metrics.provider_fallbacks
    asking = asyncio.ensure_future(
        client.post("/v1/search", json={"query": "slow", "mode": "merge"})
    )
    try:
        await eventually(
            lambda: all(outcomes.labels(n, "results").value == 1 for n in ("tavily", "exa"))
        )
        kept = [o for o in gc.get_objects() if type(o) is dict and "kept_by_merge" in o]
        assert len(kept) <= 2000  # at most the last parse, which the next one replaces
    finally:
        asking.cancel()


async def test_merge_asks_up_to_merge_providers_of_those_that_can_be_asked(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    raw = config(vendor, merge_providers=2)
    raw["routes"]["tavily"]["headers"] = {"set": {"Authorization": "Bearer ${UNSET:-}"}}
    client = await start_proxy(raw, env={})
    r = await client.post("/v1/search", json={"query": "two of them", "mode": "merge"})
    body = await r.json()
    assert [(a["provider"], a["outcome"]) for a in body["attempts"]] == [
        ("tavily", "skipped"),
        ("exa", "results"),
        ("brave", "results"),
    ]
    # The same pages from both: each once, listing both.
    assert [x["url"] for x in body["results"]] == expected_urls("two of them", 3)
    assert all(x["providers"] == ["exa", "brave"] for x in body["results"])


async def test_merge_with_every_provider_failing_is_the_usual_error(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(config(vendor))
    vendor.down(503)
    r = await client.post("/v1/search", json={"query": "down", "mode": "merge"})
    assert r.status == 503 and r.headers["X-Proxy-Error"] == "all_providers_failed"


async def test_race_takes_the_first_answer_and_cancels_the_other(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(config(vendor))
    vendor.script(Fault.hang(20), path_prefix="/tavily")
    started = time.monotonic()
    r = await client.post("/v1/search", json={"query": "race", "mode": "race"})
    assert time.monotonic() - started < 1.0
    body = await r.json()
    assert body["provider"] == "exa" and [x["url"] for x in body["results"]] == expected_urls(
        "race", 3
    )
    assert [(a["provider"], a["outcome"]) for a in body["attempts"]] == [
        ("exa", "results"),
        ("tavily", "cancelled"),
    ]
    assert vendor.count("/brave") == 0  # only two race
    hung = [p for p in vendor.pauses if p.cause == "hang"]
    await eventually(lambda: [p.ended for p in hung] == ["cancelled"])
    document = await (await client.get("/openapi.json")).json()
    _validator(document, "SearchAnswer").validate(body)


async def test_race_goes_on_in_order_when_neither_racer_has_results(
    vendor: FakeVendor, start_proxy: Any
) -> None:
    client = await start_proxy(config(vendor))
    vendor.script(Fault.status(503), Fault.status(503), path_prefix="/tavily")
    vendor.script(Fault.status(503), Fault.status(503), path_prefix="/exa")
    r = await client.post("/v1/search", json={"query": "race on", "mode": "race"})
    body = await r.json()
    assert body["provider"] == "brave"
    assert sorted(a["provider"] for a in body["attempts"][:2]) == ["exa", "tavily"]


async def test_a_bad_mode_is_refused(vendor: FakeVendor, start_proxy: Any) -> None:
    client = await start_proxy(config(vendor))
    r = await client.post("/v1/search", json={"query": "q", "mode": "all"})
    assert r.status == 400
    assert "/v1/search: mode must be one of first, merge, race" in await r.text()


async def test_web_search_takes_the_mode_too(vendor: FakeVendor, start_proxy: Any) -> None:
    client = await start_proxy(config(vendor))
    answers(vendor)
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "web_search", "arguments": {"query": "merged", "mode": "merge"}},
    }
    headers = {"Accept": "application/json, text/event-stream"}
    r = await client.post("/mcp", json=call, headers=headers)
    result = (await r.json())["result"]
    assert not result["isError"]
    assert result["structuredContent"]["providers"] == ["tavily", "exa", "brave"]
    assert "Answered by tavily, exa, brave (merged)." in result["content"][0]["text"]
    listed = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/list",
        "params": {},
    }
    tools = (await (await client.post("/mcp", json=listed, headers=headers)).json())["result"]
    schema = tools["tools"][0]["inputSchema"]["properties"]["mode"]
    assert schema["enum"] == ["first", "merge", "race"]


# --- the pure parts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "page"),
    [
        (
            "HTTPS://WWW.Example.COM/a/b/?utm_source=x&b=2&a=1#frag",
            "https://example.com/a/b?a=1&b=2",
        ),
        ("http://example.com:80/", "http://example.com"),
        ("https://example.com:8443/x", "https://example.com:8443/x"),
        ("https://example.com/x?gclid=1&fbclid=2&q=search", "https://example.com/x?q=search"),
        ("not a url", "not a url"),
    ],
)
def test_canonical_urls(url: str, page: str) -> None:
    assert canonical_url(url) == page


def test_rrf_ranks_pages_several_lists_rank_high_first() -> None:
    fused = fuse(
        {"a": ["u1", "u2", "u3"], "b": ["u2", "u4"], "c": ["u1/"]},
        url_of=lambda u: f"https://example.com/{u}",
    )
    assert [(f.item, f.providers) for f in fused] == [
        ("u1", ("a", "c")),  # 1/61 + 1/61
        ("u2", ("a", "b")),  # 1/62 + 1/61
        ("u4", ("b",)),
        ("u3", ("a",)),
    ]
    assert fused[0].score == pytest.approx(2 / 61)

"""The README, followed to the letter against the shipped config.yaml (only the vendors' origins
swapped for the fake vendor): the quick start, every row of "Point your agent at it" and its agent
code, and docs/endpoints.md's /v1/search example.

The SDK table is parsed, not copied: each `Name(kw="http://localhost:8080/...")` span is built
with exactly the README's arguments (the URL pointed at the test's proxy, plus the credential the
README leaves out) and searched with; vendors whose SDK the suite does not install get the HTTP
request the README and VENDORS.md describe. A row whose prefix has no route, a constructor the
test cannot run, or a row without any check fails here.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import re
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import scavio
import tavily
from exa_py import AsyncExa, Exa
from langchain_tavily import TavilySearch
from linkup import LinkupClient

from proxy.app import build_app
from proxy.config import Config, RouteConfig
from testkit.fakevendor import FakeVendor, Received, make_results
from tests.test_shipped_config import SHIPPED, shipped_config

with warnings.catch_warnings():  # "langchain-community is being sunset": still where it lives
    warnings.simplefilter("ignore", DeprecationWarning)
    from langchain_community.utilities.brave_search import BraveSearchWrapper
    from langchain_community.utilities.jina_search import JinaSearchAPIWrapper
    from langchain_community.utilities.searx_search import SearxSearchWrapper

README = Path(__file__).resolve().parent.parent / "README.md"
ENDPOINTS = README.parent / "docs" / "endpoints.md"
PROXY = "http://localhost:8080"  # the proxy's address as the README writes it
URL = re.compile(r"http://localhost:8080[^\s\"'`)]*")
KEY = "agent-own-key"
N = 3  # results the fake vendor answers with (every call here asks for at least that many)

Hit = tuple[str, str, str]  # url, title, snippet as the SDK parsed them


# --------------------------------------------------------------------------- the README


def section(title: str) -> str:
    """The text of one `## title` section."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


@dataclass(frozen=True)
class Row:
    """One row of the SDK table."""

    vendor: str  # lower-case, as route search profiles name it
    text: str
    spans: tuple[str, ...]  # its `code spans`

    @property
    def urls(self) -> list[str]:
        return URL.findall(self.text)


@dataclass(frozen=True)
class ReadmeCall:
    """A `Name(...)` code span of the SDK table."""

    vendor: str
    name: str
    span: str
    call: ast.Call


def sdk_table() -> list[Row]:
    rows = []
    for line in section("Point your agent at it").splitlines():
        if not line.startswith("| ") or line.startswith("| vendor |"):
            continue
        vendor = line.strip("|").split(" | ")[0].strip(" *").lower()
        rows.append(Row(vendor, line, tuple(re.findall(r"`([^`]+)`", line))))
    assert rows, "README: no SDK table under 'Point your agent at it'"
    return rows


def readme_calls() -> list[ReadmeCall]:
    calls = []
    for row in sdk_table():
        for span in row.spans:
            try:
                node = ast.parse(span, mode="eval").body
            except SyntaxError:
                continue  # `prefix: /v2`, `api_base_url=`, ...
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else ast.unparse(func)
                calls.append(ReadmeCall(row.vendor, name, span, node))
    return calls


def python_block(text: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert len(blocks) == 1, f"expected one python block, found {len(blocks)}"
    return str(blocks[0])


# --------------------------------------------------------------------------- the shipped config


def route_for(config: Config, path: str) -> RouteConfig | None:
    """The route the proxy picks for a path: whole segments, longest prefix wins."""
    matching = [
        r for r in config.routes.values() if path == r.prefix or path.startswith(r.prefix + "/")
    ]
    return max(matching, key=lambda r: len(r.prefix), default=None)


def vendor_of(r: RouteConfig) -> str:
    return r.section("search").vendor if r.has("search") else r.name


async def proxy(aiohttp_client: Any, vendor: FakeVendor, env: dict[str, str] | None = None) -> Any:
    """The shipped config served on loopback, the fake vendor standing in for every vendor."""
    return await aiohttp_client(build_app(shipped_config(vendor.url, env)))


def expected(query: str) -> list[Hit]:
    return [(r.url, r.title, r.snippet) for r in make_results(query, N)]


def carries(rec: Received, key: str) -> bool:
    """The request reached the vendor with this credential (any header or `api_key`)."""
    return any(key in v for v in rec.headers.values()) or rec.query.get("api_key") == key


# --------------------------------------------------------------------------- installed SDKs
# Each takes the client the README's span built and a query, searches as an agent would and
# returns what the SDK parsed (sync ones run in a thread, async ones on the test's loop).


def _tavily(client: tavily.TavilyClient, q: str) -> list[Hit]:
    with client:
        answer = client.search(q)
    return [(r["url"], r["title"], r["content"]) for r in answer["results"]]


async def _tavily_async(client: tavily.AsyncTavilyClient, q: str) -> list[Hit]:
    async with client:
        answer = await client.search(q)
    return [(r["url"], r["title"], r["content"]) for r in answer["results"]]


def _tavily_tool(tool: TavilySearch, q: str) -> list[Hit]:
    answer = tool.invoke({"query": q})
    return [(r["url"], r["title"], r["content"]) for r in answer["results"]]


def _exa(client: Exa, q: str) -> list[Hit]:
    return [(r.url, r.title, r.text) for r in client.search(q).results]


async def _exa_async(client: AsyncExa, q: str) -> list[Hit]:
    async with client:
        answer = await client.search(q)
    return [(r.url, r.title, r.text) for r in answer.results]


def _langchain_json(wrapper: BraveSearchWrapper | JinaSearchAPIWrapper, q: str) -> list[Hit]:
    return [(r["link"], r["title"], r["snippet"]) for r in json.loads(wrapper.run(q))]


def _scavio(client: scavio.ScavioClient, q: str) -> list[Hit]:
    with client:
        answer = client.search(q)
    return [(r["link"], r["title"], r["snippet"]) for r in answer["organic_results"]]


def _linkup(client: LinkupClient, q: str) -> list[Hit]:
    answer = client.search(q, depth="standard", output_type="searchResults")
    return [(r.url, r.name, r.content) for r in answer.results]


def _searx(wrapper: SearxSearchWrapper, q: str) -> list[Hit]:
    return [(r["link"], r["title"], r["snippet"]) for r in wrapper.results(q, num_results=N)]


@dataclass(frozen=True)
class Sdk:
    make: Callable[..., Any]
    key: str | None  # the credential keyword the README leaves out; None: the SDK takes none
    search: Callable[[Any, str], Any]


SDKS: dict[str, Sdk] = {
    "TavilyClient": Sdk(tavily.TavilyClient, "api_key", _tavily),
    "AsyncTavilyClient": Sdk(tavily.AsyncTavilyClient, "api_key", _tavily_async),
    "TavilySearch": Sdk(TavilySearch, "tavily_api_key", _tavily_tool),
    "Exa": Sdk(Exa, "api_key", _exa),
    "AsyncExa": Sdk(AsyncExa, "api_key", _exa_async),
    "BraveSearchWrapper": Sdk(BraveSearchWrapper, "api_key", _langchain_json),
    "ScavioClient": Sdk(scavio.ScavioClient, "api_key", _scavio),
    "LinkupClient": Sdk(LinkupClient, "api_key", _linkup),
    "SearxSearchWrapper": Sdk(SearxSearchWrapper, None, _searx),
    "JinaSearchAPIWrapper": Sdk(JinaSearchAPIWrapper, "api_key", _langchain_json),
}
# SDKs the README shows that the suite does not install: their vendor has an HTTP check below.
NOT_INSTALLED = {"Firecrawl": "firecrawl"}


def build(call: ast.Call, sdk: Sdk, base: str) -> Any:
    """The README's constructor call, with its URL pointed at `base`."""

    def value(node: ast.expr) -> Any:
        if isinstance(node, ast.Name) and node.id == "api_key":
            return KEY
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value.replace(PROXY, base)
        raise AssertionError(f"README argument not understood: {ast.unparse(node)}")

    args = [value(a) for a in call.args]
    kwargs = {k.arg: value(k.value) for k in call.keywords if k.arg}
    if sdk.key and not args and sdk.key not in kwargs:
        kwargs[sdk.key] = KEY
    return sdk.make(*args, **kwargs)


# --------------------------------------------------------------------------- HTTP checks
# Vendors without an installed SDK: the request the README (its URL) and VENDORS.md describe.


async def _serper(client: Any, path: str, q: str) -> list[Hit]:
    r = await client.post(path, json={"q": q}, headers={"X-API-KEY": KEY})
    assert r.status == 200, await r.text()
    return [(o["link"], o["title"], o["snippet"]) for o in (await r.json())["organic"]]


async def _serpapi(client: Any, path: str, q: str) -> list[Hit]:
    # serpapi's Client GETs BASE_DOMAIN + "/search" with api_key among the parameters.
    r = await client.get(f"{path}/search", params={"q": q, "engine": "google", "api_key": KEY})
    assert r.status == 200, await r.text()
    body = await r.json()
    return [(o["link"], o["title"], o["snippet"]) for o in body["organic_results"]]


async def _firecrawl(client: Any, path: str, q: str) -> list[Hit]:
    # Firecrawl(api_url=...) POSTs api_url + "/v2/search".
    auth = {"Authorization": f"Bearer {KEY}"}
    r = await client.post(f"{path}/v2/search", json={"query": q, "limit": N}, headers=auth)
    assert r.status == 200, await r.text()
    return [(o["url"], o["title"], o["description"]) for o in (await r.json())["data"]["web"]]


async def _jina_post(client: Any, path: str, q: str) -> list[Hit]:
    headers = {"Authorization": f"Bearer {KEY}", "Accept": "application/json"}
    r = await client.post(path, json={"q": q}, headers=headers)
    assert r.status == 200, await r.text()
    return [(o["url"], o["title"], o["description"]) for o in (await r.json())["data"]]


async def _searxng(client: Any, path: str, q: str) -> list[Hit]:
    r = await client.get(path, params={"q": q, "format": "json"})
    assert r.status == 200, await r.text()
    return [(o["url"], o["title"], o["content"]) for o in (await r.json())["results"]]


HTTP: dict[str, Callable[[Any, str, str], Awaitable[list[Hit]]]] = {
    "serper": _serper,
    "serpapi": _serpapi,
    "firecrawl": _firecrawl,
    "jina": _jina_post,
    "searxng": _searxng,
}


# --------------------------------------------------------------------------- tests: the table


def test_every_readme_prefix_is_a_shipped_route_for_that_vendor() -> None:
    config = shipped_config("http://fake.invalid")
    for row in sdk_table():
        checked = 0
        for url in row.urls:
            path = url.removeprefix(PROXY)
            if not path:  # an SDK that drops path prefixes: the row names the route's prefix
                continue
            r = route_for(config, path)
            assert r is not None, f"README {row.vendor}: {url} has no route in config.yaml"
            assert vendor_of(r) == row.vendor, f"README {row.vendor}: {url} reaches {r.name}"
            checked += 1
        for span in row.spans:
            if m := re.fullmatch(r"prefix: (/\S*)", span):
                named = [r for r in config.routes.values() if r.prefix == m.group(1)]
                assert named, f"README {row.vendor}: no route with `{span}` in config.yaml"
                assert vendor_of(named[0]) == row.vendor
                if "`strip_prefix: false`" in row.text:
                    assert named[0].strip_prefix is False
                checked += 1
        assert checked, f"README {row.vendor}: the row names no proxy URL or route prefix"


def test_every_shipped_search_route_has_a_readme_row() -> None:
    vendors = {row.vendor for row in sdk_table()}
    config = shipped_config("http://fake.invalid")
    missing = {vendor_of(r) for r in config.routes.values() if r.has("search")} - vendors
    assert not missing, f"config.yaml routes without a README row: {sorted(missing)}"


def test_every_readme_row_and_call_is_checked_here() -> None:
    calls = readme_calls()
    unknown = [c.span for c in calls if c.name not in SDKS and c.name not in NOT_INSTALLED]
    assert not unknown, f"README calls this test cannot run (add them to SDKS): {unknown}"
    assert set(NOT_INSTALLED.values()) <= HTTP.keys()
    run = {c.vendor for c in calls if c.name in SDKS}
    unchecked = {row.vendor for row in sdk_table()} - run - HTTP.keys()
    assert not unchecked, f"README rows with no check here: {sorted(unchecked)}"
    shown = {c.name for c in calls}
    assert SDKS.keys() <= shown, f"installed SDKs the README no longer shows: {SDKS.keys() - shown}"


@pytest.mark.parametrize(
    "call",
    [c for c in readme_calls() if c.name not in NOT_INSTALLED],
    ids=lambda c: f"{c.vendor}-{c.name}",
)
async def test_readme_sdk_call_gets_results_through_the_shipped_config(
    vendor: FakeVendor, aiohttp_client: Any, call: ReadmeCall
) -> None:
    sdk = SDKS[call.name]
    client = await proxy(aiohttp_client, vendor)
    base = str(client.make_url("")).rstrip("/")
    query = f"{call.vendor} circuit breaker"

    if inspect.iscoroutinefunction(sdk.search):
        got = await sdk.search(build(call.call, sdk, base), query)
    else:
        got = await asyncio.to_thread(lambda: sdk.search(build(call.call, sdk, base), query))

    assert got == expected(query)
    assert vendor.count() == 1
    assert vendor.last.vendor == call.vendor
    if sdk.key:  # no key configured in the proxy: the agent's own passes through
        assert carries(vendor.last, KEY), dict(vendor.last.headers)


@pytest.mark.parametrize("name", sorted(HTTP))
async def test_readme_http_call_gets_results_through_the_shipped_config(
    vendor: FakeVendor, aiohttp_client: Any, name: str
) -> None:
    (row,) = [row for row in sdk_table() if row.vendor == name]
    client = await proxy(aiohttp_client, vendor)
    query = f"{name} circuit breaker"

    got = await HTTP[name](client, row.urls[0].removeprefix(PROXY), query)

    assert got == expected(query)
    assert vendor.count() == 1
    assert vendor.last.vendor == name
    if name != "searxng":  # self-hosted, no key
        assert carries(vendor.last, KEY), dict(vendor.last.headers)


# --------------------------------------------------------------------------- tests: quick start


def test_quick_start_make_run_serves_the_shipped_config_where_it_says() -> None:
    text = section("Quick start")
    m = re.search(r"make run +# serves (\S+) on http://([\d.]+):(\d+)", text)
    assert m, "README quick start: `make run` line not found"
    assert m.group(1) == SHIPPED.name
    makefile = (README.parent / "Makefile").read_text(encoding="utf-8")
    assert re.search(rf"^CONFIG \?= {re.escape(SHIPPED.name)}$", makefile, re.MULTILINE)
    config = shipped_config("http://fake.invalid")
    assert (config.server.host, config.server.port) == (m.group(2), int(m.group(3)))
    # The agent's URL is that server (localhost).
    assert f"{PROXY}/" in python_block(section("Point your agent at it"))


async def test_agent_code_gets_results(vendor: FakeVendor, aiohttp_client: Any) -> None:
    client = await proxy(aiohttp_client, vendor)
    base = str(client.make_url("")).rstrip("/")
    tree = ast.parse(python_block(section("Point your agent at it")))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = node.value.replace(PROXY, base)
    last = tree.body[-1]
    assert isinstance(last, ast.Expr), "the agent code ends with the search call"
    tree.body[-1] = ast.Assign([ast.Name("answer", ast.Store())], last.value)
    code = compile(ast.fix_missing_locations(tree), "README.md agent code", "exec")
    namespace: dict[str, Any] = {}

    await asyncio.to_thread(exec, code, namespace)

    query = vendor.last.json()["query"]
    answer = namespace["answer"]
    assert [(r["url"], r["title"], r["content"]) for r in answer["results"]] == expected(query)
    (key,) = re.findall(r'api_key="([^"]+)"', python_block(section("Point your agent at it")))
    assert vendor.last.headers["Authorization"] == f"Bearer {key}"  # the agent's own key


# --------------------------------------------------------------------------- tests: /v1/search

VENDOR_KEYS = {  # the variables config.yaml reads, and the header each must reach the vendor in
    "tavily": ("TAVILY_API_KEY", "Authorization", "Bearer {}"),
    "brave": ("BRAVE_API_KEY", "X-Subscription-Token", "{}"),
    "serper": ("SERPER_API_KEY", "X-API-KEY", "{}"),
    "exa": ("EXA_API_KEY", "x-api-key", "{}"),
    "scavio": ("SCAVIO_API_KEY", "Authorization", "Bearer {}"),
    "linkup": ("LINKUP_API_KEY", "Authorization", "Bearer {}"),
    "jina": ("JINA_API_KEY", "Authorization", "Bearer {}"),
    "firecrawl": ("FIRECRAWL_API_KEY", "Authorization", "Bearer {}"),
}
ENV = {var: f"env-{name}-key" for name, (var, _, _) in VENDOR_KEYS.items()}


def test_readme_names_every_key_variable_config_yaml_reads() -> None:
    text = SHIPPED.read_text(encoding="utf-8")
    read = set(re.findall(r"\$\{([A-Z0-9_]+_API_KEY):-\}", text))
    assert read == set(ENV)
    text = section("Point your agent at it")
    assert all(f"`{var}`" in text for var in read), "README, Point your agent at it: key variables"


def readme_search_body() -> dict[str, Any]:
    """The JSON body of docs/endpoints.md's `curl ... /v1/search -d '...'` example."""
    m = re.search(r"curl -s \S*/v1/search -d '(.*?)'", ENDPOINTS.read_text(encoding="utf-8"), re.S)
    assert m, "docs/endpoints.md: the /v1/search curl example is gone"
    body: dict[str, Any] = json.loads(m.group(1))
    return body


@pytest.mark.parametrize("name", ["readme-example", *VENDOR_KEYS])
async def test_v1_search_uses_the_keys_from_the_environment(
    vendor: FakeVendor, aiohttp_client: Any, name: str
) -> None:
    client = await proxy(aiohttp_client, vendor, ENV)
    body: dict[str, Any] = (
        readme_search_body()
        if name == "readme-example"
        else {"query": f"{name} keys", "providers": [name]}
    )

    r = await client.post("/v1/search", json=body)

    assert r.status == 200, await r.text()
    answer = await r.json()
    provider = answer["provider"]
    want = expected(body["query"])[: int(body.get("max_results", 5))]
    assert [(x["url"], x["title"], x["snippet"]) for x in answer["results"]] == want
    var, header, shape = VENDOR_KEYS[provider]
    assert vendor.last.headers.getall(header) == [shape.format(ENV[var])]


async def test_v1_search_without_keys_refuses_and_names_the_missing_key(
    vendor: FakeVendor, aiohttp_client: Any
) -> None:
    client = await proxy(aiohttp_client, vendor)
    r = await client.post("/v1/search", json={"query": "no keys"})
    assert r.status == 502
    err = (await r.json())["error"]
    assert err["type"] == "all_providers_refused"
    assert (
        "tavily has no API key: TAVILY_API_KEY is not set (routes.tavily.headers.set.Authorization"
        " reads it); export TAVILY_API_KEY before starting the proxy (or, on /v1/search, send"
        " credentials.tavily)"
    ) in err["message"]
    assert vendor.count() == 0


async def test_a_key_in_the_environment_replaces_the_agents_own(
    vendor: FakeVendor, aiohttp_client: Any
) -> None:
    client = await proxy(aiohttp_client, vendor, ENV)
    base = str(client.make_url("/tavily"))

    def search() -> Any:
        with tavily.TavilyClient(api_key=KEY, api_base_url=base) as sdk:
            return sdk.search("injected key")

    answer = await asyncio.to_thread(search)
    assert len(answer["results"]) == N
    assert vendor.last.headers.getall("Authorization") == [f"Bearer {ENV['TAVILY_API_KEY']}"]

"""Adding a vendor is one record and one registration line: ACME, a vendor that exists only in
this module (written as a policies/vendors/ module would be), is registered with one line and
then served end to end by a real proxy in front of a fake ACME server on loopback: its route
recovers searches, its errors come in its shape (also on a custom profile extending it), and
/v1/search uses it with its options, details and key slot. docs/development.md's "Adding a vendor"
diff is this very vendor, and applies to the registry as it is."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from aiohttp import web

import policies.vendors
from policies.core.errors import ProxyError, RateLimited
from policies.core.options import (
    NO_OPTIONS,
    OptionField,
    SearchOptions,
    VendorOptions,
    lower,
    read_code,
    table,
)
from policies.core.profile import (
    AnswerTemplate,
    CredentialSlot,
    DetailFields,
    QueryLocation,
    VendorProfile,
)
from policies.profiles import build_search, read_options
from policies.vendors import BUILTIN
from tests.conftest import route

# --- The vendor: what policies/vendors/acme.py would hold ---------------------------------------


def _error_body(err: ProxyError, request_id: str) -> dict[str, Any]:
    return {"fault": {"kind": err.type, "text": err.message, "request": request_id}}


ACME = VendorProfile(
    name="acme",
    query_locations=(QueryLocation("json", "ask.text"),),
    results_paths=(("payload", "hits"),),
    url_fields=("href",),
    title_fields=("heading",),
    snippet_fields=("summary",),
    terminal_body_codes={429: frozenset({"OUT_OF_CREDIT"})},
    error_code_paths=(("fault", "kind"),),
    search_path="/v3/query",
    max_results_field="limit",
    key_slot=CredentialSlot("header", "X-Acme-Key"),
    options=VendorOptions(
        {
            "time_range": OptionField(
                "recency", *table({"day": "24h", "week": "7d", "month": "30d", "year": "365d"})
            ),
            "country": OptionField("market", lower, read_code),
        }
    ),
    details=DetailFields(score=("relevance",), published=("published_at",)),
    answer=AnswerTemplate(envelope={"object": "acme.results", "echo": "$query"}),
    error_shape=_error_body,
)


@pytest.fixture(autouse=True)
def acme_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BUILTIN, ACME.name, ACME)  # the one registration line


# --- A fake ACME server, written from ACME's wire format (not from the record) -----------------


class FakeAcme:
    """POST /v3/query: `{"ask": {"text"}, "limit"}` -> `{"payload": {"hits": [...]}}`; empty
    for questions of more than three words; `fail_next` answers 503 first."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.fail_next = 0

    async def query(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received.append((dict(request.headers), body))
        if self.fail_next:
            self.fail_next -= 1
            return web.json_response({"fault": {"kind": "overloaded"}}, status=503)
        text = body["ask"]["text"]
        count = 0 if len(text.split()) > 3 else body.get("limit", 3)
        hits = [
            {
                "href": f"https://acme.example/{'-'.join(text.split())}/{i}",
                "heading": f"{text} ({i})",
                "summary": f"Part {i} about {text}.",
                "relevance": round(1 - i / 10, 2),
                "published_at": f"2024-03-0{i}T12:00:00Z",
            }
            for i in range(1, count + 1)
        ]
        return web.json_response({"object": "acme.results", "payload": {"hits": hits}})


@pytest.fixture
async def acme(aiohttp_server: Any) -> tuple[FakeAcme, str]:
    fake = FakeAcme()
    app = web.Application()
    app.router.add_post("/v3/query", fake.query)
    server = await aiohttp_server(app)
    return fake, str(server.make_url("")).rstrip("/")


RETRY = {"attempts": 2, "backoff": {"initial": "10ms", "max": "20ms"}}


# --- End to end --------------------------------------------------------------------------------


async def test_its_route_recovers_an_empty_search_and_a_503(acme: Any, start_proxy: Any) -> None:
    fake, url = acme
    routes = {"acme": route(url, "/acme", search={"vendor": "acme"}, retry=RETRY)}
    client = await start_proxy({"routes": routes})
    fake.fail_next = 1
    question = "which rocket skates stop fastest on sand"
    r = await client.post("/acme/v3/query", json={"ask": {"text": question}, "limit": 2})
    assert r.status == 200, await r.text()
    used = unquote(r.headers["X-Search-Query-Used"])
    hits = (await r.json())["payload"]["hits"]
    assert [h["heading"] for h in hits] == [f"{used} (1)", f"{used} (2)"]
    sent = [body for _, body in fake.received]
    assert sent[0]["ask"]["text"] == question and sent[-1]["ask"]["text"] == used != question
    assert len(sent) >= 3  # the 503, the empty answer, then a simpler question
    assert all(body["limit"] == 2 for body in sent)  # the rest of the body as the agent sent it


async def test_its_errors_come_in_its_shape_also_on_a_profile_extending_it(
    acme: Any, start_proxy: Any
) -> None:
    _, url = acme
    limited = {"rate": "1/h", "burst": 1, "max_wait": "0s"}
    raw = {
        "routes": {
            "acme": route(url, "/acme", search={"vendor": "acme"}, rate_limit=limited),
            "acme-eu": route(url, "/acme-eu", search={"vendor": "acme-eu"}, rate_limit=limited),
        },
        "profiles": {"acme-eu": {"extends": "acme", "max_results_cap": 10}},
    }
    client = await start_proxy(raw)
    for prefix in ("/acme", "/acme-eu"):
        ask = {"ask": {"text": "rocket skates"}}
        assert (await client.post(f"{prefix}/v3/query", json=ask)).status == 200
        r = await client.post(f"{prefix}/v3/query", json=ask)
        assert r.status == 429 and r.headers["X-Proxy-Error"] == "rate_limited"
        body = await r.json()
        assert body["fault"]["kind"] == "rate_limited"
        assert body["fault"]["text"] == body["search_proxy"]["message"]
        assert body["fault"]["request"] == r.headers["X-Request-Id"]


async def test_v1_search_uses_it_with_its_options_details_and_key(
    acme: Any, start_proxy: Any
) -> None:
    fake, url = acme
    routes = {"acme": route(url, "/acme", search={"vendor": "acme", "on_empty": "pass"})}
    client = await start_proxy({"routes": routes})
    ask = {
        "query": "rocket skates",
        "max_results": 2,
        "time_range": "week",
        "country": "DE",
        "language": "de",
        "credentials": {"acme": "acme-key-1"},
    }
    r = await client.post("/v1/search", json=ask)
    assert r.status == 200, await r.text()
    answer = await r.json()
    assert answer["provider"] == "acme" and answer["dropped_options"] == ["language"]
    first = answer["results"][0]
    assert first["url"] == "https://acme.example/rocket-skates/1"
    assert (first["title"], first["snippet"]) == (
        "rocket skates (1)",
        "Part 1 about rocket skates.",
    )
    assert first["score"] == 0.9 and first["date"] == "2024-03-01"
    assert len(answer["results"]) == 2
    headers, sent = fake.received[-1]
    assert sent == {"ask": {"text": "rocket skates"}, "limit": 2, "recency": "7d", "market": "de"}
    assert headers["X-Acme-Key"] == "acme-key-1"


# --- docs/development.md's diff -----------------------------------------------------------------

DEVELOPMENT = Path(__file__).resolve().parent.parent / "docs" / "development.md"
HUNK = re.compile(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@")


def readme_diff() -> dict[str, list[list[str]]]:
    """The "Adding a vendor" diff of docs/development.md: each file's hunks, as their lines."""
    text = DEVELOPMENT.read_text(encoding="utf-8")
    start = text.index("\n## Adding a vendor\n")
    match = re.search(r"```diff\n(.*?)```", text[start:], re.S)
    assert match, "docs/development.md: no diff under 'Adding a vendor'"
    files: dict[str, list[list[str]]] = {}
    hunks: list[list[str]] = []
    for line in match.group(1).splitlines():
        if line.startswith("diff --git a/"):
            hunks = files.setdefault(line.split()[2].removeprefix("a/"), [])
        elif line.startswith("@@"):
            hunks.append([line])
        elif hunks and not line.startswith(("---", "+++")):
            hunks[-1].append(line)
    return files


def test_the_readme_adds_this_vendor_in_one_new_module_and_two_registry_lines() -> None:
    files = readme_diff()
    assert set(files) == {"policies/vendors/acme.py", "policies/vendors/__init__.py"}
    registry = Path(policies.vendors.__file__).read_text(encoding="utf-8").splitlines()
    added: dict[str, list[str]] = {}
    for name, hunks in files.items():
        for header, *lines in hunks:
            match = HUNK.match(header)
            assert match, header
            old_start, old_count, _, new_count = (int(n) for n in match.groups())
            old = [line[1:] for line in lines if not line.startswith("+")]
            new = [line[1:] for line in lines if not line.startswith("-")]
            assert (len(old), len(new)) == (old_count, new_count), header
            if name.endswith("__init__.py"):  # it applies to the registry as it is now
                assert registry[old_start - 1 : old_start - 1 + old_count] == old, header
            added.setdefault(name, []).extend(line[1:] for line in lines if line[:1] == "+")
    assert [line.strip() for line in added["policies/vendors/__init__.py"]] == [
        "from policies.vendors.acme import ACME",
        "ACME,",
    ]
    namespace: dict[str, Any] = {}
    exec(
        compile(
            "\n".join(added["policies/vendors/acme.py"]), "docs/development.md: acme.py", "exec"
        ),
        namespace,
    )
    shown = namespace["ACME"]
    # The data alike; the functions (its error shape, its option converters) doing the same.
    functions = {"error_shape": None, "options": NO_OPTIONS}
    assert dataclasses.replace(shown, **functions) == dataclasses.replace(ACME, **functions)
    err = RateLimited("acme: the route's rate limit is reached")
    assert shown.error_shape(err, "req-1") == ACME.error_shape(err, "req-1")
    assert shown.options.fields.keys() == ACME.options.fields.keys()
    for time_range in ("day", "week", "month", "year"):
        options = SearchOptions(time_range=time_range, country="DE")
        request, dropped = build_search(shown, "q", options)
        assert (request, dropped) == build_search(ACME, "q", options)
        sent = json.dumps(request.json_body).encode()
        assert read_options(shown, "POST", request.path, {}, sent) == options

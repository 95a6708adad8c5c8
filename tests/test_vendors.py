"""Every built-in vendor's record is complete and consistent, checked by what each part does: the
search it builds is read back by its own query locations, the answer it renders by its own
result reader, its option table and key slot by the readers of the agent's request, its error
shape by the error reader, its terminal answers by `assess`. And every vendor module is
registered, and a custom profile that `extends` one copies its whole record."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

import policies.vendors
from policies.core.errors import (
    BadRequest,
    CircuitOpen,
    DeadlineExceeded,
    RateLimited,
    UpstreamRetryAfterTooLong,
    UpstreamUnreachable,
)
from policies.core.options import OPTION_NAMES, SearchOptions
from policies.core.profile import SearchRequest, SearchResult, VendorProfile, Verdict
from policies.profiles import (
    assess,
    build_search,
    error_message,
    extract_details,
    extract_query,
    extract_results,
    read_options,
    render_answer,
    with_credential,
)
from policies.vendors import BUILTIN
from proxy.clients import presented
from proxy.config import parse_config
from proxy.dialects import error_body
from proxy.testing.fakevendor.vendors import VENDORS, error_payload
from tests.test_search_options import VALUES  # candidate values of each option

NOW = datetime(2024, 5, 10, 15, 0, tzinfo=UTC)
NAMES = sorted(BUILTIN)
QUERY = "übersicht: rust async runtimes"
RESULTS = [
    SearchResult(f"Title {i}", f"https://docs.example/{i}", f"Snippet {i}.") for i in (1, 2, 3)
]
# VENDORS.md: SearXNG is the one vendor that takes no API key.
KEYLESS = {"searxng"}
# The proxy's own errors of each kind an agent meets most.
ERRORS = [
    RateLimited("tavily: the route's rate limit is reached; retry in 3s", retry_after_s=3.0),
    UpstreamRetryAfterTooLong("tavily: the vendor asked to wait 120s"),
    CircuitOpen("tavily: circuit open after 5 failures; retry in 30s"),
    DeadlineExceeded("tavily: ran out of time after 3 attempts"),
    UpstreamUnreachable("tavily: connection refused"),
    BadRequest("tavily: the query is longer than 2000 characters"),
]


def body_of(request: SearchRequest) -> bytes:
    return json.dumps(request.json_body).encode() if request.json_body is not None else b""


def read_back(profile: VendorProfile, request: SearchRequest) -> SearchOptions:
    return read_options(
        profile, request.method, request.path, request.query_params, body_of(request), now=NOW
    )


# --- The registry ------------------------------------------------------------------------------


def test_every_vendor_module_is_registered_under_its_name() -> None:
    """A vendor module without its registration line (or registered twice) fails here."""
    records = []
    for module in pkgutil.iter_modules(policies.vendors.__path__):
        loaded = importlib.import_module(f"policies.vendors.{module.name}")
        found = [v for v in vars(loaded).values() if isinstance(v, VendorProfile)]
        records += [(module.name, record) for record in found]
    assert sorted(name for name, _ in records) == NAMES  # custom.py defines no vendor
    for module_name, record in records:
        assert BUILTIN[record.name] is record and record.name == module_name


# --- Endpoint and query ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_the_search_it_builds_carries_the_query_where_it_reads_it(name: str) -> None:
    profile = BUILTIN[name]
    request, dropped = build_search(profile, QUERY, SearchOptions(max_results=3), now=NOW)
    assert dropped == ()
    assert request.method == profile.search_method and request.path == profile.search_path
    ref = extract_query(
        profile, path=request.path, query=request.query_params, body=body_of(request)
    )
    assert ref is not None and ref.text == QUERY


# --- Results, details and the answer template --------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_an_answer_rendered_in_its_shape_reads_back_as_the_same_results(name: str) -> None:
    profile = BUILTIN[name]
    answer = render_answer(profile, RESULTS, QUERY)
    assert extract_results(profile, answer) == RESULTS
    assert assess(profile, 200, json.dumps(answer).encode()).verdict is Verdict.OK
    # With nothing found, the same shape is an empty answer, not a broken one.
    empty = json.dumps(render_answer(profile, [], QUERY)).encode()
    assert assess(profile, 200, empty).verdict is Verdict.EMPTY


@pytest.mark.parametrize("name", NAMES)
def test_each_detail_field_it_names_is_read_from_its_results(name: str) -> None:
    profile = BUILTIN[name]
    ranks = extract_details(profile, render_answer(profile, RESULTS, QUERY), now=NOW)
    assert [ranks[r.url].position for r in RESULTS] == [1, 2, 3]
    fields = profile.details
    wanted = {
        "score": (fields.score, 0.75, 0.75),
        "position": (fields.position, 7, 7),
        "published_date": (fields.published, "2024-01-15T08:30:00", "2024-01-15T08:30:00"),
        "last_updated": (fields.updated, "2024-02-01", "2024-02-01"),
    }
    for detail, (candidates, value, expected) in wanted.items():
        for field in candidates:
            answer = render_answer(profile, RESULTS[:1], QUERY)
            items = answer if isinstance(answer, list) else _items(profile, answer)
            items[0][field] = value
            details = extract_details(profile, answer, now=NOW)[RESULTS[0].url]
            assert getattr(details, detail) == expected, (name, field)


def _items(profile: VendorProfile, answer: dict[str, Any]) -> list[dict[str, Any]]:
    node: Any = answer
    for key in profile.results_path:
        node = node[key]
    return list(node)


# --- Options -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_each_option_its_table_names_is_written_and_read_back(name: str) -> None:
    profile = BUILTIN[name]
    table = profile.options.fields
    assert set(table) <= set(OPTION_NAMES[1:])  # a misspelt option would never apply
    plain, _ = build_search(profile, QUERY, SearchOptions(), now=NOW)
    for option, values in VALUES.items():
        if option not in table:
            continue
        written = 0
        for value in values:
            options = SearchOptions(**{option: value})
            request, dropped = build_search(profile, QUERY, options, now=NOW)
            if dropped:
                assert dropped == (option,) and request == plain, (name, option, value)
                continue
            # Honoured by sending nothing (the vendor's default) reads back as nothing asked.
            expected = options if request != plain else SearchOptions()
            written += request != plain
            assert read_back(profile, request) == expected, (name, option, value)
        assert written, f"{name}: {option} is in its table but never written"
    if profile.max_results_field:
        request, _ = build_search(profile, QUERY, SearchOptions(max_results=3), now=NOW)
        assert read_back(profile, request) == SearchOptions(max_results=3)


# --- The agent's own key -----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_the_key_slot_puts_a_key_where_the_proxy_reads_an_agents_key(name: str) -> None:
    profile = BUILTIN[name]
    request, _ = build_search(profile, QUERY, now=NOW)
    assert (profile.key_slot is None) == (name in KEYLESS)
    if profile.key_slot is None:
        with pytest.raises(ValueError, match="takes no API key"):
            with_credential(profile, request, "k-123")
        return
    keyed = with_credential(profile, request, "k-123")
    # One place more, the rest as it was.
    added = (set(keyed.headers.items()) - set(request.headers.items())) | (
        set(keyed.query_params.items()) - set(request.query_params.items())
    )
    assert len(added) == 1
    assert dataclasses.replace(
        keyed, headers=request.headers, query_params=request.query_params
    ) == (request)
    headers = CIMultiDictProxy(CIMultiDict(keyed.headers))
    query_string = urlencode(keyed.query_params)
    tokens = [token for _, _, token in presented(profile.key_slot, headers, query_string)]
    assert tokens[:1] == ["k-123"]


# --- Errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_proxy_error_in_its_shape_carries_the_proxys_message(name: str) -> None:
    profile = BUILTIN[name]
    for err in ERRORS:
        body = error_body(err, "req-1", profile)
        # The fake vendor's error body, modelled on the vendor's own: where it puts a message.
        own = error_payload(name, err.status, None, err.message) if name in VENDORS else None
        if profile.error_shape is None:  # no JSON shape of its own (SearXNG), said in its module
            assert not isinstance(own, dict) and body == err.payload()
            continue
        assert body.pop("search_proxy") == err.payload()["error"]  # beside the shape
        found = _paths_of(err.message, body)
        assert found, f"{name}: its error shape does not carry the proxy's message"
        raw = json.dumps(body).encode()
        if own is not None:  # a vendor the proxy knows: where its SDK and error_message read
            assert _paths_of(err.message, own) <= found, name
            assert error_message(raw) == err.message, (name, type(err).__name__)
        # Never an answer with results, nor one that says retrying cannot help.
        assert assess(profile, err.status, raw).verdict is Verdict.PASS, (name, err)


@pytest.mark.parametrize("name", NAMES)
def test_its_terminal_and_empty_answers_assess_as_such(name: str) -> None:
    profile = BUILTIN[name]
    assert assess(profile, 503, b"{}").verdict is Verdict.PASS  # an outage is never terminal
    for status in profile.terminal_statuses:
        assert assess(profile, status, b"{}").verdict is Verdict.TERMINAL, status
    by_code = (
        (Verdict.TERMINAL, profile.terminal_body_codes),
        (Verdict.EMPTY, profile.empty_status_codes),
    )
    for verdict, table in by_code:
        assert not table or profile.error_code_paths  # a body code needs a place to be read from
        for status, codes in table.items():
            for code in codes:
                assessed = assess(profile, status, _coded(profile, code))
                assert (assessed.verdict, assessed.error_code) == (verdict, code)
            # Another code at the same status is left to the generic rules.
            other = assess(profile, status, _coded(profile, "SOMETHING_ELSE"))
            assert other.verdict is Verdict.PASS, (name, status)


def _paths_of(text: str, node: Any, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Where `text` sits in a JSON body."""
    if isinstance(node, dict):
        return {p for k, v in node.items() for p in _paths_of(text, v, (*path, k))}
    return {path} if node == text else set()


def _coded(profile: VendorProfile, code: str) -> bytes:
    body: Any = code
    for key in reversed(profile.error_code_paths[0]):
        body = {key: body}
    return json.dumps(body).encode()


# --- MCP preset --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in NAMES if BUILTIN[n].mcp is not None])
def test_its_mcp_preset_configures_an_mcp_route(name: str) -> None:
    preset = BUILTIN[name].mcp
    assert preset is not None
    raw = {
        "routes": {"m": {"prefix": "/m", "upstream": "http://127.0.0.1:1", "mcp": {"server": name}}}
    }
    mcp = parse_config(raw, {}).routes["m"].section("mcp")
    assert mcp is not None and mcp.idempotent_tools == frozenset(preset.idempotent_tools)
    assert dict(mcp.search_tools) == dict(preset.search_tools) != {}


# --- A custom profile that extends a vendor ----------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_custom_profile_extending_it_copies_its_whole_record(name: str) -> None:
    raw = {
        "routes": {
            "r": {"prefix": "/r", "upstream": "http://127.0.0.1:1", "search": {"vendor": "mine"}}
        },
        "profiles": {"mine": {"extends": name, "terminal_statuses": [418]}},
    }
    mine = parse_config(raw, {}).profiles["mine"]
    base = BUILTIN[name]
    assert mine == dataclasses.replace(base, name="mine", terminal_statuses=frozenset({418}))
    for part in ("key_slot", "options", "details", "answer", "error_shape", "mcp"):
        assert getattr(mine, part) is getattr(base, part), part

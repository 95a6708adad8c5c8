"""Config parsing: typed values, env interpolation, and an error naming the YAML path for each
class of mistake."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from policies.profiles import (
    BUILTIN_PROFILES,
    SearchRequest,
    SearchResult,
    VendorProfile,
    Verdict,
    build_search_request,
    classify,
    extract_results,
)
from policies.profiles.reading import MAX_ITEMS_READ
from proxy import cli
from proxy.config import (
    REDACTED,
    ConfigError,
    ConfigErrors,
    as_document,
    load_config,
    parse_config,
    parse_duration,
    parse_rate,
    parse_size,
    redacted,
)
from proxy.search_api import MAX_RESULTS
from testkit.procs import ROOT


def minimal(**route):
    body = {"prefix": "/tavily", "upstream": "https://api.tavily.com"}
    body.update(route)
    return {"routes": {"tavily": body}}


def j(obj) -> bytes:
    return json.dumps(obj).encode()


def error_of(raw, env=None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(raw, env or {})
    return str(info.value)


def test_scalars():
    assert parse_duration("250ms", "p") == 0.25
    assert parse_duration("10s", "p") == 10
    assert parse_duration("5m", "p") == 300
    assert parse_duration("1h", "p") == 3600
    assert parse_size("1MiB", "p") == 1024 * 1024
    assert parse_size("512KiB", "p") == 512 * 1024
    assert parse_size("2MB", "p") == 2_000_000
    assert parse_rate("10/s", "p") == 10
    assert parse_rate("600/m", "p") == 10


def test_shipped_config_is_valid():
    config = load_config("config.yaml", env={})
    assert {"tavily", "serper", "brave", "exa", "scavio", "searxng"} <= set(config.routes)
    assert config.redis is None  # make run needs no Redis
    assert config.routes["tavily"].upstream == "https://api.tavily.com"


def test_defaults_and_types():
    config = parse_config(minimal(), {})
    t = config.routes["tavily"]
    assert (t.timeouts.connect, t.timeouts.per_try, t.timeouts.total) == (2.0, 10.0, 30.0)
    assert t.section("retry") is None and t.section("cache") is None
    assert config.server.port == 8080 and config.server.max_body_bytes == 1024 * 1024


def test_retry_on_key_is_not_a_yaml_boolean(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "routes:\n  t:\n    prefix: /t\n    upstream: http://127.0.0.1:1\n"
        "    retry: {attempts: 2, on: [429, 5xx, timeout, 418]}\n"
    )
    retry = load_config(f, env={}).routes["t"].section("retry")
    assert retry.on_statuses == {429, 500, 502, 503, 504, 418}
    assert retry.on_conditions == {"timeout"}


def test_bad_duration_names_the_path():
    msg = error_of(minimal(timeouts={"per_try": "ten"}))
    assert msg == 'routes.tavily.timeouts.per_try: expected a duration like 10s, got "ten"'


def test_unknown_key_is_an_error():
    msg = error_of(minimal(retry={"attempts": 3, "backof": {}}))
    assert msg.startswith("routes.tavily.retry.backof: unknown key")
    assert error_of({"routes": minimal()["routes"], "sever": {}}).startswith("sever: unknown key")


def test_missing_required_key():
    assert error_of({"routes": {"t": {"prefix": "/t"}}}) == (
        "routes.t.upstream: required key is missing"
    )
    assert error_of({}) == "routes: required key is missing"


def test_missing_environment_variable_is_named():
    raw = minimal(headers={"set": {"Authorization": "Bearer ${TAVILY_API_KEY}"}})
    msg = error_of(raw, env={})
    assert (
        msg
        == "routes.tavily.headers.set.Authorization: environment variable TAVILY_API_KEY is not set"
    )
    ok = parse_config(raw, {"TAVILY_API_KEY": "k1"})
    assert ok.routes["tavily"].headers.set["Authorization"] == "Bearer k1"
    assert (
        parse_config(minimal(upstream="${UP:-http://127.0.0.1:9}"), {}).routes["tavily"].upstream
        == "http://127.0.0.1:9"
    )


def test_bad_upstream_and_prefix():
    assert "expected an http(s) URL" in error_of(minimal(upstream="ftp://x"))
    assert error_of(minimal(upstream="https://u:p@x.com")).startswith("routes.tavily.upstream:")
    assert error_of(minimal(prefix="tavily")).startswith("routes.tavily.prefix: expected a path")
    assert "collides with the proxy's own /metrics" in error_of(minimal(prefix="/metrics"))
    assert "collides" in error_of(minimal(prefix="/admin/x"))


def test_duplicate_prefix():
    raw = {"routes": {"a": minimal()["routes"]["tavily"], "b": minimal()["routes"]["tavily"]}}
    assert error_of(raw) == "routes.b.prefix: '/tavily' is already the prefix of route 'a'"


def test_wrong_types():
    assert error_of(minimal(retry={"attempts": "three"})) == (
        "routes.tavily.retry.attempts: expected a whole number from 1 to 10, got 'three'"
    )
    assert error_of(minimal(retry={"on": ["sometimes"]})).startswith("routes.tavily.retry.on[0]:")
    assert error_of(minimal(rate_limit={"rate": "fast", "burst": 2})).startswith(
        "routes.tavily.rate_limit.rate: expected a rate"
    )
    assert error_of(minimal(rate_limit={"rate": "10/s"})) == (
        "routes.tavily.rate_limit.burst: required key is missing"
    )
    assert error_of(minimal(timeouts={"per_try": "20s", "total": "10s"})) == (
        "routes.tavily.timeouts.per_try: must not exceed timeouts.total"
    )


def test_unknown_search_vendor():
    msg = error_of(minimal(search={"vendor": "altavista"}))
    assert msg.startswith("routes.tavily.search.vendor: unknown vendor 'altavista'")


def test_invalid_yaml_is_located(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("routes:\n  t: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert "is not valid YAML at line" in str(info.value)


def test_redacted_hides_secrets():
    raw = minimal(headers={"set": {"Authorization": "Bearer sk-live-1", "X-Other": "plain-value"}})
    raw["redis"] = {"url": "redis://:hunter2@127.0.0.1:6379/0"}
    raw["server"] = {"admin_token": "tok-123"}
    shown = str(redacted(parse_config(raw, {})))
    # Every headers.set value: a route's headers are where keys are configured, by any name.
    for secret in ("sk-live-1", "hunter2", "tok-123", "plain-value"):
        assert secret not in shown
    assert "'X-Other': '<redacted>'" in shown


# --- custom vendor profiles -----------------------------------------------------------------


def profile_of(mapping) -> VendorProfile:
    return parse_config({**minimal(), "profiles": {"acme": mapping}}, {}).profiles["acme"]


def test_profile_builds_a_full_custom_profile() -> None:
    profile = profile_of(
        {
            "query": [{"json": "query"}, {"query": "q"}],
            "results": "data.items",
            "url": "link",
            "title": ["headline", "title"],
            "snippet": "body",
            "terminal_statuses": [402, "403"],
            "terminal_body_codes": {429: ["QUOTA"]},
            "empty_status_codes": {"404": "NOTHING"},
            "error_code_paths": ["error.code", "message"],
            "ratelimit_headers": True,
            "search_method": "get",
            "search_path": "/api/search",
            "max_results_field": "size",
            "max_results_cap": 50,
            "search_extra": {"lang": "en", "safe": True},
            "search_headers": {"Accept": "application/json"},
        },
    )
    body = {"data": {"items": [{"link": "https://x.example/", "headline": "H", "body": "B"}]}}
    assert extract_results(profile, body) == [SearchResult("H", "https://x.example/", "B")]
    assert classify(profile, 200, j(body)) is Verdict.OK
    assert classify(profile, 403, b"") is Verdict.TERMINAL
    assert classify(profile, 429, j({"error": {"code": "QUOTA"}})) is Verdict.TERMINAL
    assert classify(profile, 404, j({"message": "NOTHING"})) is Verdict.EMPTY
    assert classify(profile, 200, j({"data": {}})) is Verdict.MALFORMED
    assert build_search_request(profile, "q", 80) == SearchRequest(
        "GET",
        "/api/search",
        {"q": "q", "size": "50", "lang": "en", "safe": "true"},
        None,
        {"Accept": "application/json"},
    )


def test_profile_extends_a_builtin() -> None:
    profile = profile_of({"extends": "serper", "terminal_statuses": [400]})
    assert profile.name == "acme"
    assert profile.terminal_statuses == frozenset({400})
    assert profile.query_locations == BUILTIN_PROFILES["serper"].query_locations
    assert classify(profile, 400, j({"message": "Not enough credits"})) is Verdict.TERMINAL


def test_profile_results_empty_string_means_the_body_is_the_list() -> None:
    profile = profile_of({"query": [{"query": "q"}], "results": ""})
    body = [{"url": "https://x.example/", "title": "T", "snippet": "S"}]
    assert classify(profile, 200, j(body)) is Verdict.OK
    assert classify(profile, 200, b"[]") is Verdict.EMPTY
    assert extract_results(profile, body) == [SearchResult("T", "https://x.example/", "S")]


def test_a_vendors_huge_result_list_is_read_only_as_far_as_any_search_needs() -> None:
    profile = profile_of({"query": [{"query": "q"}], "results": ""})
    body = [{"url": f"https://x.example/{i}", "title": "T"} for i in range(200_000)]
    found = extract_results(profile, body)
    assert len(found) == MAX_ITEMS_READ >= 4 * MAX_RESULTS  # room for dedupe and blocking
    assert (
        found[0].url == "https://x.example/0"
        and found[-1].url == f"https://x.example/{MAX_ITEMS_READ - 1}"
    )


def test_profile_from_yaml_with_integer_status_keys(tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "routes:\n  t:\n    prefix: /t\n    upstream: http://127.0.0.1:1\n"
        "    search: {vendor: acme}\n"
        "profiles:\n  acme:\n    extends: linkup\n"
        "    terminal_body_codes: {429: [OUT_OF_CREDITS], '402': PAY}\n"
    )
    profile = load_config(f, env={}).profiles["acme"]
    assert profile.terminal_body_codes == {
        429: frozenset({"OUT_OF_CREDITS"}),
        402: frozenset({"PAY"}),
    }
    assert profile.empty_status_codes == BUILTIN_PROFILES["linkup"].empty_status_codes


BASE = {"query": [{"json": "q"}], "results": "items"}


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({**BASE, "results": 5}, "profiles.acme.results: expected a dotted path, got 5"),
        ({**BASE, "results": "data..items"}, "profiles.acme.results: expected a dotted path"),
        ({**BASE, "results": ["a", 3]}, "profiles.acme.results[1]: expected a dotted path"),
        ({**BASE, "colour": "red"}, "profiles.acme.colour: unknown key"),
        ({**BASE, "query": "q"}, "profiles.acme.query: expected a list of"),
        ({**BASE, "query": []}, "profiles.acme.query: expected a list of"),
        (
            {**BASE, "query": [{"json": "q"}, {"header": "q"}]},
            "profiles.acme.query[1].header: unknown location kind",
        ),
        (
            {**BASE, "query": [{"json": "q", "query": "q"}]},
            "profiles.acme.query[0]: expected one of",
        ),
        (
            {**BASE, "query": [{"path": "search"}]},
            "profiles.acme.query[0].path: a path location needs a prefix",
        ),
        (
            {**BASE, "query": [{"json": ""}]},
            "profiles.acme.query[0].json: expected a non-empty string",
        ),
        ({**BASE, "url": []}, "profiles.acme.url: expected a field name or a list of them"),
        ({**BASE, "title": ["ok", 1]}, "profiles.acme.title[1]: expected a non-empty string"),
        (
            {**BASE, "terminal_statuses": [402, 99]},
            "profiles.acme.terminal_statuses[1]: expected an HTTP status",
        ),
        (
            {**BASE, "terminal_statuses": [True]},
            "profiles.acme.terminal_statuses[0]: expected an HTTP status",
        ),
        (
            {**BASE, "terminal_body_codes": {429: [1]}},
            "profiles.acme.terminal_body_codes.429[0]: expected a non-empty string",
        ),
        (
            {**BASE, "terminal_body_codes": {"x": ["A"]}},
            "profiles.acme.terminal_body_codes.x: expected an HTTP status",
        ),
        (
            {**BASE, "empty_status_codes": ["A"]},
            "profiles.acme.empty_status_codes: expected a mapping",
        ),
        (
            {**BASE, "error_code_paths": [""]},
            "profiles.acme.error_code_paths[0]: expected a dotted path",
        ),
        (
            {**BASE, "ratelimit_headers": "yes"},
            "profiles.acme.ratelimit_headers: expected true or false",
        ),
        ({**BASE, "search_method": "PUT"}, "profiles.acme.search_method: expected GET or POST"),
        (
            {**BASE, "search_path": "search"},
            "profiles.acme.search_path: expected a path starting with '/'",
        ),
        (
            {**BASE, "search_path": "/s", "search_method": "GET"},
            "profiles.acme.query: a GET search needs a query location",
        ),
        (
            {**BASE, "max_results_cap": 0},
            "profiles.acme.max_results_cap: expected a whole number >= 1",
        ),
        (
            {**BASE, "search_headers": {"Accept": 1}},
            "profiles.acme.search_headers.Accept: expected a non-empty string",
        ),
        ({**BASE, "extends": "bing"}, "profiles.acme.extends: expected one of brave, exa,"),
        ({"results": "items"}, "profiles.acme.query: required"),
        ({"query": [{"json": "q"}]}, "profiles.acme.results: required"),
        (["query"], "profiles.acme: expected a mapping"),
    ],
)
def test_profile_errors_name_the_yaml_path(mapping, message: str) -> None:
    assert error_of({**minimal(), "profiles": {"acme": mapping}}).startswith(message)


def test_profiles_section_must_be_a_mapping() -> None:
    assert error_of({**minimal(), "profiles": 5}) == "profiles: expected a mapping, got int"


# --- every mistake in one run ----------------------------------------------------------------


def errors_of(raw, env=None) -> list[str]:
    with pytest.raises(ConfigErrors) as info:
        parse_config(raw, env or {})
    assert str(info.value) == "\n".join(str(e) for e in info.value.errors)
    return [str(e) for e in info.value.errors]


def test_one_mistake_is_one_error_with_its_path() -> None:
    with pytest.raises(ConfigErrors) as info:
        parse_config(minimal(timeouts={"per_try": "ten"}), {})
    (only,) = info.value.errors
    assert isinstance(info.value, ConfigError)
    assert (info.value.path, info.value.reason) == (only.path, only.reason)
    message = 'routes.tavily.timeouts.per_try: expected a duration like 10s, got "ten"'
    assert str(info.value) == str(only) == message


def test_every_mistake_is_reported_across_routes_and_sections() -> None:
    raw = {
        "server": {"port": -1},
        "routes": {
            "a": {
                "prefix": "/a",
                "upstream": "https://a.example",
                "timeouts": {"per_try": "ten"},
                "retry": {"attempts": 0, "backof": {}},
                "cache": {"ttl": "soon"},
                "search": {"vendor": "tavily"},
            },
            "b": {"prefix": "/b", "upstream": "ftp://b.example"},
            "c": {"prefix": "/c", "upstream": "https://c.example", "rate_limit": {"rate": "9"}},
        },
    }
    paths = [e.split(": ")[0] for e in errors_of(raw)]
    assert paths == [
        "server.port",
        "routes.a.timeouts.per_try",
        "routes.a.retry.backof",
        "routes.a.retry.attempts",
        "routes.a.cache.ttl",
        "routes.b.upstream",
        "routes.c.rate_limit.burst",
        "routes.c.rate_limit.rate",
    ]


def test_every_unset_variable_is_named_once() -> None:
    raw = minimal(upstream="${UP}", headers={"set": {"Authorization": "Bearer ${KEY}"}})
    assert errors_of(raw) == [
        "routes.tavily.upstream: environment variable UP is not set",
        "routes.tavily.headers.set.Authorization: environment variable KEY is not set",
    ]


def test_cross_references_are_checked_on_what_parsed() -> None:
    broken = {"prefix": "/a", "upstream": "https://a.example", "timeouts": {"total": "x"}}
    raw = {
        "profiles": {"acme": {"query": [{"json": "q"}]}},  # no results: broken
        "search_api": {"providers": ["a", "b", "nope"]},
        "routes": {
            "a": {**broken, "search": {"vendor": "acme"}},
            "b": {"prefix": "/a", "upstream": "https://b.example", "search": {"vendor": "bing"}},
        },
    }
    assert [e.split(": ")[0] for e in errors_of(raw)] == [
        "profiles.acme.results",  # not again as routes.a.search.vendor
        "routes.a.timeouts.total",  # not again as search_api.providers[0]
        "routes.b.prefix",  # a's prefix parsed, so b's duplicate is found now
        "routes.b.search.vendor",
        "search_api.providers[2]",
    ]


def test_check_config_reports_one_mistake_of_each_kind_in_one_run(tmp_path, capsys) -> None:
    """A repeated key, a bad field, a fallback to no route and a weak admin token: one run,
    each with its YAML path, where each used to hide the next until it was fixed."""
    f = tmp_path / "broken.yaml"
    f.write_text(
        "server:\n"
        "  admin_token: changeme\n"
        "routes:\n"
        "  tavily:\n"
        "    prefix: /tavily\n"
        "    upstream: https://api.tavily.com\n"
        "    search: {vendor: tavily}\n"
        "    retry: {attempts: 99}\n"
        "    fallback: {providers: [exa, bing]}\n"
        "  exa:\n"
        "    prefix: /exa\n"
        "    prefix: /exa2\n"
        "    upstream: https://api.exa.ai\n"
        "    search: {vendor: exa}\n"
    )

    assert cli.main(["check-config", str(f)]) == 2

    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        "search-proxy: config error: routes.exa.prefix: duplicate key (first at line 11)",
        "search-proxy: config error: routes.tavily.retry.attempts: expected a whole number "
        "from 1 to 10, got 99",
        "search-proxy: config error: routes.tavily.fallback.providers[1]: 'bing' is not "
        "another route with a search section",
        "search-proxy: config error: server.admin_token: must be at least 16 visible ASCII "
        "characters without spaces; generate one with `openssl rand -hex 32`",
    ]


# --- check-config prints a config that loads back -------------------------------------------


def check_config_output(path, capsys) -> str:
    assert cli.check_config(str(path)) == 0
    return capsys.readouterr().out


EVERY_SECTION = {
    "server": {
        "host": "0.0.0.0",
        "port": 9000,
        "max_body_bytes": "2MiB",
        "shutdown_grace": "250ms",
        "upstream_connections": 10,
        "upstream_connections_per_host": 0,
        "keepalive_timeout": "1m",
    },
    "redis": {"url": "redis://127.0.0.1:6390/2", "key_prefix": "sp", "timeout": "50ms"},
    "log": {"level": "debug", "format": "console"},
    "search_api": {
        "providers": ["b", "a"],
        "max_results": 7,
        "blocked_domains": ["spam.example"],
        "blocked_extensions": [".pdf", ".zip"],
        "max_batch": 10,
        "max_providers": 1,
        "max_calls_per_request": 30,
    },
    "routes": {
        "a": {
            "prefix": "/a",
            "upstream": "https://a.example/base",
            "strip_prefix": False,
            "timeouts": {"connect": "1s", "per_try": "2.5s", "total": "1h"},
            "headers": {"set": {"X-Plan": "free"}, "remove": ["X-Debug"]},
            "retry": {
                "attempts": 5,
                "on": [429, "5xx", 418, "timeout", "connect_error"],
                "backoff": {"initial": "10ms", "max": "2s", "multiplier": 1.5, "jitter": "none"},
                "retry_after": {"honor": False, "max_wait": "3s"},
                "budget": {"ratio": 0.5, "min_per_s": 0},
                "methods": ["get", "PUT"],
            },
            "rate_limit": {
                "rate": "100/m",
                "burst": 3,
                "key": "client",
                "client_header": "X-Client",
                "max_wait": 0,
            },
            "breaker": {
                "fail_max": 2,
                "reset_timeout": "5s",
                "success_threshold": 2,
                "half_open_probes": 3,
            },
            "cache": {
                "ttl": "10m",
                "stale_ttl": "24h",
                "max_entry_bytes": "512KiB",
                "methods": ["POST"],
                "ignore_body_fields": ["request_id"],
                "shared": True,
                "max_entries": 5,
                "max_bytes": "1GB",
                "lock_wait": "0s",
                "vary": ["X-Tenant"],
            },
            "search": {
                "vendor": "acme",
                "on_empty": "pass",
                "max_variants": 0,
                "max_query_chars": 10,
                "loop_guard": 0,
            },
        },
        "b": {
            "prefix": "/b",
            "upstream": "http://127.0.0.1:1",
            "retry": {"on": [502, "reset"]},
            "rate_limit": {"rate": "0.036/h", "burst": 1},
            "search": {"vendor": "tavily"},
            "hedge": {
                "after": "auto",
                "percentile": 0.9,
                "max_extra": 2,
                "budget": {"ratio": 0.1, "min_per_s": 0},
                "to": "same",
                "methods": ["GET", "POST"],
            },
        },
        "c": {
            "prefix": "/c",
            "upstream": "http://127.0.0.1:2",
            "retry": {"on": []},
            "rate_limit": {"rate": "2.5/s", "burst": 1},
            "search": {"vendor": "tavily2"},
            "hedge": {"after": "150ms"},
        },
    },
    "profiles": {
        "acme": {
            "query": [{"json": "params.q"}, {"query": "q"}, {"path": "/find/"}],
            "results": ["data.items", ""],
            "url": ["link", "url"],
            "title": "headline",
            "snippet": "body",
            "missing_results_is_empty": True,
            "non_json_ok": True,
            "empty_when_body_field": "nothing",
            "empty_status_codes": {404: ["NONE"]},
            "terminal_statuses": [402, 403],
            "terminal_body_codes": {"429": "QUOTA"},
            "error_code_paths": ["error.code", "code"],
            "ratelimit_headers": True,
            "search_method": "GET",
            "search_path": "/api/search",
            "max_results_field": "size",
            "max_results_cap": 50,
            "search_extra": {"lang": "en", "deep": {"x": [1, 2]}},
            "search_headers": {"Accept": "application/json"},
        },
        "tavily2": {"extends": "tavily", "terminal_statuses": [400]},
        "serper": {"extends": "serper", "search_path": None},  # a built-in, changed
        "exa": {"extends": "exa"},  # the built-in itself: not printed
    },
}


def test_check_config_output_is_the_same_config_for_every_section(tmp_path, capsys) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(EVERY_SECTION))
    original = load_config(f, env={})
    out = check_config_output(f, capsys)
    shown = yaml.safe_load(out)
    # Every headers.set value prints as a placeholder, whatever its name; nothing else does.
    assert shown["routes"]["a"]["headers"]["set"] == {"X-Plan": REDACTED}
    shown["routes"]["a"]["headers"]["set"] = {"X-Plan": "free"}
    assert REDACTED not in yaml.safe_dump(shown)
    assert parse_config(shown, {}) == original
    assert "'on':" in out and "rate: 100/m" in out  # `on` quoted: YAML 1.1 reads on as true
    assert set(yaml.safe_load(out)["profiles"]) == {"acme", "tavily2", "serper"}


def test_check_config_output_of_the_shipped_config_loads_back(capsys, monkeypatch) -> None:
    text = (ROOT / "config.yaml").read_text()
    env = {name: f"value-of-{name}" for name, _ in re.findall(r"\$\{(\w+)(:-[^}]*)?\}", text)}
    if "SEARCH_PROXY_ADMIN_TOKEN" in env:  # a generated one: a placeholder would be refused
        env["SEARCH_PROXY_ADMIN_TOKEN"] = "op-9e4b1d7f3a2c8e6b05"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    original = load_config(ROOT / "config.yaml", env=env)
    reloaded = parse_config(yaml.safe_load(check_config_output(ROOT / "config.yaml", capsys)), {})
    assert reloaded == parse_config(redacted(original), {})  # secrets, if any, as placeholders
    assert parse_config(as_document(original), {}) == original


def test_secrets_print_as_placeholders_that_load_back(tmp_path, capsys) -> None:
    raw = minimal(headers={"set": {"Authorization": "Bearer sk-1", "X-Other": "plain"}})
    raw["server"] = {"admin_token": "op-2-9c4e1f7a3b8d2e6f"}
    raw["redis"] = {"url": "redis://:hunter3@127.0.0.1:6379/0"}
    raw["profiles"] = {
        "acme": {
            "extends": "serpapi",
            "search_headers": {"X-API-KEY": "k-4"},
            "search_extra": {"api_key": "k-5", "engine": "bing"},
        }
    }
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(raw))
    out = check_config_output(f, capsys)
    for secret in ("sk-1", "tok-2", "hunter3", "k-4", "k-5"):
        assert secret not in out
    placeholders = minimal(headers={"set": {"Authorization": REDACTED, "X-Other": REDACTED}})
    placeholders["server"] = {"admin_token": REDACTED}
    placeholders["redis"] = {"url": f"redis://:{REDACTED}@127.0.0.1:6379/0"}
    placeholders["profiles"] = {
        "acme": {
            "extends": "serpapi",
            "search_headers": {"X-API-KEY": REDACTED},
            "search_extra": {"api_key": REDACTED, "engine": "bing"},
        }
    }
    assert parse_config(yaml.safe_load(out), {}) == parse_config(placeholders, {})

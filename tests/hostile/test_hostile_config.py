"""Hostile configs: each one the proxy once accepted and then crashed on at start-up, or crashed
reading, is refused by `check-config` and by serving alike, one line per mistake naming its YAML
path, exit 2, before anything listens (issue 14, item 5). The limits behind them are unit tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from policies.retry import BackoffConfig, RetryConfig
from proxy.cli import main
from proxy.config import (
    MAX_CONFIG_BYTES,
    MAX_DEPTH,
    ConfigError,
    ConfigErrors,
    load_config,
    parse_config,
    parse_size,
)
from proxy.startup import check_startup
from testkit.procs import ROOT

SEARCH_PROXY = Path(sys.executable).parent / "search-proxy"
PREFIX = "search-proxy: config error: "
ROUTE = "  a:\n    prefix: /a\n    upstream: http://127.0.0.1:9\n"

# The cases issue 14 found: name -> (file bytes, environment, what the one error line says).
CASES: dict[str, tuple[bytes, dict[str, str], str]] = {
    "upstream port 99999": (
        b"routes:\n  a:\n    prefix: /a\n    upstream: http://127.0.0.1:99999\n",
        {},
        "routes.a.upstream: not a usable URL (Port out of range 0-65535)",
    ),
    "server.port 70000": (
        b"server: {port: 70000}\nroutes:\n" + ROUTE.encode(),
        {},
        "server.port: expected a whole number from 0 to 65535, got 70000",
    ),
    "backoff initial above max": (
        b"routes:\n" + ROUTE.encode() + b"    retry: {backoff: {initial: 5s, max: 1s}}\n",
        {},
        "routes.a.retry.backoff.max: must be at least backoff.initial (5s)",
    ),
    "route name a bare number": (
        b"routes:\n  123:\n    prefix: /a\n    upstream: http://127.0.0.1:9\n",
        {},
        'routes.123: a route name must be a string: quote it, as in "123":',
    ),
    "not UTF-8": (
        b"routes:\n" + ROUTE.encode() + b"# caf\xe9\n",
        {},
        "is not UTF-8 text: byte 0xe9 on line 5",
    ),
    "unclosed IPv6 upstream": (
        b'routes:\n  a:\n    prefix: /a\n    upstream: "http://[::1"\n',
        {},
        "routes.a.upstream: not a usable URL (Invalid IPv6 URL)",
    ),
    "5,000 nested lists": (
        b"routes: " + b"[" * 5000 + b"]" * 5000 + b"\n",
        {},
        f"nested deeper than {MAX_DEPTH} levels",
    ),
    "duplicate route": (
        b"routes:\n" + ROUTE.encode() + b"  a:\n    prefix: /b\n    upstream: http://other\n",
        {},
        "routes.a: duplicate key (first at line 2)",
    ),
    "${PORT} that is not a number": (
        b"server:\n  port: ${PORT}\nroutes:\n" + ROUTE.encode(),
        {"PORT": "80a"},
        "server.port: expected a whole number from 0 to 65535, got '80a'",
    ),
    "prefix with a space and a query": (
        b'routes:\n  a:\n    prefix: "/a b?x"\n    upstream: http://127.0.0.1:9\n',
        {},
        "routes.a.prefix: ' ', '?' cannot appear in a path prefix",
    ),
}
# Files that are no config at all, the same way in process (each process spends ~0.4 s
# importing): name -> (file bytes, or None for no file, or "dir"; what the error line says).
DOCUMENTS: dict[str, tuple[bytes | str | None, str]] = {
    "alias bomb": (
        b"a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + b"".join(
            f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n".encode()
            for p, n in zip("abcdefg", "bcdefgh", strict=True)
        )
        + b"routes:\n"
        + ROUTE.encode(),
        "more than 100000 values once aliases expand",
    ),
    "alias inside itself": (
        b"x: &x [*x]\nroutes:\n" + ROUTE.encode(),
        f"nested deeper than {MAX_DEPTH} levels once aliases expand",
    ),
    "unparseable YAML": (b"routes:\n  a: [unclosed\n", "is not valid YAML at line 3"),
    "missing file": (None, "cannot read config"),
    "over 1 MiB": (b"#" * (MAX_CONFIG_BYTES + 1), f"is larger than {MAX_CONFIG_BYTES} bytes"),
    "a directory": ("dir", "cannot read config"),
    "a NUL byte": (
        b"routes:\n" + ROUTE.encode() + b"# \x00\n",
        "is not valid YAML at line 5: special characters are not allowed (#x0000)",
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    """Every case through both commands, a few processes at a time."""
    tmp = tmp_path_factory.mktemp("hostile-configs")
    jobs = []
    for i, (name, (content, env, _)) in enumerate(CASES.items()):
        path = tmp / f"case{i}.yaml"
        path.write_bytes(content)
        for mode in ("check-config", "--config"):
            jobs.append((name, mode, [str(SEARCH_PROXY), mode, str(path)], env))

    def run(job: tuple[str, str, list[str], dict[str, str]]) -> subprocess.CompletedProcess[str]:
        _, _, argv, env = job
        return subprocess.run(
            argv,
            cwd=ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=20,  # a config that slipped through would serve until killed here
        )

    with ThreadPoolExecutor(max_workers=4) as pool:
        done = list(pool.map(run, jobs))
    return {(name, mode): result for (name, mode, _, _), result in zip(jobs, done, strict=True)}


@pytest.mark.parametrize("mode", ["check-config", "--config"])
@pytest.mark.parametrize("name", list(CASES))
def test_hostile_config_exits_2_with_one_line_before_listening(
    runs: dict[tuple[str, str], Any], name: str, mode: str
) -> None:
    result = runs[name, mode]
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1, lines
    assert lines[0].startswith(PREFIX)
    assert CASES[name][2] in lines[0]
    # The exit comes from loading the config, before serve() opens a socket and logs it.
    assert "listening" not in result.stdout + result.stderr


@pytest.mark.unit
@pytest.mark.parametrize("name", list(DOCUMENTS))
def test_no_config_at_all_is_one_line_and_exit_2(tmp_path: Path, capsys: Any, name: str) -> None:
    content, message = DOCUMENTS[name]
    f = tmp_path / "c.yaml"
    if content == "dir":
        f.mkdir()
    elif isinstance(content, bytes):
        f.write_bytes(content)
    for argv in (["check-config", str(f)], ["--config", str(f)]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and err.startswith(PREFIX), err
        assert message in err
        assert "listening" not in out


@pytest.mark.unit
def test_unreadable_file_is_one_line_and_exit_2(tmp_path: Path, capsys: Any) -> None:
    f = tmp_path / "secret.yaml"
    f.write_text("routes: {}\n")
    f.chmod(0)
    expected = f"{PREFIX}cannot read config {f}: Permission denied\n"
    for argv in (["check-config", str(f)], ["--config", str(f)]):
        if os.geteuid() != 0:
            assert main(argv) == 2
            assert capsys.readouterr().err == expected
            continue
        # Root reads a file whatever its mode: run the CLI in a child that drops to nobody.
        code, err = _as_nobody(main, argv)
        assert code == 2 and err == expected, err


def _as_nobody(fn: Any, argv: list[str]) -> tuple[int, str]:
    """fn(argv) in a forked child running as uid/gid 65534: (exit code, what it wrote to stderr)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            sys.stderr = os.fdopen(write_end, "w")
            code = fn(argv)
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        err = pipe.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), err


@pytest.mark.unit
def test_env_var_feeds_typed_fields(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "server:\n  port: ${PORT}\n  shutdown_grace: ${GRACE}\nroutes:\n" + ROUTE + "    "
        "strip_prefix: ${STRIP}\n    retry: {attempts: '${N}', backoff: {multiplier: '${M}'}}\n"
    )
    env = {"PORT": "8080", "GRACE": "2.5", "STRIP": "false", "N": "4", "M": "1.5"}
    config = load_config(f, env=env)
    assert config.server.port == 8080
    assert config.server.shutdown_grace == 2.5
    route = config.routes["a"]
    assert route.strip_prefix is False
    assert route.section("retry") is not None
    assert (route.section("retry").attempts, route.section("retry").backoff.multiplier) == (4, 1.5)
    with pytest.raises(ConfigError, match=r"^routes\.a\.strip_prefix: expected true or false"):
        load_config(f, env={**env, "STRIP": "no"})


def _route(**body: Any) -> dict[str, Any]:
    return {"routes": {"a": {"prefix": "/a", "upstream": "http://127.0.0.1:9", **body}}}


def _error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(raw, {})
    return str(info.value)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"server": {"port": -1}, **_route()}, "server.port: expected a whole number from 0"),
        ({"server": {"host": "a b"}, **_route()}, "server.host: expected a host name or an IP"),
        (_route(upstream="http://h:0"), "routes.a.upstream: the port must be from 1 to 65535"),
        (_route(upstream="http://h:x"), "routes.a.upstream: not a usable URL (Port could not"),
        (_route(upstream="http://a b"), "routes.a.upstream: 'a b' is not a host name"),
        (_route(upstream="http://münchen.de"), "routes.a.upstream: 'münchen.de' is not a host"),
        (_route(timeouts={"connect": 0}), "routes.a.timeouts.connect: expected a duration above 0"),
        (_route(timeouts={"per_try": "0s"}), "routes.a.timeouts.per_try: expected a duration ab"),
        (
            _route(timeouts={"total": float("inf")}),
            "routes.a.timeouts.total: expected a duration from",
        ),
        (_route(timeouts={"total": float("nan")}), "routes.a.timeouts.total: expected a duration"),
        (_route(timeouts={"total": 10**400}), "routes.a.timeouts.total: expected a duration from"),
        (_route(retry={"attempts": 11}), "routes.a.retry.attempts: expected a whole number from 1"),
        (
            _route(retry={"backoff": {"initial": "10s"}}),
            "routes.a.retry.backoff.initial: must be at most backoff.max (5s, the default)",
        ),
        (_route(retry={"backoff": {"initial": 0}}), "routes.a.retry.backoff.initial: expected a"),
        (
            _route(retry={"backoff": {"multiplier": 0.5}}),
            "routes.a.retry.backoff.multiplier: expected a number from 1.0 to 100.0",
        ),
        (
            _route(retry={"backoff": {"multiplier": float("inf")}}),
            "routes.a.retry.backoff.multiplier: expected a number from 1.0",
        ),
        (
            _route(retry={"budget": {"ratio": float("inf")}}),
            "routes.a.retry.budget.ratio: expected a number from 0.0 to 1.0",
        ),
        (_route(rate_limit={"rate": "1/s", "burst": 0}), "routes.a.rate_limit.burst: expected"),
        (_route(rate_limit={"rate": "1/s", "burst": 10**7}), "routes.a.rate_limit.burst: expect"),
        (_route(rate_limit={"rate": "1" * 400 + "/s", "burst": 1}), "routes.a.rate_limit.rate:"),
        (_route(breaker={"reset_timeout": 0}), "routes.a.breaker.reset_timeout: expected a durat"),
        (_route(breaker={"reset_timeout": "25h"}), "routes.a.breaker.reset_timeout: expected a d"),
        (_route(breaker={"half_open_probes": 101}), "routes.a.breaker.half_open_probes: expected"),
        (_route(cache={"ttl": 0}), "routes.a.cache.ttl: expected a duration above 0"),
        (_route(cache={"max_entry_bytes": 0}), "routes.a.cache.max_entry_bytes: must be at least"),
        (
            _route(cache={"max_entry_bytes": "2MiB", "max_bytes": "1MiB"}),
            "routes.a.cache.max_entry_bytes: must not exceed max_bytes (1048576 bytes)",
        ),
        (
            _route(cache={"max_bytes": "512KiB"}),
            "routes.a.cache.max_bytes: must be at least max_entry_bytes (1048576 bytes, the def",
        ),
        ({"redis": {"url": "redis://[::1"}, **_route()}, "redis.url: Invalid IPv6 URL"),
        ({"redis": {"url": "redis://h:99999"}, **_route()}, "redis.url: Port out of range"),
        ({"redis": {"url": "redis://h:0"}, **_route()}, "redis.url: port must be from 1 to"),
        ({"redis": {"timeout": 0}, **_route()}, "redis.timeout: expected a duration above 0"),
        (
            {"routes": {"A": _route()["routes"]["a"]}},
            "routes.A: a route name is 1-63 lower-case letters, digits, - and _, starting",
        ),
        ({"routes": {"-a": _route()["routes"]["a"]}}, "routes.-a: a route name is 1-63"),
        ({"routes": {True: _route()["routes"]["a"]}}, "routes.True: a route name must be a str"),
        (_route(prefix="/ünï"), "routes.a.prefix: 'ï', 'ü' cannot appear in a path prefix"),
        (_route(prefix="/a#b"), "routes.a.prefix: '#' cannot appear"),
        (_route(prefix="/a\tb"), "routes.a.prefix: '\\t' cannot appear"),
        (_route(headers={"set": {1: "x"}}), "routes.a.headers.set.1: not a valid header name"),
        (_route(headers={"set": {"X-A": "a\x00b"}}), "routes.a.headers.set.X-A: expected a one-"),
        (
            {"profiles": {7: {"extends": "tavily"}}, **_route()},
            'profiles.7: a profile name must be a string: quote it, as in "7":',
        ),
    ],
)
def test_out_of_range_value_is_refused_naming_its_path(raw: dict[str, Any], message: str) -> None:
    assert _error(raw).startswith(message)


@pytest.mark.unit
def test_values_at_the_edges_are_accepted() -> None:
    raw = {
        "server": {"host": "::", "port": 65535},
        "redis": {"url": "redis://[::1]:6379/0"},
        "routes": {
            "123": {
                "prefix": "/v1:search@x/a-b_c.d~e!$&'()*+,;=",
                "upstream": "http://[::1]:65535/base",
                "retry": {"attempts": 10, "backoff": {"initial": "1s", "max": "1s"}},
                "cache": {"max_entry_bytes": "1MiB", "max_bytes": "1MiB", "lock_wait": 0},
                "rate_limit": {"rate": "1/h", "burst": 1_000_000, "max_wait": 0},
                "search": {"vendor": "tavily", "loop_guard": 0},
            },
            "b_2": {"prefix": "/b", "upstream": "https://xn--mnchen-3ya.de"},
        },
    }
    config = parse_config(raw, {})
    assert set(config.routes) == {"123", "b_2"}
    assert parse_size("1" + "0" * 400 + "B", "p") == 10**400  # no float overflow


@pytest.mark.unit
async def test_quoted_number_route_name_builds_as_start_up_builds_it() -> None:
    raw = _route(retry={}, rate_limit={"rate": "1/s", "burst": 1}, breaker={}, cache={})
    raw["routes"] = {"123": raw["routes"]["a"]}
    await check_startup(parse_config(raw, {}))


@pytest.mark.unit
async def test_start_up_refusal_the_parser_missed_is_a_config_error() -> None:
    """The backstop: a constructor's ValueError names the route, whatever let the value in."""
    config = parse_config(_route(), {})
    bad = RetryConfig(backoff=BackoffConfig(initial=5.0, max=1.0))
    route = config.routes["a"]
    routes = {"a": replace(route, sections={**route.sections, "retry": bad})}
    with pytest.raises(ConfigErrors) as info:
        await check_startup(replace(config, routes=routes))
    assert (
        str(info.value) == "routes.a: start-up cannot build it: max (1.0) must be >= initial (5.0)"
    )


@pytest.mark.unit
async def test_redis_url_the_client_refuses_is_a_config_error() -> None:
    raw = {"redis": {"url": "redis://127.0.0.1:1/0?socket_timeout=soon"}, **_route(breaker={})}
    with pytest.raises(ConfigErrors, match=r"^redis\.url: start-up cannot use it: Invalid value"):
        await check_startup(parse_config(raw, {}))


@pytest.mark.unit
def test_a_document_yaml_cannot_read_is_one_config_error(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("x: !!timestamp 2024-02-30\n")
    with pytest.raises(ConfigError) as info:
        load_config(f, env={})
    assert "is not valid YAML: day is out of range for month" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "errors"),
    [
        (
            "routes:\n  a: {prefix: /a, prefix: /b}\n",
            [
                "routes.a.prefix: duplicate key (first at line 2)",
                "routes.a.upstream: required key is missing",
            ],
        ),
        (
            "server: {}\nserver: {}\nroutes: {}\n",
            [
                "server: duplicate key (first at line 1)",
                "routes: expected a mapping of at least one route",
            ],
        ),
        (
            "routes:\n  1: x\n  true: y\n",
            [
                "routes.True: duplicate key (first at line 2)",
                'routes.1: a route name must be a string: quote it, as in "1":',
            ],
        ),
    ],
)
def test_a_repeated_key_is_reported_with_the_rest_of_the_document(
    tmp_path: Path, text: str, errors: list[str]
) -> None:
    """YAML keeps the last of a repeated key; the document is still checked as YAML read it."""
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigErrors) as info:
        load_config(f, env={})
    assert [str(e) for e in info.value.errors][: len(errors)] == errors


@pytest.mark.unit
def test_merge_keys_override_without_counting_as_duplicates(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "base: &base {prefix: /a, upstream: 'http://127.0.0.1:9'}\n"
        "routes:\n  a:\n    <<: *base\n    prefix: /b\n"
    )
    with pytest.raises(ConfigError, match=r"^base: unknown key"):
        load_config(f, env={})  # parsed (not refused as a duplicate); `base` is not ours
    f.write_text("routes:\n  a:\n    <<: {prefix: /a, upstream: 'http://h'}\n    prefix: /b\n")
    assert load_config(f, env={}).routes["a"].prefix == "/b"


@pytest.mark.unit
def test_dates_stay_strings(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "profiles:\n  p: {extends: tavily, search_extra: {since: 2024-01-01}}\nroutes:\n" + ROUTE
    )
    assert load_config(f, env={}).profiles["p"].search_extra == {"since": "2024-01-01"}


@pytest.mark.unit
def test_each_error_prints_on_one_line(tmp_path: Path, capsys: Any) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        'routes:\n  a:\n    prefix: /a\n    upstream: http://h\n    timeouts: {total: "1\\n2"}\n'
    )
    assert main(["check-config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err == f'{PREFIX}routes.a.timeouts.total: expected a duration like 10s, got "1\\n2"\n'


@pytest.mark.unit
@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_port_flag_out_of_range_is_a_usage_error(port: str, capsys: Any) -> None:
    assert main(["--port", port, "--config", "config.yaml"]) == 2
    assert "expected a port from 0 to 65535" in capsys.readouterr().err

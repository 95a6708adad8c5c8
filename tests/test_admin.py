"""Admin endpoints: their own listener, who may call them, cache purge and breaker state/reset."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import yaml

from proxy.admin import TOKEN_ENV, admin_token, authorize
from proxy.config import ConfigError, ServerConfig
from proxy.errors import Forbidden, Unauthorized
from testkit.procs import ROOT
from testkit.proxyprocess import ProxyProcess
from tests.conftest import route

TOKEN = "op-4e9b2c7f1a8d3e6b"
CHANGE = {"X-Requested-By": "test"}  # what a call that changes something needs without a token


def test_without_a_token_only_loopback_callers_are_admitted():
    authorize("127.0.0.1", "", None)
    authorize("::1", "", None)
    for remote in ("10.0.0.7", "192.168.1.2", None, "not-an-ip"):
        with pytest.raises(Unauthorized, match="loopback callers only"):
            authorize(remote, "", None)


def test_without_a_token_the_caller_must_be_the_listeners_own():
    ok = {"host": "127.0.0.1:8081"}
    authorize("127.0.0.1", "", None, **ok)
    authorize(
        "127.0.0.1", "", None, host="admin.internal:8081", names=frozenset({"admin.internal"})
    )
    authorize("127.0.0.1", "", None, origin="http://127.0.0.1:8081", **ok)  # its own page
    authorize("127.0.0.1", "", None, method="POST", content_type="application/json", **ok)
    authorize("127.0.0.1", "", None, method="DELETE", requested_by=True, **ok)
    refused = [
        {"host": "attacker.example:8081"},  # DNS rebinding
        {"origin": "http://evil.example", **ok},  # another site
        {"origin": "http://127.0.0.1:8080", **ok},  # another port: another origin
        {"origin": "null", **ok},  # a sandboxed page, a file
        {"method": "POST", "content_type": "text/plain", **ok},  # a simple cross-site form
        {"method": "DELETE", **ok},
    ]
    for call in refused:
        with pytest.raises(Forbidden):
            authorize("127.0.0.1", "", None, **call)


def test_with_a_token_everyone_needs_it():
    authorize("10.0.0.7", "Bearer s3cret", "s3cret")
    # "\udcff": a byte that was not UTF-8, as aiohttp's parser reads it (surrogateescape).
    for remote, header in (
        ("127.0.0.1", ""),
        ("10.0.0.7", "Bearer wrong"),
        ("::1", "s3cre"),
        ("10.0.0.7", "Bearer s3cret\udcff"),
    ):
        with pytest.raises(Unauthorized, match="admin_token"):
            authorize(remote, header, "s3cret")


def cached_route(vendor, **extra):
    return route(vendor.url + "/tavily", "/tavily", cache={"ttl": "10m"}, **extra)


async def test_cache_purge(vendor, start_proxy, admin_of):
    client = await start_proxy({"routes": {"tavily": cached_route(vendor)}})
    admin = await admin_of(client)
    await client.post("/tavily/search", json={"query": "purge me"})
    r = await admin.delete("/admin/cache/tavily", headers=CHANGE)
    assert r.status == 200
    assert await r.json() == {"route": "tavily", "local": 1, "shared": None}
    again = await client.post("/tavily/search", json={"query": "purge me"})
    assert again.headers["X-Cache"] == "MISS" and vendor.count() == 2


async def test_admin_token_is_enforced_over_http(vendor, start_proxy, admin_of):
    raw = {"server": {"admin_token": "${ADMIN}"}, "routes": {"tavily": cached_route(vendor)}}
    admin = await admin_of(await start_proxy(raw, env={"ADMIN": TOKEN}))
    r = await admin.delete("/admin/cache/tavily", headers=CHANGE)
    assert r.status == 401
    assert (await r.json())["error"]["type"] == "unauthorized"
    ok = await admin.delete("/admin/cache/tavily", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status == 200


async def test_unknown_route_is_a_json_404(vendor, start_proxy, admin_of):
    client = await start_proxy({"routes": {"tavily": cached_route(vendor)}})
    r = await (await admin_of(client)).delete("/admin/cache/nope", headers=CHANGE)
    assert r.status == 404
    assert "routes with one: ['tavily']" in (await r.json())["error"]["message"]


async def test_the_agents_port_serves_no_admin_endpoint_and_says_where_they_are(
    vendor, start_proxy
):
    client = await start_proxy({"routes": {"tavily": cached_route(vendor)}})
    await client.post("/tavily/search", json={"query": "keep me"})
    for method, path in (
        ("GET", "/admin/breakers"),
        ("POST", "/admin/breakers/tavily/reset"),
        ("DELETE", "/admin/cache/tavily"),
        ("GET", "/admin"),
    ):
        r = await client.request(method, path)
        assert r.status == 404, path
        assert "server.admin_port" in (await r.json())["error"]["message"]
    again = await client.post("/tavily/search", json={"query": "keep me"})
    assert again.headers["X-Cache"] == "HIT" and vendor.count() == 1  # nothing was purged


def test_admin_off_loopback_needs_a_token():
    assert admin_token(ServerConfig(), {}) is None  # 127.0.0.1: loopback callers only
    assert admin_token(ServerConfig(admin_host="::1"), {}) is None
    for host in ("0.0.0.0", "10.0.0.7", "::", "proxy.internal"):
        with pytest.raises(ConfigError, match=r"server\.admin_host: .* not a loopback address"):
            admin_token(ServerConfig(admin_host=host), {})
        assert admin_token(ServerConfig(admin_host=host, admin_token=TOKEN), {}) == TOKEN
        assert admin_token(ServerConfig(admin_host=host), {TOKEN_ENV: TOKEN}) == TOKEN


@pytest.mark.parametrize(
    "weak", ["change-me", "tok-1", "<generate: openssl rand -hex 32>", " " * 20]
)
def test_a_weak_or_placeholder_admin_token_is_refused_without_being_quoted(weak):
    for server, env, path in (
        (ServerConfig(admin_token=weak), {}, "server.admin_token"),
        (ServerConfig(), {TOKEN_ENV: weak}, TOKEN_ENV),
    ):
        with pytest.raises(ConfigError) as caught:
            admin_token(server, env)
        assert str(caught.value).startswith(f"{path}: must be at least 16 visible ASCII")
        assert weak not in str(caught.value)


@pytest.mark.e2e
def test_admin_on_a_non_loopback_address_without_a_token_refuses_to_start(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": {"admin_host": "0.0.0.0"},
                "routes": {"tavily": route("http://127.0.0.1:9/tavily", "/tavily")},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    for args in (["--config", str(config), "--port", "0", "--admin-port", "0"],
                 ["check-config", str(config)]):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "proxy", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.startswith(
            "search-proxy: config error: server.admin_host: 0.0.0.0 is not a loopback address "
            "and no admin token is set"
        ), done.stderr
        assert "listening" not in done.stdout
    # With a token it serves, the admin endpoints on their own port.
    with ProxyProcess(yaml.safe_load(config.read_text()), env={TOKEN_ENV: TOKEN}) as proxy:
        assert proxy.admin_port not in (None, proxy.port)
        with urllib.request.urlopen(
            urllib.request.Request(
                f"{proxy.admin_url}/admin/breakers", headers={"Authorization": f"Bearer {TOKEN}"}
            ),
            timeout=5,
        ) as answer:
            assert json.loads(answer.read()) == {"breakers": {}}


def get_json(url: str) -> tuple[int, dict]:
    """The status and JSON body of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.e2e
def test_each_listeners_404_names_the_other_listeners_real_address(vendor):
    """With both ports chosen at start-up (0), the agents' port names where the admin endpoints
    really are, and the admin listener lists its endpoints and names the agents' port."""
    with ProxyProcess({"routes": {"tavily": cached_route(vendor)}}) as proxy:
        status, body = get_json(f"{proxy.url}/admin/breakers")
        assert status == 404
        assert f"at 127.0.0.1:{proxy.admin_port} (server.admin_host" in body["error"]["message"]

        status, body = get_json(f"{proxy.admin_url}/tavily/search")
        assert status == 404 and body["error"]["type"] == "no_route"
        message = body["error"]["message"]
        assert message.startswith("'/tavily/search' is not an admin endpoint; this listener serves")
        for endpoint in (
            "GET /admin/breakers",
            "POST /admin/breakers/{route}/reset",
            "DELETE /admin/cache/{route}",
        ):
            assert endpoint in message
        assert message.endswith(f"go to 127.0.0.1:{proxy.port}")
        assert "send requests to a route prefix" not in message


@pytest.mark.e2e
@pytest.mark.parametrize("taken", ["--port", "--admin-port"])
def test_a_port_in_use_names_the_listener_and_the_flag_and_key_to_move_it(tmp_path, taken):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"routes": {"tavily": route("http://127.0.0.1:9/t", "/t")}}))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        ports = {"--port": "0", "--admin-port": "0", taken: str(port)}
        done = subprocess.run(
            [sys.executable, "-m", "proxy", "--config", str(config)]
            + [a for flag, value in ports.items() for a in (flag, value)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 1, done.stdout + done.stderr
    if taken == "--admin-port":
        expected = (
            f"search-proxy: cannot listen on 127.0.0.1:{port} for the admin endpoints: Address "
            "already in use; choose another port with --admin-port or server.admin_port "
            "(make run ADMIN_PORT=...; 0 = any free port)"
        )
    else:
        expected = (
            f"search-proxy: cannot listen on 127.0.0.1:{port}: Address already in use; choose "
            "another port with --port or server.port (make run PORT=...)"
        )
    assert done.stderr.splitlines()[-1] == expected

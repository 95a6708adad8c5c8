"""Admin endpoints: who may call them, cache purge and breaker state/reset."""

from __future__ import annotations

import pytest

from proxy.admin import authorize
from proxy.errors import Unauthorized
from tests.conftest import route


def test_without_a_token_only_loopback_callers_are_admitted():
    authorize("127.0.0.1", "", None)
    authorize("::1", "", None)
    for remote in ("10.0.0.7", "192.168.1.2", None, "not-an-ip"):
        with pytest.raises(Unauthorized, match="loopback callers only"):
            authorize(remote, "", None)


def test_with_a_token_everyone_needs_it():
    authorize("10.0.0.7", "Bearer s3cret", "s3cret")
    for remote, header in (("127.0.0.1", ""), ("10.0.0.7", "Bearer wrong"), ("::1", "s3cre")):
        with pytest.raises(Unauthorized, match="admin_token"):
            authorize(remote, header, "s3cret")


def cached_route(vendor, **extra):
    return route(vendor.url + "/tavily", "/tavily", cache={"ttl": "10m"}, **extra)


async def test_cache_purge(vendor, start_proxy):
    client = await start_proxy({"routes": {"tavily": cached_route(vendor)}})
    await client.post("/tavily/search", json={"query": "purge me"})
    r = await client.delete("/admin/cache/tavily")
    assert r.status == 200
    assert await r.json() == {"route": "tavily", "local": 1, "shared": None}
    again = await client.post("/tavily/search", json={"query": "purge me"})
    assert again.headers["X-Cache"] == "MISS" and vendor.count() == 2


async def test_admin_token_is_enforced_over_http(vendor, start_proxy):
    raw = {"server": {"admin_token": "${ADMIN}"}, "routes": {"tavily": cached_route(vendor)}}
    client = await start_proxy(raw, env={"ADMIN": "tok-1"})
    r = await client.delete("/admin/cache/tavily")
    assert r.status == 401
    assert (await r.json())["error"]["type"] == "unauthorized"
    ok = await client.delete("/admin/cache/tavily", headers={"Authorization": "Bearer tok-1"})
    assert ok.status == 200


async def test_unknown_route_is_a_json_404(vendor, start_proxy):
    client = await start_proxy({"routes": {"tavily": cached_route(vendor)}})
    r = await client.delete("/admin/cache/nope")
    assert r.status == 404
    assert "routes with one: ['tavily']" in (await r.json())["error"]["message"]

"""The proxy core end to end: forwarding, headers, streaming, refusals and errors, through a real
proxy in front of the fake vendor on loopback."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import http_parser
from multidict import CIMultiDict

from proxy.state import STATE
from testkit.fakevendor import FakeVendor, Fault, expected_urls
from testkit.procs import ROOT
from tests.conftest import route


def one_route(vendor: FakeVendor, prefix: str = "/v", upstream_path: str = "", **policies):
    return {"routes": {"v": route(vendor.url + upstream_path, prefix, **policies)}}


async def test_path_and_query_are_forwarded_unchanged(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    r = await client.get("/v/echo/a%20b/c?z=1&a=%C3%A9&a=2&empty=")
    assert r.status == 200
    seen = await r.json()
    assert seen["raw_path"] == "/echo/a%20b/c?z=1&a=%C3%A9&a=2&empty="
    assert vendor.count() == 1


async def test_longest_prefix_wins_and_matches_whole_segments(vendor, start_proxy):
    client = await start_proxy(
        {
            "routes": {
                "short": route(vendor.url, "/api"),
                "long": route(vendor.url + "/echo", "/api/echo"),
            }
        }
    )
    r = await client.get("/api/echo/x")
    assert (await r.json())["path"] == "/echo/x"  # long route: its upstream base path + /x
    r = await client.get("/api/echox")
    assert vendor.requests[-1].path == "/echox"  # short route: /echox forwarded as is
    assert r.status == 404  # the vendor's own 404 for /echox, passed through
    r = await client.get("/apix/echo")
    assert r.status == 404


async def test_unknown_path_gets_404_listing_prefixes(vendor, start_proxy):
    client = await start_proxy(
        {"routes": {"a": route(vendor.url, "/tavily"), "b": route(vendor.url, "/brave")}}
    )
    r = await client.get("/nowhere/search")
    assert r.status == 404
    body = await r.json()
    assert body["error"]["type"] == "no_route"
    assert "/brave" in body["error"]["message"] and "/tavily" in body["error"]["message"]
    assert set(body["error"]) == {
        "type",
        "message",
        "route",
        "attempts",
        "upstream_status",
        "retry_after_s",
    }
    assert vendor.count() == 0


async def test_hop_by_hop_headers_stripped_and_forwarding_headers_added(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    r = await client.get(
        "/v/echo",
        headers={
            "Connection": "keep-alive, X-Secret-Hop",
            "X-Secret-Hop": "drop me",
            "Keep-Alive": "timeout=5",
            "TE": "trailers",
            "Proxy-Authorization": "Basic abc",
            "X-Forwarded-For": "10.1.1.1",
            "X-Request-Id": "agent-req-42",
            "Host": "attacker.example",
            "X-Custom": "kept",
        },
    )
    seen = {k.lower(): v for k, v in (await r.json())["headers"].items()}
    for name in ("x-secret-hop", "keep-alive", "te", "proxy-authorization"):
        assert name not in seen, name
    assert seen["host"] == vendor.url.removeprefix("http://")
    assert seen["x-forwarded-for"] == "10.1.1.1, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "http"
    assert seen["x-request-id"] == "agent-req-42"
    assert seen["x-custom"] == "kept"
    assert r.headers["X-Request-Id"] == "agent-req-42"
    assert r.headers["X-Proxy-Attempts"] == "1"


async def test_request_id_generated_when_missing_or_unsafe(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    r1 = await client.get("/v/echo")
    r2 = await client.get("/v/echo", headers={"X-Request-Id": "bad id\twith spaces"})
    ids = {r1.headers["X-Request-Id"], r2.headers["X-Request-Id"]}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)
    assert vendor.requests[0].headers["X-Request-Id"] == r1.headers["X-Request-Id"]


async def test_route_headers_set_and_removed(vendor, start_proxy):
    raw = one_route(
        vendor,
        headers={"set": {"Authorization": "Bearer ${KEY}"}, "remove": ["X-Debug"]},
    )
    client = await start_proxy(raw, env={"KEY": "route-key"})
    await client.get("/v/echo", headers={"Authorization": "Bearer agent", "X-Debug": "1"})
    seen = vendor.last.headers
    assert seen["Authorization"] == "Bearer route-key"
    assert "X-Debug" not in seen


async def test_agent_credentials_pass_through_without_header_rules(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    await client.post("/v/echo", headers={"Authorization": "Bearer agent-key", "X-API-KEY": "k"})
    assert vendor.last.headers["Authorization"] == "Bearer agent-key"
    assert vendor.last.headers["X-API-KEY"] == "k"


async def test_post_body_forwarded_byte_for_byte(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    body = b'{"query":  "caf\xc3\xa9",\n "max_results": 3}'
    r = await client.post("/v/echo", data=body, headers={"Content-Type": "application/json"})
    assert r.status == 200
    assert vendor.last.body == body


async def test_a_compressed_body_goes_on_as_the_proxy_read_it(vendor, start_proxy, caplog):
    client = await start_proxy(one_route(vendor))
    body = b'{"query": "packed"}'
    packed = gzip.compress(body)
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}

    async def chunked(data: bytes) -> AsyncIterator[bytes]:
        yield data[:5]
        yield data[5:]

    # With a length it is passed on as sent, still encoded (proxy/front.py reads it); the fake
    # vendor's server inflates what it gets, as the proxy's own does.
    r = await client.post("/v/echo", data=packed, headers=headers)
    assert r.status == 200
    assert vendor.last.body == body and vendor.last.headers["Content-Encoding"] == "gzip"
    # Chunked, aiohttp's server inflates it: it goes on inflated, no longer labelled gzip.
    r = await client.post("/v/echo", data=chunked(packed), headers=headers)
    assert r.status == 200
    assert vendor.last.body == body and "Content-Encoding" not in vendor.last.headers
    # Given twice, what goes on follows what aiohttp's parser did (its C parser decodes by the
    # last, its pure-Python one by the first): inflated and unlabelled, or as sent and labelled.
    by = -1 if http_parser.HttpRequestParser.__module__ == "aiohttp._http_parser" else 0
    for encodings in (["identity", "gzip"], ["gzip", "identity"]):
        twice = [("Content-Type", "application/json")]
        twice += [("Content-Encoding", e) for e in encodings]
        sending = packed if encodings[by] == "gzip" else body
        r = await client.post("/v/echo", data=chunked(sending), headers=CIMultiDict(twice))
        assert r.status == 200 and vendor.last.body == body, encodings
        sent_on = vendor.last.headers.getall("Content-Encoding", [])
        assert sent_on == ([] if encodings[by] == "gzip" else encodings), encodings
    # One that does not inflate is the agent's mistake, said in JSON (it was a 500, and two
    # tracebacks in the log).
    r = await client.post("/v/echo", data=chunked(b"not gzip at all"), headers=headers)
    error = (await r.json())["error"]
    assert r.status == 400 and error["type"] == "bad_request"
    assert "cannot be read as sent" in error["message"]
    assert vendor.last.body == body  # never sent on
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_compressed_body_goes_on_as_the_pure_python_parser_read_it() -> None:
    # The test above, in an interpreter whose aiohttp runs without its C extensions: its
    # pure-Python parser decodes by the first Content-Encoding given, not the last.
    test = f"{__file__}::test_a_compressed_body_goes_on_as_the_proxy_read_it"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", test],
        env={**os.environ, "AIOHTTP_NO_EXTENSIONS": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:]


PAGES = {
    "https://evil.example": "evil.example",  # a form's POST: no CORS preflight
    "http://rebound.example:8080": "rebound.example",  # a name rebound to 127.0.0.1
    "null": "null",  # a sandboxed page
}


@pytest.mark.parametrize("origin", PAGES)
async def test_a_browser_page_of_another_site_spends_no_vendor_key(vendor, start_proxy, origin):
    tavily = route(f"{vendor.url}/tavily", "/tavily", search={"vendor": "tavily"})
    raw = {"routes": {"tavily": tavily}, "search_api": {"providers": ["tavily"]}}
    client = await start_proxy(raw)
    page = {"Origin": origin, "Content-Type": "text/plain"}
    body = '{"query": "what the page wants"}'
    for path in ("/tavily/search", "/v1/search"):  # the route's error in Tavily's shape
        r = await client.post(path, data=body, headers=page)
        assert r.status == 403 and r.headers["X-Proxy-Error"] == "forbidden", path
        assert f"Origin {PAGES[origin]!r}" in await r.text()
    assert vendor.count() == 0
    # A page on this machine, an extension's or an app's own, and an SDK (no Origin) are served.
    local = ["http://localhost:3000", "http://app.localhost:5173", "chrome-extension://abcdef"]
    for i, headers in enumerate([*({"Origin": o} for o in local), {}]):
        r = await client.post("/tavily/search", json={"query": f"q{i}"}, headers=headers)
        assert r.status == 200, headers
    assert vendor.count() == 4


async def test_a_page_of_another_site_is_not_answered_from_a_fresh_hit_either(vendor, start_proxy):
    tavily = route(f"{vendor.url}/tavily", "/tavily", search={"vendor": "tavily"}, cache={})
    client = await start_proxy({"routes": {"tavily": tavily}})
    for _ in range(2):  # the second is a fresh hit: an identical one is answered as it was
        r = await client.post("/tavily/search", json={"query": "cached"})
        assert r.status == 200
    page = {"Origin": "https://evil.example"}
    r = await client.post("/tavily/search", json={"query": "cached"}, headers=page)
    assert r.status == 403 and r.headers["X-Proxy-Error"] == "forbidden"
    assert vendor.count() == 1


async def test_with_client_tokens_a_page_is_served_by_its_token(vendor, start_proxy):
    token = "4f1c9a7e2b8d03e6a5c1f9b7d2e4a60c"
    raw = {"clients": {"web-ui": token}, "routes": {"v": one_route(vendor)["routes"]["v"]}}
    client = await start_proxy(raw)
    page = {"Origin": "https://app.example", "Authorization": "Bearer " + token}
    r = await client.post("/v/echo", json={"query": "q"}, headers=page)
    assert r.status == 200 and vendor.count() == 1


async def test_vendor_answer_passes_through(vendor, start_proxy):
    client = await start_proxy(one_route(vendor, upstream_path="/tavily"))
    r = await client.post("/v/search", json={"query": "aiohttp proxy"})
    assert r.status == 200
    body = await r.json()
    assert [x["url"] for x in body["results"]] == expected_urls("aiohttp proxy")


async def test_gzip_upstream_body_arrives_intact(vendor, start_proxy):
    client = await start_proxy(one_route(vendor, upstream_path="/tavily"))
    vendor.script(Fault.gzip())
    r = await client.post("/v/search", json={"query": "compressed answer"}, auto_decompress=False)
    raw = await r.read()
    assert "Content-Encoding" not in r.headers  # aiohttp decoded it; we must not claim gzip
    assert int(r.headers["Content-Length"]) == len(raw)
    assert [x["url"] for x in json.loads(raw)["results"]] == expected_urls("compressed answer")
    assert vendor.last.headers.get("Accept-Encoding", "").find("gzip") >= 0
    assert not raw.startswith(gzip.compress(b"")[:2])


async def test_stream_chunks_arrive_before_the_stream_ends(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    vendor.gate_streams(True)
    r = await client.get("/v/stream?chunks=3")
    assert r.status == 200
    vendor.release_chunk()
    first = await asyncio.wait_for(r.content.readuntil(b"\n"), 2)
    assert first == b"chunk-0\n"
    assert vendor.chunks_sent == 1  # the vendor has not sent the rest: nothing was buffered
    vendor.release_chunk(2)
    rest = await asyncio.wait_for(r.content.read(), 2)
    assert rest == b"chunk-1\nchunk-2\n"


async def test_server_sent_events_stream_through(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    vendor.gate_streams(True)
    r = await client.get("/v/sse?events=2")
    assert r.headers["Content-Type"].startswith("text/event-stream")
    vendor.release_chunk()
    first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 2)
    assert first.startswith(b"id: 0\n") and vendor.chunks_sent == 1
    vendor.release_chunk()
    assert b"id: 1\n" in await asyncio.wait_for(r.content.read(), 2)


async def test_body_over_limit_gets_413_without_vendor_call(vendor, start_proxy):
    raw = one_route(vendor)
    raw["server"] = {"max_body_bytes": "1KiB"}
    client = await start_proxy(raw)
    r = await client.post("/v/echo", data=b"x" * 1025)
    assert r.status == 413
    assert (await r.json())["error"]["type"] == "body_too_large"
    r = await client.post("/v/echo", data=b"x" * 1024)
    assert r.status == 200
    assert vendor.count() == 1


async def test_chunked_body_over_limit_gets_413(vendor, start_proxy):
    raw = one_route(vendor)
    raw["server"] = {"max_body_bytes": "1KiB"}
    client = await start_proxy(raw)

    async def chunks():
        for _ in range(4):
            yield b"y" * 400

    r = await client.post("/v/echo", data=chunks())
    assert r.status == 413
    assert vendor.count() == 0


async def raw_http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    return data


async def test_only_configured_upstreams_are_contacted(vendor, start_proxy, aiohttp_server):
    other = FakeVendor()
    other_server = await aiohttp_server(other.make_app())
    client = await start_proxy(one_route(vendor))
    port = client.server.port
    target = f"127.0.0.1:{other_server.port}"
    attempts = [
        f"GET http://{target}/echo HTTP/1.1\r\nHost: {target}\r\n\r\n",
        f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n",
        f"GET //{target}/echo HTTP/1.1\r\nHost: x\r\n\r\n",
        f"GET /v//{target}/echo HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET /v/../v/echo HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET /v/%2e%2e/echo HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET /v/echo%2F..%2F..%2Fadmin HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET /v\\..\\echo HTTP/1.1\r\nHost: x\r\n\r\n",
    ]
    for request in attempts:
        answer = await raw_http(port, request.encode())
        status = int(answer.split(b" ", 2)[1])
        assert status in (400, 404, 405), (request, answer[:200])
        if status != 404:
            assert b'"error"' in answer, answer
    assert other.count() == 0
    assert vendor.count() == 0


async def test_upstream_timeout_is_a_504_an_agent_can_read(vendor, start_proxy):
    raw = one_route(vendor, upstream_path="/tavily")
    raw["routes"]["v"]["timeouts"] = {"connect": "1s", "per_try": "200ms", "total": "1s"}
    client = await start_proxy(raw)
    vendor.script(Fault.hang(5))
    r = await client.post("/v/search", json={"query": "slow"})
    assert r.status == 504
    err = (await r.json())["error"]
    assert err["type"] == "upstream_timeout"
    assert err["message"] == "v: upstream timed out after 200ms (attempt 1 of 1); try again shortly"
    assert err["attempts"] == 1 and err["route"] == "v"


async def test_connection_refused_is_a_502_naming_the_route_not_the_address(start_proxy):
    from testkit.procs import free_port

    port = free_port()
    client = await start_proxy({"routes": {"v": route(f"http://127.0.0.1:{port}", "/v")}})
    r = await client.get("/v/search")
    assert r.status == 502
    err = (await r.json())["error"]
    assert err["type"] == "upstream_unreachable"
    assert err["message"] == (
        "v: cannot connect to the upstream (Connection refused) (attempt 1 of 1); try again "
        "shortly or use another provider"
    )
    assert "127.0.0.1" not in err["message"] and str(port) not in err["message"]


async def test_total_deadline_exceeded_is_a_504(vendor, start_proxy):
    raw = one_route(vendor, upstream_path="/tavily", retry={"attempts": 5, "on": ["timeout"]})
    raw["routes"]["v"]["timeouts"] = {"connect": "1s", "per_try": "300ms", "total": "400ms"}
    client = await start_proxy(raw)
    vendor.set_default(Fault.hang(5))
    r = await client.post("/v/search", json={"query": "slow"})
    assert r.status == 504
    err = (await r.json())["error"]
    assert err["type"] in ("deadline_exceeded", "upstream_timeout")
    assert vendor.count() <= 2


async def test_vendor_errors_pass_through_unchanged(vendor, start_proxy):
    client = await start_proxy(one_route(vendor, upstream_path="/tavily"))
    vendor.script(Fault.status(400), Fault.status(429, retry_after=30))
    r = await client.post("/v/search", json={"query": "x"})
    assert r.status == 400
    assert "detail" in await r.json()
    r = await client.post("/v/search", json={"query": "x"})
    assert r.status == 429
    assert r.headers["Retry-After"] == "30"
    assert "detail" in await r.json()


async def test_reserved_endpoints(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    assert (await client.get("/healthz")).status == 200
    ready = await client.get("/readyz")
    assert ready.status == 200
    assert (await ready.json())["redis"] == "not configured"
    await client.get("/v/echo")
    text = await (await client.get("/metrics")).text()
    assert 'search_proxy_requests_total{route="v",status_class="2xx"} 1.0' in text
    assert "search_proxy_in_flight_requests" in text
    assert 'search_proxy_upstream_duration_seconds_count{route="v"} 1.0' in text


async def test_readyz_reports_redis_down(vendor, start_proxy, killable_redis):
    raw = one_route(vendor)
    raw["redis"] = {"url": killable_redis.url}
    client = await start_proxy(raw)
    assert (await client.get("/readyz")).status == 200
    killable_redis.stop()
    r = await client.get("/readyz")
    assert r.status == 503 and (await r.json())["redis"] == "down"
    assert (await client.get("/v/echo")).status == 200  # serving goes on without Redis


async def test_keepalive_connections_are_reused(vendor, start_proxy):
    client = await start_proxy(one_route(vendor))
    for _ in range(5):
        await client.get("/v/echo")
    assert len(vendor.requests) == 5
    vendors = client.app[STATE].vendors
    assert vendors.open_connections == 1 and vendors.idle_connections == 1  # one, reused


async def test_vendor_cookies_are_never_replayed_to_other_requests(vendor, start_proxy):
    # By host name: aiohttp's default cookie jar ignores cookies from IP-address hosts.
    upstream = vendor.url.replace("127.0.0.1", "localhost") + "/tavily"
    client = await start_proxy({"routes": {"v": route(upstream, "/v")}})
    vendor.script(Fault.status(200, headers={"Set-Cookie": "session=agent-a; Path=/"}))
    first = await client.post("/v/search", json={"query": "a"})
    assert first.headers["Set-Cookie"].startswith("session=agent-a")  # the agent still sees it
    async with aiohttp.ClientSession() as other_agent:  # its own, empty cookie jar
        await other_agent.post(client.make_url("/v/search"), json={"query": "b"})
    assert "Cookie" not in vendor.last.headers

"""A request must arrive whole within server.request_timeout, and one address may hold at most
server.max_connections_per_peer connections: against a real proxy process over raw sockets,
with peers on other loopback addresses (127.0.0.2, 127.0.0.3) standing for other hosts.

Timeouts are a few hundred milliseconds, so each case takes about that.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator

import pytest

from testkit.fakevendor import FakeVendor
from testkit.proxyprocess import ProxyProcess
from testkit.waiting import wait_until
from tests.conftest import route
from tests.hostile.test_clients import (
    error_type,
    healthy,
    parse,
    read_response,
    read_until_closed,
)

REQUEST_S = 0.6
BODY_S = 0.3  # each gap of the trickle stays under it
TRICKLE_S = 0.1
SLACK_S = 1.0
PER_PEER = 4


@pytest.fixture(scope="module")
def proxy(fake: FakeVendor) -> Iterator[ProxyProcess]:
    config = {
        "server": {
            "request_timeout": f"{REQUEST_S}s",
            "body_timeout": f"{BODY_S}s",
            "header_timeout": "10s",
            "client_keepalive_timeout": "5s",
            "max_connections": 40,
            "max_connections_per_peer": PER_PEER,
        },
        "routes": {"v": route(fake.url, "/v")},  # type: ignore[attr-defined]
    }
    process = ProxyProcess(config).start()
    yield process
    process.stop()


def connect(proxy: ProxyProcess, source: str = "127.0.0.1") -> socket.socket:
    """A connection to the proxy from `source`, one of the loopback addresses."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", proxy.port or 0))
    return sock


def trickle(sock: socket.socket, data: bytes, every: float = TRICKLE_S) -> None:
    """Send `data` a byte at a time, `every` seconds apart, until it is all sent or the proxy
    answers (or closes) first."""
    for byte in data:
        readable, _, _ = select.select([sock], [], [], every)
        if readable:
            return
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return


def test_a_body_trickled_under_body_timeout_is_cut_at_request_timeout(proxy, fake):
    before = fake.count()
    body = b'{"query": "' + b"a" * 200 + b'"}'
    with connect(proxy) as sock:
        started = time.monotonic()
        head = b"POST /v/search HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        sock.sendall(head)
        trickle(sock, body)  # a byte every 100 ms: no gap reaches body_timeout
        data, _ = read_until_closed(sock, SLACK_S)
        took = time.monotonic() - started
    answer = parse(data)
    assert answer[1] == 408
    assert error_type(answer) == "request_timeout"
    assert "server.request_timeout" in answer[3]["error"]["message"]
    assert answer[2]["connection"] == "close"
    assert REQUEST_S * 0.9 <= took < REQUEST_S + SLACK_S
    assert fake.count() == before  # nothing of it reached the vendor


def test_a_head_trickled_in_is_cut_at_request_timeout_before_header_timeout(proxy):
    with connect(proxy) as sock:
        started = time.monotonic()
        trickle(sock, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100)
        data, _ = read_until_closed(sock, SLACK_S)
        took = time.monotonic() - started
    answer = parse(data)
    assert answer[1] == 408 and error_type(answer) == "request_timeout"
    assert "server.request_timeout" in answer[3]["error"]["message"]
    assert took < REQUEST_S + SLACK_S  # header_timeout is 10 s


def test_each_request_on_a_kept_alive_connection_has_the_whole_timeout(proxy, fake):
    body = b'{"query": "two"}'
    head = b"POST /v/echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    with connect(proxy) as sock:
        sock.sendall(head + body)
        assert read_response(sock)[1] == 200
        time.sleep(REQUEST_S * 0.8)  # idle between requests: not counted against the next
        sock.sendall(head)  # the next one arrives within its own request_timeout, in pieces
        for piece in (body[:5], body[5:]):
            time.sleep(BODY_S * 2 / 3)
            sock.sendall(piece)
        answer = read_response(sock)
    assert answer[1] == 200
    assert answer[3]["body"] == body.decode()


def test_a_head_trickled_on_a_kept_alive_connection_is_cut_at_request_timeout(proxy, fake):
    # The next request's head timer starts only when its first bytes do not hold it whole.
    body = b'{"query": "one"}'
    head = b"POST /v/echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    with connect(proxy) as sock:
        sock.sendall(head + body)
        assert read_response(sock)[1] == 200
        started = time.monotonic()
        trickle(sock, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100)
        data, _ = read_until_closed(sock, SLACK_S)
        took = time.monotonic() - started
    answer = parse(data)
    assert answer[1] == 408 and error_type(answer) == "request_timeout"
    assert "server.request_timeout" in answer[3]["error"]["message"]
    assert REQUEST_S * 0.9 <= took < REQUEST_S + SLACK_S  # header_timeout is 10 s


def test_past_its_share_an_address_is_refused_while_others_are_served(proxy):
    hogs = [connect(proxy, "127.0.0.2") for _ in range(PER_PEER)]
    try:
        with connect(proxy, "127.0.0.2") as extra:
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            data, took = read_until_closed(extra, 2)
        answer = parse(data)
        assert answer[1] == 503 and error_type(answer) == "too_many_connections"
        assert "server.max_connections_per_peer" in answer[3]["error"]["message"]
        assert answer[2]["retry-after"] == "1"
        assert took < 0.5
        with connect(proxy, "127.0.0.3") as other:  # another address: served
            other.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(other)[1] == 200
        hogs.pop().close()

        wait_until(lambda: healthy(connect(proxy, "127.0.0.2")), 3, interval=0.05)
    finally:
        for hog in hogs:
            hog.close()
    lines = proxy.wait_for_event("connections_refused")
    assert lines[0]["per_peer"] == 1 and lines[0]["refused"] == 1


def test_trickling_peers_are_cut_and_other_agents_are_served_meanwhile(proxy, fake):
    """The report's attack in small: an address trickling bodies holds its share of slots
    until request_timeout, then all of them are cut; a normal agent is served all along."""
    hogs = [connect(proxy, "127.0.0.4") for _ in range(PER_PEER)]
    try:
        for hog in hogs:
            hog.sendall(b"POST /v/search HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        deadline = time.monotonic() + REQUEST_S
        served = 0
        while time.monotonic() < deadline:
            for hog in hogs:
                hog.sendall(b" ")  # a byte each every 100 ms
            with connect(proxy) as sock:
                sock.sendall(b"GET /v/echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                served += parse(read_until_closed(sock, 2)[0])[1] == 200
            time.sleep(TRICKLE_S)
        for hog in hogs:
            answer = parse(read_until_closed(hog, SLACK_S)[0])
            assert answer[1] == 408 and error_type(answer) == "request_timeout"
    finally:
        for hog in hogs:
            hog.close()
    assert served >= 3

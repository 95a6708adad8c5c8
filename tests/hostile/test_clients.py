"""Hostile and odd agents against a real proxy process, over raw sockets: connections that send
nothing, heads and bodies that stall, readers that never read, more connections than allowed,
request lines the proxy must refuse, and a shutdown with requests still running.

Client-side timeouts are configured in hundreds of milliseconds, so each case takes about that.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from proxy.capacity import ACCEPT_FAILED, OverloadLog
from testkit.fakevendor import FakeVendor, Fault
from testkit.proxyprocess import ProxyProcess
from testkit.waiting import wait_until
from tests.conftest import route

HEADER_S = 0.3
BODY_S = 0.3
SEND_S = 0.5
KEEPALIVE_S = 0.5
SLACK_S = 1.0  # timer granularity and a loaded machine; far below any default (60 s)

LIMITS = {
    "header_timeout": f"{HEADER_S}s",
    "body_timeout": f"{BODY_S}s",
    "send_timeout": f"{SEND_S}s",
    "client_keepalive_timeout": f"{KEEPALIVE_S}s",
}


# ---------------------------------------------------------------------------------------------
# Peers


class EndlessUpstream:
    """An upstream answering every request with an endless chunked octet-stream; `closed` is
    set when the proxy drops the connection (its writes start failing)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connected = threading.Event()
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
        with conn:
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(4096)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                )
                self.connected.set()
                while True:
                    conn.sendall(chunk)
            except OSError:
                self.closed.set()

    def close(self) -> None:
        self.listener.close()


def connect(proxy: ProxyProcess, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", proxy.port or 0))
    return sock


def read_until_closed(sock: socket.socket, within: float) -> tuple[bytes, float]:
    """Everything the proxy sends until it closes the connection, and how long that took;
    AssertionError if it is still open after `within` s."""
    started = time.monotonic()
    sock.settimeout(within)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {within}s; got {data[:300]!r}") from None
    except ConnectionResetError:
        pass
    return data, time.monotonic() - started


def parse(data: bytes) -> tuple[str, int, dict[str, str], Any]:
    """(status line, status, headers, JSON body or raw bytes) of one response."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:])}
    length = int(headers.get("content-length", len(body)))
    try:
        payload: Any = json.loads(body[:length])
    except ValueError:
        payload = body
    return lines[0], int(lines[0].split(" ", 2)[1]), headers, payload


def read_response(sock: socket.socket) -> tuple[str, int, dict[str, str], Any]:
    """One response with a Content-Length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    length = int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])
    while len(data.split(b"\r\n\r\n", 1)[1]) < length:
        data += sock.recv(65536)
    return parse(data)


def exchange(proxy: ProxyProcess, raw: bytes) -> tuple[str, int, dict[str, str], Any]:
    """Send raw bytes on a new connection; the one answer, read until the proxy closes."""
    with connect(proxy) as sock:
        sock.sendall(raw)
        return parse(read_until_closed(sock, 5)[0])


def healthy(sock: socket.socket) -> bool:
    """Whether /healthz answers 200 on this new connection, which it then closes."""
    with sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return parse(read_until_closed(sock, 2)[0])[1] == 200


def error_type(answer: tuple[str, int, dict[str, str], Any]) -> str:
    line, _, headers, body = answer
    assert line.startswith("HTTP/1.1 "), line
    assert headers["content-type"].startswith("application/json"), headers
    assert headers["x-proxy-error"] == body["error"]["type"]
    return str(body["error"]["type"])


# ---------------------------------------------------------------------------------------------
# Fixtures: one vendor, one endless upstream and one proxy for the module


@pytest.fixture(scope="module")
def endless() -> Iterator[EndlessUpstream]:
    upstream = EndlessUpstream()
    yield upstream
    upstream.close()


@pytest.fixture(scope="module")
def proxy(fake: FakeVendor, endless: EndlessUpstream) -> Iterator[ProxyProcess]:
    config = {
        "server": LIMITS,
        "routes": {
            "v": route(fake.url, "/v"),  # type: ignore[attr-defined]
            "raw": route(endless.url, "/raw"),
        },
    }
    process = ProxyProcess(config).start()
    yield process
    process.stop()


# ---------------------------------------------------------------------------------------------
# Timeouts


def test_connection_that_sends_nothing_is_closed_after_header_timeout(proxy):
    with connect(proxy) as sock:
        data, took = read_until_closed(sock, HEADER_S + SLACK_S)
    assert data == b""  # nothing was asked: no answer, just the close
    assert took >= HEADER_S * 0.9


def test_partial_request_line_gets_a_json_408_and_is_closed(proxy):
    with connect(proxy) as sock:
        sock.sendall(b"GET /v/ec")
        data, took = read_until_closed(sock, HEADER_S + SLACK_S)
    answer = parse(data)
    assert took >= HEADER_S * 0.9
    assert answer[1] == 408
    assert error_type(answer) == "request_timeout"
    assert "server.header_timeout" in answer[3]["error"]["message"]


def test_slowloris_headers_are_cut_at_header_timeout_although_bytes_keep_coming(proxy):
    with connect(proxy) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        started = time.monotonic()
        sock.settimeout(0.05)
        data = b""
        while time.monotonic() - started < HEADER_S + SLACK_S:
            try:
                data = sock.recv(65536)
                break
            except TimeoutError:
                sock.sendall(b"a")  # one byte every 50 ms: never idle, never done
        took = time.monotonic() - started
        rest, _ = read_until_closed(sock, SLACK_S)
    assert parse(data + rest)[1] == 408
    assert HEADER_S * 0.9 <= took < HEADER_S + SLACK_S


def test_next_request_head_stalling_on_a_kept_alive_connection_gets_a_json_408(proxy):
    with connect(proxy) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[1] == 200
        sock.sendall(b"GET /heal")  # header_timeout runs from this first byte
        data, took = read_until_closed(sock, HEADER_S + SLACK_S)
    assert parse(data)[1] == 408
    assert HEADER_S * 0.9 <= took < KEEPALIVE_S  # the head's timeout, not the idle one


def test_stalled_body_gets_a_json_408_the_vendor_is_not_called_and_the_connection_closes(
    proxy, fake
):
    before = fake.count()
    with connect(proxy) as sock:
        sock.sendall(b"POST /v/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        data, took = read_until_closed(sock, BODY_S + SLACK_S)
    answer = parse(data)
    assert answer[1] == 408
    assert error_type(answer) == "request_timeout"
    assert answer[3]["error"]["route"] == "v"
    assert answer[2]["connection"] == "close"
    assert took >= BODY_S * 0.9
    assert fake.count() == before


def test_body_trickling_in_within_body_timeout_is_accepted(proxy, fake):
    pieces = [b"a" * 10] * 5
    with connect(proxy) as sock:
        head = b"POST /v/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n"
        sock.sendall(head)
        for piece in pieces:  # 5 gaps of 2/3 the timeout: longer than it in all
            time.sleep(BODY_S * 2 / 3)
            sock.sendall(piece)
        answer = read_response(sock)
    assert answer[1] == 200
    assert answer[3]["body"] == "a" * 50


def test_idle_keepalive_connection_is_closed_after_client_keepalive_timeout(proxy):
    with connect(proxy) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[1] == 200
        data, took = read_until_closed(sock, KEEPALIVE_S + SLACK_S)
    assert data == b""
    assert took >= KEEPALIVE_S * 0.9


def test_slow_reader_is_cut_after_send_timeout_and_the_upstream_released(proxy, endless):
    with connect(proxy, rcvbuf=4096) as sock:
        sock.sendall(b"GET /raw/stream HTTP/1.1\r\nHost: x\r\n\r\n")
        assert endless.connected.wait(5)
        # The agent reads nothing; once the buffers between are full, send_timeout runs.
        assert endless.closed.wait(SEND_S + 3 * SLACK_S), "the upstream stream was not released"
    line = wait_until(lambda: [e for e in proxy.events("request") if e["route"] == "raw"], 2)
    # The status line went out before the agent stopped reading: it stands, and `cut` says why.
    assert line[-1]["status"] == 200 and line[-1]["cut"] == "send_timeout", line
    assert line[-1]["bytes"] > 0, line


# ---------------------------------------------------------------------------------------------
# Conformance


def test_http_2_request_line_gets_505_json_in_http_1_1(proxy):
    answer = exchange(proxy, b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n")
    assert answer[1] == 505
    assert error_type(answer) == "http_version_not_supported"


@pytest.mark.parametrize(
    ("method", "status", "kind"),
    [
        ("TRACE", 405, "method_not_allowed"),
        # aiohttp's parser does not know TRACK as a method: refused as malformed.
        ("TRACK", 400, "bad_request"),
    ],
)
def test_trace_and_track_are_refused_in_json_and_reach_no_vendor(proxy, fake, method, status, kind):
    before = fake.count()
    answer = exchange(
        proxy, f"{method} /v/echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    )
    assert answer[1] == status
    assert error_type(answer) == kind
    if status == 405:
        assert answer[2]["allow"] == "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"
    assert fake.count() == before


def test_connect_in_authority_form_gets_405_json(proxy):
    with connect(proxy) as sock:
        sock.sendall(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        answer = read_response(sock)
    assert answer[1] == 405
    assert error_type(answer) == "method_not_allowed"


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nBad Header\r\n\r\n",
        b"GET /\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    ],
    ids=["request-line", "header", "target", "header-too-long"],
)
def test_malformed_requests_get_400_in_our_json_shape(proxy, raw):
    answer = exchange(proxy, raw)
    assert answer[1] == 400
    assert error_type(answer) == "bad_request"
    assert "malformed HTTP request" in answer[3]["error"]["message"]
    assert b"aaaa" not in json.dumps(answer[3]).encode()  # the agent's bytes are not echoed


def test_x_forwarded_host_is_the_host_we_were_sent_not_the_agents_claim(proxy, fake):
    with connect(proxy) as sock:
        sock.sendall(
            b"GET /v/echo HTTP/1.1\r\nHost: proxy.internal:8080\r\n"
            b"X-Forwarded-Host: evil.example\r\n\r\n"
        )
        assert read_response(sock)[1] == 200
    seen = fake.last.headers
    assert seen.getall("X-Forwarded-Host") == ["proxy.internal:8080"]


# ---------------------------------------------------------------------------------------------
# Connection limit and shutdown: a proxy of their own


def test_past_max_connections_agents_are_refused_fast_and_once_a_slot_frees_served(fake):
    config = {
        # Every connection comes from 127.0.0.1: the per-peer cap at the total, not half of it.
        "server": {"max_connections": 20, "max_connections_per_peer": 20, "header_timeout": "10s"},
        "routes": {"v": route(fake.url, "/v")},  # type: ignore[attr-defined]
    }
    with ProxyProcess(config) as proxy:
        hogs = [connect(proxy) for _ in range(20)]
        try:
            for _ in range(10):
                with connect(proxy) as extra:
                    extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                    data, took = read_until_closed(extra, 2)
                answer = parse(data)
                assert answer[1] == 503 and error_type(answer) == "too_many_connections"
                assert answer[2]["retry-after"] == "1"
                assert took < 0.5
            hogs.pop().close()

            wait_until(lambda: healthy(connect(proxy)), 3, interval=0.05)
        finally:
            for hog in hogs:
                hog.close()
        assert proxy.stop() == 0
    refusals = proxy.events("connections_refused")
    # Ten refusals: one line at once, the rest counted in the next (here written at exit).
    assert [line["refused"] for line in refusals] == [1, 9]
    assert refusals[0]["max_connections"] == 20 and refusals[0]["accept_failed"] == 0


def test_shutdown_ends_within_grace_answering_or_cutting_what_is_still_running():
    vendor = FakeVendor().script(Fault.hang(30), path_prefix="/tavily")
    served = vendor.start_in_thread()
    config = {
        "server": {"shutdown_grace": "1s"},
        "routes": {
            "v": route(served.url + "/tavily", "/v"),
            "s": route(served.url, "/s", timeouts={"connect": "1s", "per_try": "30s"}),
        },
    }
    vendor.gate_streams()  # the stream's head goes out, its first chunk never does
    proxy = ProxyProcess(config).start()
    agents: list[socket.socket] = []
    try:
        hanging = connect(proxy)
        hanging.sendall(
            b'POST /v/search HTTP/1.1\r\nHost: x\r\nContent-Length: 17\r\n\r\n{"query": "slow"}'
        )
        streaming = connect(proxy)
        streaming.sendall(b"GET /s/stream HTTP/1.1\r\nHost: x\r\n\r\n")
        idle = connect(proxy)
        idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(idle)[1] == 200
        agents += [hanging, streaming, idle]
        wait_until(lambda: vendor.count() >= 2, 5)
        assert streaming.recv(4096).startswith(b"HTTP/1.1 200")

        started = time.monotonic()
        assert proxy.proc is not None
        proxy.proc.send_signal(signal.SIGTERM)
        _, idle_closed_after = read_until_closed(idle, 0.5)  # at once, not at the end of grace
        assert proxy.proc.wait(10) == 0
        took = time.monotonic() - started
        answer = parse(read_until_closed(hanging, 2)[0])
        read_until_closed(streaming, 2)
    finally:
        for agent in agents:
            agent.close()
        proxy.stop()
        vendor.gate_streams(False)
        served.stop()
    assert 1.0 <= took <= 1.0 + 1.0, took  # within shutdown_grace and a fixed margin
    assert idle_closed_after < 0.5
    assert answer[1] == 503 and error_type(answer) == "shutting_down"
    lines = {e["route"]: e for e in proxy.events("request")}
    assert lines["v"]["status"] == 503 and lines["v"]["cut"] == "shutdown"
    assert lines["s"]["status"] == 200 and lines["s"]["cut"] == "shutdown"  # cut mid-stream
    assert proxy.events("stopped")[0]["cut"] == 2


# ---------------------------------------------------------------------------------------------
# The log throttle, on a clock the test moves


@pytest.mark.unit
def test_overload_writes_one_line_per_interval_and_loses_no_count():
    now = [0.0]
    timers: list[tuple[float, Any]] = []
    overload = OverloadLog(
        lambda: now[0], lambda when, fn: timers.append((when, fn)), 20, interval=1.0
    )
    failed = {"message": ACCEPT_FAILED, "exception": OSError(24, "Too many open files")}
    loop = asyncio.new_event_loop()
    try:
        with structlog.testing.capture_logs() as logs:
            for ms in range(2500):  # for 2.5 s, every millisecond a failed accept and a refusal
                now[0] = ms / 1000
                overload(loop, failed)
                overload.refused()
            now[0] = 3.0  # the loop runs the flush the last quiet interval scheduled
            for _, flush in timers:
                flush()
    finally:
        loop.close()
    assert [line["event"] for line in logs] == ["connections_refused"] * 4
    assert [(line["accept_failed"], line["refused"]) for line in logs][:3] == [
        (1, 0),
        (1000, 1000),
        (1000, 1000),
    ]
    assert sum(line["accept_failed"] for line in logs) == 2500
    assert sum(line["refused"] for line in logs) == 2500
    assert "ulimit -n" in logs[0]["hint"]

"""One memory budget for the process (server.max_buffered_bytes), against a real proxy process
and an upstream of raw answers: a JSON answer past it is a 503 memory_budget, counted as it is
decompressed; an answer nothing needs to read is passed through instead; slow readers hold
their answers' share until written, and give it back; request bodies count too. What it does
to RSS is measured by `python -m bench hostile`."""

from __future__ import annotations

import asyncio
import gzip
import http.server
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from testkit.proxyprocess import ProxyProcess
from testkit.waiting import eventually
from tests.conftest import route
from tests.hostile.test_bad_input import check_config

MIB = 1024 * 1024
BUDGET = 16 * MIB
BIG = 24 * MIB  # more than the whole budget
# Two fit, three do not; each more than the kernel's socket buffers take off a reader's hands.
PART = 6 * MIB
BODY = 10 * MIB  # a request body: one fits, two do not


class RawAnswers(http.server.BaseHTTPRequestHandler):
    """GET /json/N, /bin/N: N bytes of JSON or octet-stream with a Content-Length; /gzjson/N:
    JSON decompressing to N bytes, gzip and chunked, no length; POST: an empty search answer."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        kind, size = self.path.strip("/").split("/")
        n = int(size)
        body = b'{"results": [], "pad": "' + b"x" * (n - 27) + b'"}'
        if kind == "bin":
            self._send(b"\0" * n, "application/octet-stream")
        elif kind == "json":
            self._send(body, "application/json")
        else:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            packed = gzip.compress(body)
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(packed), packed))

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(b'{"results": []}', "application/json")

    def _send(self, body: bytes, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RawAnswers)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def proxy(upstream: str) -> Iterator[ProxyProcess]:
    timeouts = {"connect": "1s", "per_try": "10s", "total": "20s"}
    config = {
        "server": {"max_buffered_bytes": BUDGET, "max_body_bytes": "12MiB"},
        "routes": {"raw": route(upstream, "/raw", timeouts=timeouts, max_response_bytes="64MiB")},
    }
    process = ProxyProcess(config).start()
    yield process
    process.stop()


async def get(proxy: ProxyProcess, path: str) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as http, http.get(proxy.url + path) as r:
        return r.status, dict(r.headers), await r.read()


async def gauge(proxy: ProxyProcess, name: str) -> float:
    _, _, text = await get(proxy, "/metrics")
    line = next(x for x in text.decode().splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def refused(answer: tuple[int, dict[str, str], bytes]) -> bool:
    status, headers, _ = answer
    return status == 503 and headers.get("X-Proxy-Error") == "memory_budget"


async def test_a_json_answer_past_the_budget_is_refused_not_held(proxy: ProxyProcess) -> None:
    answer = await get(proxy, f"/raw/json/{BIG}")
    assert refused(answer) and answer[1]["Retry-After"] == "1"
    assert b"server.max_buffered_bytes" in answer[2]
    # A gzip bomb: 24 MiB once inflated, a few KiB on the wire, no length.
    assert refused(await get(proxy, f"/raw/gzjson/{BIG}"))
    assert (await get(proxy, f"/raw/json/{PART}"))[0] == 200  # within it: served
    assert await gauge(proxy, "search_proxy_buffered_bytes") == 0
    assert await gauge(proxy, "search_proxy_memory_budget_refused_total") >= 2


async def test_an_answer_nothing_reads_is_passed_through_instead(proxy: ProxyProcess) -> None:
    status, _, body = await get(proxy, f"/raw/bin/{BIG}")
    assert status == 200 and len(body) == BIG


def slow_reader(proxy: ProxyProcess, path: str) -> socket.socket:
    """A connection asking for `path` and never reading its answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", proxy.port or 0))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


async def test_slow_readers_hold_their_share_until_written_then_give_it_back(
    proxy: ProxyProcess,
) -> None:
    readers = [slow_reader(proxy, f"/raw/bin/{PART}") for _ in range(3)]
    try:
        # Two buffered answers are held while their agents do not read; the third had no room
        # and streams; a JSON answer meanwhile finds the budget full.
        async def held() -> bool:
            return await gauge(proxy, "search_proxy_buffered_bytes") >= 2 * PART

        await eventually(held, 5.0, 0.05)
        assert refused(await get(proxy, f"/raw/json/{PART}"))
    finally:
        for sock in readers:
            sock.close()

    async def drained() -> bool:
        return await gauge(proxy, "search_proxy_buffered_bytes") == 0

    await eventually(drained, 5.0, 0.05)
    assert (await get(proxy, f"/raw/json/{PART}"))[0] == 200


def stalling(how: str, finish: asyncio.Event) -> tuple[AsyncIterator[bytes], dict[str, str]]:
    """A request body of BODY bytes once read, sent all but its last bytes, which wait for
    `finish`: with a length (charged as declared), chunked (no length: charged as it comes), or
    gzip and chunked (aiohttp inflates it as it reads: charged as inflated)."""
    body = b"{}" + b" " * BODY
    data = gzip.compress(body) if how == "gzip" else body
    headers = {"Content-Encoding": "gzip"} if how == "gzip" else {}
    if how == "length":
        headers["Content-Length"] = str(len(data))

    async def pieces() -> AsyncIterator[bytes]:
        for at in range(0, len(data) - 16, MIB):
            yield data[at : min(at + MIB, len(data) - 16)]
        await finish.wait()
        yield data[-16:]

    return pieces(), headers


@pytest.mark.parametrize("how", ["length", "chunked", "gzip"])
async def test_request_bodies_count_too(proxy: ProxyProcess, how: str) -> None:
    finish = asyncio.Event()
    data, headers = stalling(how, finish)
    async with aiohttp.ClientSession() as http:
        # Held while its agent trickles the end (a chunked one was charged only once whole).
        task = asyncio.ensure_future(http.post(f"{proxy.url}/raw/fast", data=data, headers=headers))

        async def holding() -> bool:
            return await gauge(proxy, "search_proxy_buffered_bytes") >= BODY - MIB

        try:
            await eventually(holding, 5.0, 0.05)
            async with http.post(f"{proxy.url}/raw/fast", data=b"{}" + b" " * BODY) as second:
                assert second.status == 503
                assert second.headers["X-Proxy-Error"] == "memory_budget"
        finally:
            finish.set()
        async with await task as r:
            assert r.status == 200


def test_a_body_limit_above_the_budget_is_refused(tmp_path: Path) -> None:
    done = check_config(tmp_path, {}, server={"max_body_bytes": "100GiB"})
    assert done.returncode == 2
    assert "server.max_body_bytes: max_body_bytes (107374182400) is more than" in done.stderr

"""One memory budget for the process (server.max_buffered_bytes), against a real proxy process
and an upstream of raw answers: a JSON answer past it is a 503 memory_budget, counted as it is
decompressed; an answer nothing needs to read is passed through instead; slow readers hold
their answers' share until written, and give it back; request bodies count too. What it does
to RSS is measured by `python -m bench hostile`."""

from __future__ import annotations

import asyncio
import gzip
import http.server
import json
import socket
import threading
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import orjson
import pytest

from policies.core.memory import PARSE_COUNTED_FROM, parse_cost
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

    asked: ClassVar[list[str]] = []  # the paths asked for, in order

    def do_GET(self) -> None:
        self.asked.append(self.path)
        kind, size = self.path.strip("/").split("/")
        n = int(size)
        body = b'{"results": [], "pad": "' + b"x" * (n - 27) + b'"}'
        if kind == "headers":  # N headers of 4,000 bytes, then a small answer
            self.send_response(200)
            for i in range(n):
                self.send_header(f"X-Pad-{i}", "p" * 4000)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "15")
            self.end_headers()
            self.wfile.write(b'{"results": []}')
        elif kind == "tiny":  # N bytes of tiny results: parsed, some 25 times as much
            self._send(tiny_results(n), "text/plain")  # what it says it is changes nothing
        elif kind == "bin":
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


def tiny_results(n: int) -> bytes:
    """A search answer of about `n` bytes whose results are as small as JSON objects get."""
    return b'{"results":[' + b",".join([b'{"a":1}'] * (n // 8)) + b"]}"


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
        "routes": {
            "raw": route(upstream, "/raw", timeouts=timeouts, max_response_bytes="64MiB"),
            "guarded": route(
                upstream,
                "/guarded",
                timeouts=timeouts,
                breaker={"fail_max": 2},
                retry={"attempts": 3, "backoff": {"initial": "10ms"}},
            ),
        },
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


def parsed_size(body: bytes, loads: Callable[[bytes], Any] = orjson.loads) -> int:
    """The bytes `loads(body)` allocates and keeps, as tracemalloc counts them."""
    tracemalloc.start()
    try:
        data = loads(body)
        size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del data
    return size


def items(item: bytes, n: int) -> bytes:
    return b"[" + b",".join([item] * n) + b"]"


@pytest.mark.parametrize(
    "body",
    [
        tiny_results(MIB),
        items(b"{}", 300_000),
        items(b"[]", 300_000),
        items(b'{"a":"1","b":"2","c":"3","d":"4","e":"5","f":"6","g":"7"}', 20_000),
        items(b'{ "a": 1 }', 100_000),  # spaced: no '{"' to count
        items(b"[[1]]", 200_000),
        items(b'"a"', 300_000),
        items(b"1.5", 300_000),
        items(b"1000", 300_000),
        b"{" + b",".join(b'"k%d":0' % i for i in range(100_000)) + b"}",
        # One character past U+FFFF makes CPython keep every character of its string in 4
        # bytes, one past U+00FF in 2: as UTF-8, and as an escape.
        orjson.dumps(["x" * MIB + "\N{GRINNING FACE}"]),
        b'["' + b"x" * MIB + b'\\ud83d\\ude00"]',
        orjson.dumps(["x" * MIB + "\u0100"]),
        b'["' + b"x" * MIB + b'\\u0100"]',
    ],
    ids=lambda body: body[:20].decode(),
)
def test_a_json_bodys_parse_cost_is_never_far_under_what_it_takes(body: bytes) -> None:
    assert len(body) >= PARSE_COUNTED_FROM
    assert len(body) + parse_cost(body) >= 0.85 * parsed_size(body)


@pytest.mark.parametrize(
    "body",
    [
        b"\xef\xbb\xbf" + items(b"{}", 100_000),  # a byte order mark, which json.loads passes
        items(b"{}", 50_000).decode().encode("utf-16-be"),
        items(b"{}", 50_000).decode().encode("utf-32"),
    ],
    ids=["bom", "utf-16", "utf-32"],
)
def test_bodies_the_stdlib_parser_reads_past_their_first_byte_are_counted(body: bytes) -> None:
    assert len(body) + parse_cost(body) >= 0.85 * parsed_size(body, json.loads)
    assert parse_cost(b"\0" * len(body)) == 0  # what is not JSON in any of them


def test_text_is_not_counted_as_much_more_than_its_size() -> None:
    prose = (
        "The proxy retries a vendor's 429 and 5xx answers, honours Retry-After, and falls "
        'back to another vendor: "search" results come back in the agent\'s own shape. '
    ) * 20
    answer = orjson.dumps(
        {"results": [{"url": f"https://e.com/{i}", "content": prose} for i in range(100)]}
    )
    assert len(answer) >= PARSE_COUNTED_FROM
    assert parse_cost(answer) <= 1.5 * len(answer)  # a comma every 40 characters: 1.12 x
    # Data in a few long strings (a CSV page read by an extract API): its commas are text.
    rows = "\n".join(",".join(str(i * j) for j in range(12)) for i in range(8000))
    extract = orjson.dumps({"results": [{"url": "https://e.com/data.csv", "raw_content": rows}]})
    assert len(extract) >= PARSE_COUNTED_FROM
    assert parse_cost(extract) <= 0.1 * len(extract)
    # Its strings' ends found past escaped quotes and escaped backslashes (an escaped quote
    # counts as half a string: 32 bytes for every row here).
    tricky = rows.replace("\n", '\\"\n') + "\\"
    extract = orjson.dumps({"results": [{"url": "https://e.com/q.csv", "raw_content": tricky}]})
    assert parse_cost(extract) <= 32 * tricky.count('"') + 0.1 * len(extract)
    assert parse_cost(b" " + answer[: PARSE_COUNTED_FROM - 2]) == 0  # too small to count
    assert parse_cost(b"x" * PARSE_COUNTED_FROM + answer) == 0  # not JSON


async def test_an_answer_too_costly_to_parse_is_refused_before_it_is_parsed(
    proxy: ProxyProcess,
) -> None:
    # 2 MiB of tiny results parse to some 50 MiB, past the whole budget of 16 MiB: refused for
    # what reading it would cost, whatever its content type says, and not retried.
    status, headers, body = await get(proxy, f"/raw/tiny/{2 * MIB}")
    assert status == 502 and headers["X-Proxy-Error"] == "upstream_too_large"
    assert b"server.max_buffered_bytes" in body and b"many small values" in body
    assert await gauge(proxy, "search_proxy_buffered_bytes") == 0
    # Our own limit, not the vendor failing: it opens no circuit.
    for _ in range(3):
        status, headers, _ = await get(proxy, f"/guarded/tiny/{2 * MIB}")
        assert status == 502 and headers["X-Proxy-Error"] == "upstream_too_large"
    assert (await get(proxy, "/guarded/json/1000"))[0] == 200
    # 256 KiB of them (some 8 MiB parsed) fit and are served whole.
    status, _, body = await get(proxy, f"/raw/tiny/{256 * 1024}")
    assert status == 200 and body == tiny_results(256 * 1024)
    assert await gauge(proxy, "search_proxy_buffered_bytes") == 0


async def test_a_request_body_too_costly_to_parse_is_refused(proxy: ProxyProcess) -> None:
    tiny = b"[" + b",".join([b"{}"] * (MIB // 3)) + b"]"  # 1 MiB, some 30 MiB parsed
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy.url}/raw/fast", data=tiny) as r:
            assert r.status == 413 and r.headers["X-Proxy-Error"] == "body_too_large"
            assert b"server.max_buffered_bytes" in await r.read()
        small = b"[" + b",".join([b"{}"] * 10_000) + b"]"  # 30 KB: its parse is not counted
        async with http.post(f"{proxy.url}/raw/fast", data=small) as r:
            assert r.status == 200
    assert await gauge(proxy, "search_proxy_buffered_bytes") == 0


async def test_an_answers_head_is_read_to_64_kib(proxy: ProxyProcess) -> None:
    # The parser takes 128 headers of 8 KiB each; a head lives as long as its answer, outside
    # the budget, so one over 64 KiB is refused as invalid (as Envoy does past 60 KiB).
    RawAnswers.asked.clear()
    status, headers, body = await get(proxy, "/guarded/headers/20")
    assert status == 502 and headers["X-Proxy-Error"] == "upstream_invalid_response"
    assert b"head is over 65536 bytes" in body and b"not retried" in body
    assert RawAnswers.asked == ["/headers/20"]  # the same request gets the same head
    status, headers, _ = await get(proxy, "/raw/headers/10")
    assert status == 200 and headers["X-Pad-9"] == "p" * 4000


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
        # An answer of some 12 MiB once parsed finds no room either, though its bytes would fit.
        assert refused(await get(proxy, f"/raw/tiny/{288 * 1024}"))
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

"""The bench's upstream (bench/upstream.py) parses HTTP itself to cost the shared core as
little as possible; these tests hold it to what the bench's proxies send it and expect back."""

from __future__ import annotations

import gzip
import json
import socket
import sys
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from bench.upstream import BODY
from testkit.procs import Child


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    child = Child(
        "bench-upstream", [sys.executable, "-m", "bench.upstream", "--port", "0"], pipe_stdout=True
    )
    try:
        yield f"http://127.0.0.1:{child.read_port(15.0)}"
    finally:
        child.stop()


async def test_answers_every_request_on_one_kept_alive_connection(upstream: str) -> None:
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i in range(5):
            body = {"query": f"q{i}", "pad": "x" * (i * 3000)}  # past one read, some of them
            async with session.post(f"{upstream}/search", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"] == "application/json"
                assert await resp.read() == BODY
        assert len(connector._conns) == 1  # one connection served all five


async def test_reads_a_chunked_body_to_its_end(upstream: str) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for part in (b'{"query": ', b'"chunked"', b"}"):
            yield part

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        async with session.post(f"{upstream}/search", data=chunks()) as resp:
            assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
            assert await resp.read() == BODY
        async with session.post(f"{upstream}/search", data=b"{}") as resp:  # still in step
            assert await resp.read() == BODY


async def test_heavy_answers(upstream: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{upstream}/bin/5000") as resp:
            assert resp.headers["Content-Type"] == "application/octet-stream"
            assert await resp.read() == bytes(5000)
        async with session.get(f"{upstream}/bomb/4000", auto_decompress=False) as resp:
            assert resp.headers["Content-Encoding"] == "gzip"
            assert resp.headers["Transfer-Encoding"] == "chunked"
            inflated = gzip.decompress(await resp.read())
        assert len(inflated) == 4000
        assert json.loads(inflated)["results"] == []


def test_connection_close_and_garbage(upstream: str) -> None:
    port = int(upstream.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(
            b"POST /s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
        )
        answer = b"".join(iter(lambda: sock.recv(65536), b""))  # the upstream closes
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(BODY)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"NONSENSE\r\n\r\n")
        answer = b"".join(iter(lambda: sock.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")

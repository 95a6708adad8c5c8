"""The cheapest upstream we can make in Python: an asyncio protocol (on uvloop when installed)
that answers every request with the same 1 KB JSON body after reading the request's body; and,
for the hostile group, heavy answers: GET /bin/N is N bytes of octet-stream with a Content-Length
(what the proxy buffers), GET /bomb/N gzip-compressed JSON that inflates to N bytes, chunked (a
gzip bomb).

It shares a core with the load generator (and, in the workers comparison, with the second
worker), so every microsecond it spends is one the figures lose: it parses only what it needs
(the head's end, Content-Length, chunked framing, Connection: close) and writes answers built
once. The proxies it stands behind speak well-formed HTTP/1.1 to it; anything else closes the
connection with a 400.

`python -m bench.upstream --port 0` prints its port when ready; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import signal
from typing import cast

# A search answer of about 1 KB.
BODY = json.dumps(
    {
        "query": "bench",
        "results": [
            {
                "url": f"https://example.com/bench/{i}",
                "title": f"Result {i} for bench",
                "content": "Lorem ipsum dolor sit amet, consectetur adipiscing elit " * 2,
                "score": 0.9,
            }
            for i in range(1, 6)
        ],
    }
).encode()

MAX_HEAD = 64 * 1024


def _answer(body: bytes, content_type: str) -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


SEARCH_ANSWER = _answer(BODY, "application/json")
BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

# Made once per size: a 7 MiB body or a 100 MiB bomb costs the upstream nothing per request.
_HEAVY: dict[str, bytes] = {}


def _heavy(path: str) -> bytes | None:
    """The whole answer for /bin/N or /bomb/N, or None for any other path."""
    kind, _, size = path.strip("/").partition("/")
    if kind not in ("bin", "bomb") or not size.isdigit():
        return None
    answer = _HEAVY.get(path)
    if answer is None:
        n = int(size)
        if kind == "bin":
            answer = _answer(bytes(n), "application/octet-stream")
        else:
            frame = (b'{"results": [], "pad": "', b'"}')
            pad = b"x" * (n - len(frame[0]) - len(frame[1]))
            packed = gzip.compress(frame[0] + pad + frame[1], compresslevel=9)
            answer = (
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
                + f"{len(packed):x}\r\n".encode()
                + packed
                + b"\r\n0\r\n\r\n"
            )
        answer = _HEAVY[path] = answer
    return answer


class Upstream(asyncio.Protocol):
    """One connection: requests one after another (no pipelining is needed, but it works)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.buf and self.transport is not None:
            done = self._one()
            if done is None:
                if len(self.buf) > MAX_HEAD and self.buf.find(b"\r\n\r\n") < 0:
                    self._refuse()
                return

    def _refuse(self) -> None:
        assert self.transport is not None
        self.transport.write(BAD_REQUEST)
        self.transport.close()
        self.transport = None
        self.buf.clear()

    def _one(self) -> bool | None:
        """Answer the first whole request in the buffer; None while it is incomplete."""
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        parts = head[0].split(" ")
        if len(parts) != 3:
            self._refuse()
            return True
        length, chunked, close = 0, False, False
        for line in head[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value.strip() or 0)
            elif name == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif name == "connection":
                close = "close" in value.lower()
        start = end + 4
        if chunked:
            stop = self._chunked_end(start)
            if stop is None:
                return None
        else:
            stop = start + length
            if len(self.buf) < stop:
                return None
        del self.buf[:stop]
        assert self.transport is not None
        self.transport.write(_heavy(parts[1]) or SEARCH_ANSWER)
        if close:
            self.transport.close()
            self.transport = None
        return True

    def _chunked_end(self, at: int) -> int | None:
        """Where a chunked body that starts at `at` ends, or None while it is incomplete."""
        while True:
            line_end = self.buf.find(b"\r\n", at)
            if line_end < 0:
                return None
            size = int(bytes(self.buf[at:line_end]).split(b";")[0] or b"0", 16)
            at = line_end + 2
            if size == 0:  # no trailers from the proxies we stand behind
                return at + 2 if len(self.buf) >= at + 2 else None
            at += size + 2
            if len(self.buf) < at:
                return None


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, host, port, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:  # the bench runs without it, a little slower
        asyncio.run(serve(args.host, args.port))
    else:
        uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()

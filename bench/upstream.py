"""The fastest upstream we can make with aiohttp: a low-level server answering every request
with the same 1 KB JSON body after reading the request's body; and, for the hostile group, heavy
answers: GET /bin/N is N bytes of octet-stream with a Content-Length (what the proxy buffers),
GET /bomb/N gzip-compressed JSON that inflates to N bytes, chunked (a gzip bomb).

`python -m bench.upstream --port 0` prints its port when ready; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import signal

from aiohttp import web

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


# Made once per size: a 7 MiB body or a 100 MiB bomb costs the upstream nothing per request.
_HEAVY: dict[tuple[str, int], bytes] = {}


def _heavy(kind: str, size: int) -> bytes:
    body = _HEAVY.get((kind, size))
    if body is None:
        if kind == "bin":
            body = bytes(size)
        else:
            pad = b"x" * (size - 27)
            body = gzip.compress(b'{"results": [], "pad": "' + pad + b'"}', compresslevel=9)
        body = _HEAVY[(kind, size)] = body
    return body


async def handle(request: web.BaseRequest) -> web.StreamResponse:
    await request.read()
    kind, _, size = request.path.strip("/").partition("/")
    if kind == "bin" and size.isdigit():
        return web.Response(body=_heavy(kind, int(size)), content_type="application/octet-stream")
    if kind == "bomb" and size.isdigit():
        packed = _heavy(kind, int(size))
        bomb = web.StreamResponse(headers={"Content-Encoding": "gzip"})
        bomb.content_type = "application/json"
        await bomb.prepare(request)  # chunked: no length to judge it by
        await bomb.write(packed)
        await bomb.write_eof()
        return bomb
    return web.Response(body=BODY, content_type="application/json")


async def serve(host: str, port: int) -> None:
    runner = web.ServerRunner(web.Server(handle, access_log=None), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()

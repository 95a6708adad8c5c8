"""The fastest upstream we can make with aiohttp: a low-level server answering every request
with the same 1 KB JSON body after reading the request's body.

`python -m bench.upstream --port 0` prints its port when ready; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


async def handle(request: web.BaseRequest) -> web.Response:
    await request.read()
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

"""The least a Python forwarder does, as the yardstick for the proxy's own cost: aiohttp's
low-level server reads the body, one pooled ClientSession sends it on, the answer goes back.

`python -m bench.forwarder --upstream URL --port 0` prints its port when ready; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import aiohttp
from aiohttp import web


async def serve(host: str, port: int, upstream: str) -> None:
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=256), skip_auto_headers=("User-Agent",)
    )

    async def handle(request: web.BaseRequest) -> web.Response:
        body = await request.read()
        async with session.request(
            request.method,
            upstream + request.path_qs,
            data=body,
            headers={"Content-Type": request.headers.get("Content-Type", "application/json")},
        ) as resp:
            answer = await resp.read()
            return web.Response(status=resp.status, body=answer, content_type=resp.content_type)

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
        await session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port, args.upstream.rstrip("/")))


if __name__ == "__main__":
    main()

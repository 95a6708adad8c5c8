"""`make demo` (`python -m proxy.testing.demo`): the proxy on demo.yaml with a fake vendor behind
each route, the `down` route's failing every call, in the foreground until Ctrl-C: the proxy at
work without a vendor key or the network."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence

from proxy.config import Config, ConfigError, ConfigErrors
from proxy.embed import load
from proxy.logs import configure_logging
from proxy.testing.harness import DEMO_CONFIG, ProxyHarness, harness

DOWN = "down"  # the demo's broken vendor: its fake answers 503 to every call


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m proxy.testing.demo",
        description="Serve a config with a fake vendor behind each route (no keys, no network) "
        "until Ctrl-C.",
    )
    parser.add_argument("--config", default=str(DEMO_CONFIG), metavar="FILE")
    parser.add_argument("--host", help="override server.host")
    parser.add_argument("--port", type=int, help="override server.port")
    parser.add_argument("--admin-port", type=int, metavar="PORT", help="override admin_port")
    return parser


def banner(running: ProxyHarness) -> str:
    """What the demo prints once it serves: where, what, and what to try."""
    routes = " ".join(route.prefix for route in running.config.routes.values())
    down = f" ({DOWN}'s answers 503 to every call)" if DOWN in running.vendors else ""
    return (
        f"search-proxy demo: agents' port {running.url}, admin endpoints {running.admin_url}\n"
        f"  routes, each with a fake vendor of its own on loopback{down}: {routes}\n"
        f'  try: curl -s {running.url}/v1/search -d \'{{"query": "circuit breaker"}}\'\n'
        "  Ctrl-C stops the proxy and its fake vendors."
    )


async def demo(config: Config, host: str, port: int, admin_port: int) -> None:
    """Serve until SIGINT or SIGTERM."""
    async with harness(config, host=host, port=port, admin_port=admin_port) as running:
        if DOWN in running.vendors:
            running.fail(DOWN, 503)
        print(banner(running), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    print("search-proxy demo: stopped", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 2 for a bad config, 1 for a port in use."""
    opts = _parser().parse_args(argv)
    try:
        config = asyncio.run(load(opts.config))
    except ConfigError as exc:
        for error in exc.errors if isinstance(exc, ConfigErrors) else (exc,):
            print(f"search-proxy demo: config error: {error}", file=sys.stderr)
        return 2
    configure_logging(config.log.level, config.log.format)
    server = config.server
    host = opts.host or server.host
    port = server.port if opts.port is None else opts.port
    admin_port = server.admin_port if opts.admin_port is None else opts.admin_port
    try:
        asyncio.run(demo(config, host, port, admin_port))
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        print(
            f"search-proxy demo: cannot listen on {host}:{port} or {host}:{admin_port}: {reason}; "
            "choose other ports: make demo PORT=9000 ADMIN_PORT=9001",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

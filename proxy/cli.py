"""The CLI: `search-proxy --config FILE` serves; `search-proxy check-config FILE` validates.

A bad config prints its YAML path and reason and exits 2 before any port is opened.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

import structlog
import yaml
from aiohttp import web

from proxy import __version__
from proxy.app import build_app
from proxy.config import Config, ConfigError, load_config, redacted
from proxy.logs import configure_logging

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="search-proxy",
        description="A resilience proxy between AI agents and web-search APIs.",
        epilog="Subcommand: search-proxy check-config FILE  validates FILE and prints the "
        "effective config with secrets redacted.",
    )
    parser.add_argument(
        "--config", default="config.yaml", help="YAML config (default: %(default)s)"
    )
    parser.add_argument("--host", help="override server.host")
    parser.add_argument("--port", type=int, help="override server.port (0 = any free port)")
    parser.add_argument("--version", action="version", version=f"search-proxy {__version__}")
    return parser


def check_config(path: str) -> int:
    """Validate a config file and print the effective config, secrets redacted."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"search-proxy: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(yaml.safe_dump(redacted(config), sort_keys=False, allow_unicode=True))
    print(f"# {path}: ok, {len(config.routes)} route(s)", file=sys.stderr)
    return 0


async def serve(config: Config, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, then drain in-flight requests within shutdown_grace."""
    log = structlog.get_logger("search_proxy")
    app = build_app(config)
    runner = web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=config.server.shutdown_grace,
        handle_signals=False,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    await site.start()
    bound = runner.addresses[0]
    log.info(
        "listening",
        host=bound[0],
        port=bound[1],
        routes={name: r.prefix for name, r in config.routes.items()},
        redis="configured" if config.redis else "in-process state",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting_down", grace_s=config.server.shutdown_grace)
    await runner.cleanup()
    log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `search-proxy` console script and `python -m proxy`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "check-config":
        if len(args) != 2:
            print("usage: search-proxy check-config FILE", file=sys.stderr)
            return EXIT_CONFIG
        return check_config(args[1])
    opts = _parser().parse_args(args)
    try:
        config = load_config(opts.config)
    except ConfigError as exc:
        print(f"search-proxy: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(config.log.level, config.log.format)
    host = opts.host or config.server.host
    port = config.server.port if opts.port is None else opts.port
    try:
        asyncio.run(serve(config, host, port))
    except OSError as exc:
        print(f"search-proxy: cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CLI: `search-proxy --config FILE` serves; `search-proxy check-config FILE` validates.

A bad config prints every mistake, one `path: reason` a line, and exits 2 before any port opens.
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
from proxy.config import REDACTED, Config, ConfigError, ConfigErrors, load_config, redacted
from proxy.logs import configure_logging

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="search-proxy",
        usage="%(prog)s [--config FILE] [--host HOST] [--port PORT]\n"
        "       %(prog)s check-config FILE\n"
        "       %(prog)s --version",
        description="A resilience proxy between AI agents and web-search APIs. Without a "
        "command it serves FILE (--config); a bad config exits 2 before listening.",
    )
    parser.add_argument(
        "--config",
        default="config.yaml",
        metavar="FILE",
        help="YAML config to serve (default: %(default)s)",
    )
    parser.add_argument("--host", help="override server.host")
    parser.add_argument("--port", type=int, help="override server.port (0 = any free port)")
    parser.add_argument("--version", action="version", version=f"search-proxy {__version__}")
    commands = parser.add_subparsers(dest="command", title="commands")
    check = commands.add_parser(
        "check-config",
        prog="search-proxy check-config",  # else derived from the custom usage above
        help="validate a config and print the effective config",
        description="Validate FILE without serving it. If it is valid, print the effective "
        "config as YAML, itself a valid config (durations in seconds, sizes in bytes; "
        f"secrets print as {REDACTED}, a placeholder to fill in) and exit 0. Otherwise "
        "print every mistake, one `path: reason` a line, and exit 2.",
    )
    check.add_argument("file", metavar="FILE", help="the YAML config to check")
    return parser


def _report(exc: ConfigError) -> None:
    """Every error of a bad config, one line each, on stderr."""
    for error in exc.errors if isinstance(exc, ConfigErrors) else (exc,):
        print(f"search-proxy: config error: {error}", file=sys.stderr)


def check_config(path: str) -> int:
    """Validate a config file and print the effective config, secrets redacted."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        _report(exc)
        return EXIT_CONFIG
    text = yaml.safe_dump(redacted(config), sort_keys=False, allow_unicode=True)
    if REDACTED in text:
        print(f"# {REDACTED} stands for a secret: put it (or its ${{VAR}}) back to reuse this.")
    sys.stdout.write(text)
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
    """Entry point of the `search-proxy` console script and `python -m proxy`; returns the
    exit status (0 after --help or --version, 2 for a usage or config error)."""
    try:
        opts = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed the help, the version or the usage error
        return exc.code if isinstance(exc.code, int) else EXIT_CONFIG
    if opts.command == "check-config":
        return check_config(opts.file)
    try:
        config = load_config(opts.config)
    except ConfigError as exc:
        _report(exc)
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

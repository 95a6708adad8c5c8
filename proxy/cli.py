"""The CLI: `search-proxy --config FILE` serves; `search-proxy check-config FILE` validates.

A bad config prints every mistake, one `path: reason` a line, and exits 2 before any port opens.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import structlog
import yaml
from aiohttp import web

from proxy import __version__
from proxy.app import STATE, build_admin_app, build_app
from proxy.capacity import (
    LISTEN_BACKLOG,
    OverloadLog,
    connection_budget,
    map_large_allocations,
)
from proxy.config import (
    Config,
    ConfigError,
    ConfigErrors,
    InvalidConfig,
    load_config,
    read_config_file,
    redacted,
    secret_values,
)
from proxy.cores import resolve
from proxy.fleet import FLEET, fan_out, sibling_app
from proxy.guard import CUT_MARGIN_S, GuardedRunner
from proxy.internals import internals_problem
from proxy.listeners import ADMIN, AGENTS, CannotListen, Listener, address, reason
from proxy.logs import configure_logging
from proxy.loops import chosen, loop_factory
from proxy.redact import REDACTED
from proxy.reload import RELOADER, config_hash, effective
from proxy.startup import check_startup, startup_errors
from proxy.supervisor import CONFIG_FILE, Fleet, Plan

EXIT_CONFIG = 2


# The collector's generation thresholds once serving (CPython's: 700, 10, 10); see serve().
GC_THRESHOLDS = (20_000, 20, 20)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="search-proxy",
        usage="%(prog)s [--config FILE] [--host HOST] [--port PORT] [--admin-port PORT]\n"
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
    parser.add_argument("--port", type=_port, help="override server.port (0 = any free port)")
    parser.add_argument(
        "--admin-port",
        type=_port,
        metavar="PORT",
        help="override server.admin_port, the admin endpoints' listener (0 = any free port)",
    )
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


def _port(text: str) -> int:
    """--port: 0 to 65535; anything else is a usage error (exit 2)."""
    if not text.isascii() or not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {text!r}")
    return int(text)


# A value quoted in an error may hold a newline or a terminal escape: one error, one line.
_CONTROL = {i: f"\\x{i:02x}" for i in (*range(32), 127)} | {10: "\\n", 13: "\\r", 9: "\\t"}


def _report(exc: ConfigError) -> None:
    """Every error of a bad config, one line each, on stderr."""
    for error in exc.errors if isinstance(exc, ConfigErrors) else (exc,):
        line = str(error).translate(_CONTROL)
        print(f"search-proxy: config error: {line}", file=sys.stderr)


def _load(path: str, source: str | None = None) -> tuple[Config, bytes]:
    """The config in `path` (read from `source` when given: a worker's copy of what the fleet
    serves), parsed and built as start-up builds it (no port, no Redis command), and the bytes
    read: a config this returns cannot fail start-up; anything else is a ConfigError, with every
    mistake found in one run (start-up's token checks beside the document's own errors)."""
    data = read_config_file(source or path)
    try:
        config = load_config(path, data=data)
    except InvalidConfig as exc:
        raise ConfigErrors([*exc.errors, *asyncio.run(startup_errors(exc.partial))]) from None
    asyncio.run(check_startup(config))
    return config, data


def _worker_config(path: str, fleet: Fleet) -> tuple[Config, bytes]:
    """What a worker serves, and the bytes its hash is of: the config the fleet started on, or,
    once a reload applied another, that one with the restart-only settings as the fleet started
    (as the others serve it: a worker the supervisor restarts is no restart of the proxy, and a
    new `redis.url` there would split the fleet's shared state)."""
    started, data = _load(path, str(fleet.config_file))
    if not fleet.applied_file.exists():
        return started, data
    applied, data = _load(path, str(fleet.applied_file))
    return effective(started, applied), data


def check_config(path: str) -> int:
    """Validate a config file and print the effective config, secrets redacted."""
    try:
        config, _ = _load(path)
    except ConfigError as exc:
        _report(exc)
        return EXIT_CONFIG
    text = yaml.safe_dump(redacted(config), sort_keys=False, allow_unicode=True)
    if REDACTED in text:
        print(f"# {REDACTED} stands for a secret: put it (or its ${{VAR}}) back to reuse this.")
    sys.stdout.write(text)
    print(f"# {path}: ok, {len(config.routes)} route(s)", file=sys.stderr)
    return 0


async def _listen(site: web.TCPSite, host: str, port: int, listener: Listener) -> None:
    try:
        await site.start()
    except OSError as exc:
        raise CannotListen(host, port, reason(exc), listener) from exc


async def serve(
    config: Config,
    host: str,
    port: int,
    admin_port: int | None = None,
    *,
    config_path: str | None = None,
    config_hash: str = "",
    fleet: Fleet | None = None,
) -> None:
    """Serve agents on host:port and the admin endpoints on their own listener
    (server.admin_host, `admin_port` or server.admin_port) until SIGTERM or SIGINT, then drain:
    in-flight requests get shutdown_grace, those still running are cut (answered 503
    shutting_down, or logged `cut: shutdown` mid-stream) and the process exits within
    shutdown_grace plus about a second. SIGHUP reloads `config_path` (proxy/reload.py).
    A worker of a `fleet` shares the agents' port with its siblings (SO_REUSEPORT), worker 0
    alone serves the admin listener, and each answers its siblings on its own socket."""
    log = structlog.get_logger("search_proxy")
    loop = asyncio.get_running_loop()
    max_connections, open_files = connection_budget(config.server)
    map_large_allocations()
    overload = OverloadLog(loop.time, loop.call_at, max_connections)
    loop.set_exception_handler(overload)  # asyncio's failed accepts: one line per interval
    if max_connections < config.server.max_connections:
        log.warning(
            "max_connections_lowered",
            max_connections=max_connections,
            configured=config.server.max_connections,
            open_files_limit=open_files,
            hint="raise the open-files limit (ulimit -n) to allow more agents' connections",
        )
    limits = dataclasses.replace(config.server, max_connections=max_connections)
    app = build_app(config, config_path=config_path, config_hash=config_hash)
    admin_app = build_admin_app(app)
    runners: list[web.BaseRunner] = []  # what is set up, to clean up
    if fleet is not None:
        app[FLEET] = admin_app[FLEET] = fleet
        app[RELOADER].on_applied = fleet.keep_config
        admin_app.middlewares.append(fan_out(fleet))
        runners.append(
            web.AppRunner(sibling_app(app, fleet), access_log=None, handle_signals=False)
        )
    runner = GuardedRunner(
        app,
        limits,
        overload,
        app[STATE].memory,
        access_log=None,
        # By cleanup time the drain below has ended every request: this only bounds stragglers.
        shutdown_timeout=CUT_MARGIN_S,
        handle_signals=False,
    )
    await runner.setup()  # builds the routes: a reload has something to replace from here on
    # nginx's habit (and systemd's ExecReload): SIGHUP reloads the config, never ends the process.
    loop.add_signal_handler(signal.SIGHUP, app[RELOADER].request, "signal")
    admin_runner = GuardedRunner(
        admin_app, limits, access_log=None, shutdown_timeout=CUT_MARGIN_S, handle_signals=False
    )
    admin_host = config.server.admin_host
    admin_port = config.server.admin_port if admin_port is None else admin_port
    shared = True if fleet is not None else None  # SO_REUSEPORT: the supervisor holds the port
    try:
        site = web.TCPSite(
            runner, host, port, backlog=LISTEN_BACKLOG, reuse_address=True, reuse_port=shared
        )
        await _listen(site, host, port, AGENTS)
        if fleet is None or fleet.index == 0:
            await admin_runner.setup()
            runners.insert(0, admin_runner)
            admin_site = web.TCPSite(admin_runner, admin_host, admin_port, reuse_port=shared)
            await _listen(admin_site, admin_host, admin_port, ADMIN)
        if fleet is not None:
            await runners[-1].setup()
            await web.UnixSite(runners[-1], str(fleet.socket(fleet.index))).start()
    except CannotListen:
        loop.remove_signal_handler(signal.SIGHUP)
        for other in runners:
            if other.server is not None:
                await other.cleanup()
        await runner.cleanup()
        raise
    # Everything built so far lives as long as the process: out of the collector's sight, a
    # full collection no longer walks it (the MCP server's pydantic models are many).
    gc.freeze()
    # The young generation is walked when tracked objects allocated outnumber those freed by the
    # first threshold. With dozens of requests in flight, each holding a few hundred, CPython's
    # 700 walked it every few requests for the rare cycle. A/B under bench core's load: plain
    # +7%, miss +8%, hit +2%; `make bench core`'s RSS after the load unchanged.
    gc.set_threshold(*GC_THRESHOLDS)
    bound = runner.addresses[0]
    admin_bound = admin_runner.addresses[0] if admin_runner.server else (admin_host, admin_port)
    app[STATE].agents_address = address(bound[0], bound[1])
    app[STATE].admin_address = address(admin_bound[0], admin_bound[1])
    log.info(
        "listening" if fleet is None else "worker_listening",
        host=bound[0],
        port=bound[1],
        admin_host=admin_bound[0],
        admin_port=admin_bound[1],
        **_listening(config, config_path, config_hash),
        max_connections=max_connections,
    )
    if fleet is not None:
        fleet.ready()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()  # a SIGHUP while draining still reloads (never the default: exit)
    grace = app[STATE].config.server.shutdown_grace  # as the last reload left it
    deadline = loop.time() + grace
    log.info(
        "shutting_down", grace_s=grace, in_flight=runner.guarded.in_flight if runner.guarded else 0
    )
    for other in runners:
        await other.cleanup()
    await runner.stop_accepting()
    cut = await runner.drain(deadline)
    await runner.cleanup()
    overload.flush()
    log.info("stopped", cut=cut)


def _listening(config: Config, config_path: str | None, digest: str) -> dict[str, object]:
    """What the `listening` line says of the config served."""
    said: dict[str, object] = {
        "routes": {name: r.prefix for name, r in config.routes.items()},
        "redis": "configured" if config.redis else "in-process state",
        "event_loop": chosen(config.server.event_loop),
        "config_hash": digest,
        "watch_config": config.server.watch_config and config_path is not None,
    }
    if config.redis:  # redis-py reads replies with hiredis (C, the `fast` extra) when installed
        from redis.utils import HIREDIS_AVAILABLE

        said["redis_parser"] = "hiredis" if HIREDIS_AVAILABLE else "python"
    return said


def _supervise(config: Config, data: bytes, opts: argparse.Namespace, workers: int) -> int:
    """Become the supervisor of `workers` workers (proxy/supervisor.py): a fresh process image,
    so it holds none of what validating the config loaded. Returns only if it cannot."""
    run_dir = tempfile.mkdtemp(prefix="search-proxy-run-")  # the user's alone (0700)
    (Path(run_dir) / CONFIG_FILE).write_bytes(data)
    server = config.server
    plan = Plan(
        config=opts.config,
        host=opts.host or server.host,
        port=server.port if opts.port is None else opts.port,
        admin_host=server.admin_host,
        admin_port=server.admin_port if opts.admin_port is None else opts.admin_port,
        workers=workers,
        run_dir=run_dir,
        log_level=config.log.level,
        log_format=config.log.format,
        listening=_listening(config, opts.config, config_hash(data)),
    )
    sys.stdout.flush()
    sys.stderr.flush()
    argv = plan.argv()
    try:
        os.execv(argv[0], argv)
    except OSError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"search-proxy: cannot start the supervisor: {exc}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `search-proxy` console script and `python -m proxy`; returns the
    exit status (0 after --help or --version, 2 for a usage or config error)."""
    try:
        opts = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed the help, the version or the usage error
        return exc.code if isinstance(exc.code, int) else EXIT_CONFIG
    if opts.command == "check-config":
        return check_config(opts.file)
    problem = internals_problem()
    if problem is not None:
        print(f"search-proxy: {problem}", file=sys.stderr)
        return 1
    fleet = Fleet.from_env()  # a worker: the supervisor's copy of the config it validated
    if fleet is not None:
        fleet.follow_supervisor()
    try:
        config, data = _load(opts.config) if fleet is None else _worker_config(opts.config, fleet)
    except ConfigError as exc:
        _report(exc)
        return EXIT_CONFIG
    workers = resolve(config.server.workers) if fleet is None else 1
    if workers > 1:
        return _supervise(config, data, opts, workers)
    configure_logging(
        config.log.level,
        config.log.format,
        secrets=secret_values(config),
        worker=fleet.index if fleet else None,
    )
    host = opts.host or config.server.host
    port = config.server.port if opts.port is None else opts.port
    try:
        with asyncio.Runner(loop_factory=loop_factory(config.server.event_loop)) as runner:
            runner.run(
                serve(
                    config,
                    host,
                    port,
                    opts.admin_port,
                    config_path=opts.config,
                    config_hash=config_hash(data),
                    fleet=fleet,
                )
            )
    except CannotListen as exc:
        print(f"search-proxy: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"search-proxy: cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

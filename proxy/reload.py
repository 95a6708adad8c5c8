"""Reloading the config while serving (SIGHUP, POST /admin/reload, the file watch): validate it as
start-up does, build the new routes keeping unchanged state, swap them in at once; requests in
flight finish on their routes, and a config that does not validate changes nothing."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import structlog
from aiohttp import web

from proxy import __version__
from proxy.config import (
    Config,
    ConfigError,
    ConfigErrors,
    InvalidConfig,
    as_document,
    load_config,
    read_config_file,
    secret_values,
)
from proxy.config.sections import mcp_server_config
from proxy.generation import build_generation
from proxy.logs import learn_secrets
from proxy.redact import redact_text
from proxy.startup import check_startup, startup_errors
from proxy.state import STATE, ProxyState

log = structlog.get_logger("search_proxy")

# Settings a running process cannot change: its sockets, its upstream pool, its Redis link, its
# log set-up and the MCP server's mount. A reload names them and keeps serving them as they are.
RESTART_ONLY = (
    "server.host",
    "server.port",
    "server.admin_host",
    "server.admin_port",
    "server.max_connections",
    "server.max_connections_per_peer",
    "server.header_timeout",
    "server.body_timeout",
    "server.request_timeout",
    "server.send_timeout",
    "server.client_keepalive_timeout",
    "server.max_body_bytes",
    "server.max_buffered_bytes",
    "server.upstream_connections",
    "server.upstream_connections_per_host",
    "server.keepalive_timeout",
    "server.workers",
    "server.event_loop",
    "redis",
    "log",
    "mcp_server.enabled",
    "mcp_server.path",
)
WATCH_INTERVAL_S = 1.0  # how often the file is looked at (one stat call)
SETTLE_S = 0.2  # how long a changed file must hold still before it is read
HASH_CHARS = 12


def config_hash(data: bytes) -> str:
    """What `search_proxy_config_info{hash}` and the status page show of a config file: the
    first 12 hex digits of its SHA-256 (`sha256sum config.yaml | cut -c1-12`)."""
    return hashlib.sha256(data).hexdigest()[:HASH_CHARS]


def _changed_keys(old: Any, new: Any) -> list[str]:
    """The keys whose values differ between two mappings (one missing counts)."""
    old, new = old or {}, new or {}
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))


@dataclass
class Changes:
    """What a new config changes: routes added, removed and changed (which of their keys and
    sections), and the other settings changed, as YAML paths."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: dict[str, list[str]] = field(default_factory=dict)
    settings: list[str] = field(default_factory=list)

    @property
    def restart_required(self) -> list[str]:
        """The changed settings a reload cannot apply."""
        return [s for s in self.settings if s in RESTART_ONLY or s.split(".")[0] in RESTART_ONLY]


def changes(old: Config, new: Config) -> Changes:
    """Compare two configs, key by key of their YAML form."""
    before, after = as_document(old), as_document(new)
    found = Changes()
    old_routes, new_routes = before.pop("routes"), after.pop("routes")
    found.added = sorted(new_routes.keys() - old_routes.keys())
    found.removed = sorted(old_routes.keys() - new_routes.keys())
    for name in sorted(old_routes.keys() & new_routes.keys()):
        keys = _changed_keys(old_routes[name], new_routes[name])
        if keys:
            found.changed[name] = keys
    for top in sorted(before.keys() | after.keys()):
        a, b = before.get(top), after.get(top)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            found.settings += (f"{top}.{key}" for key in _changed_keys(a, b))
        else:
            found.settings.append(top)
    return found


def effective(old: Config, new: Config) -> Config:
    """`new` with the restart-only settings it changes left as `old` serves them; ConfigErrors
    when the MCP server, kept where it is, would not fit the new routes."""
    kept = {p.split(".", 1)[1] for p in RESTART_ONLY if p.startswith("server.")}
    server = replace(
        new.server, **{k: getattr(old.server, k) for k in kept if hasattr(old.server, k)}
    )
    mcp = replace(new.mcp_server, enabled=old.mcp_server.enabled, path=old.mcp_server.path)
    config = replace(new, server=server, redis=old.redis, log=old.log, mcp_server=mcp)
    if mcp != new.mcp_server:
        given = {"enabled": mcp.enabled, "path": mcp.path, "allow_remote": mcp.allow_remote}
        _, problems = mcp_server_config(given, config.routes, config.search_api.providers)
        if problems:
            hint = " (mcp_server.enabled and mcp_server.path change on restart only)"
            raise ConfigErrors([ConfigError(p.path, p.reason + hint) for p in problems])
    return config


@dataclass
class ReloadReport:
    """What one reload did: the answer of POST /admin/reload and its log line."""

    result: str  # applied, unchanged or failed
    trigger: str  # signal, admin or watch
    hash: str  # the file's, when it could be read
    changes: Changes = field(default_factory=Changes)
    kept: dict[str, list[str]] = field(default_factory=dict)  # route -> stateful parts kept
    errors: list[str] = field(default_factory=list)  # `path: reason`, one per mistake

    def public(self) -> dict[str, Any]:
        c = self.changes
        return {
            "result": self.result,
            "trigger": self.trigger,
            "hash": self.hash,
            "routes": {"added": c.added, "removed": c.removed, "changed": c.changed},
            "settings": c.settings,
            "restart_required": c.restart_required,
            "kept": self.kept,
            "errors": self.errors,
        }


def _error_lines(exc: ConfigError) -> list[str]:
    errors = exc.errors if isinstance(exc, ConfigErrors) else (exc,)
    return [redact_text(str(error)) for error in errors]


class Reloader:
    """Reloads the app's config, one reload at a time; `watch()` polls the file."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[ReloadReport]] = set()
        self.last: ReloadReport | None = None
        self.seen = state.config_hash  # the content last read, applied or not
        self._closed = False
        self._settled: tuple[Any, ...] | None = self._signature()
        # Told the bytes of each config applied (a worker keeps them for its restarted siblings).
        self.on_applied: Callable[[bytes], None] | None = None

    def request(self, trigger: str) -> None:
        """Reload in the background (a signal handler cannot wait)."""
        task = asyncio.get_running_loop().create_task(self.reload(trigger))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[ReloadReport]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("config_reload_crashed", exc_info=task.exception())

    async def reload(self, trigger: str) -> ReloadReport:
        """Read, validate and apply the config file; the report says what happened."""
        async with self._lock:
            if self._closed:  # shutting down: nothing to reload into
                return ReloadReport("failed", trigger, "", errors=["the proxy is shutting down"])
            report = await self._reload(trigger)
            self.last = report
        self.state.metrics.config_reloads.labels(report.result).inc()
        fields = report.public()
        if report.result == "failed":
            log.error("config_reload", **fields)
        elif report.changes.restart_required:
            log.warning("config_reload", **fields)
        else:
            log.info("config_reload", **fields)
        return report

    async def close(self) -> None:
        """At shutdown: let a reload under way finish its swap, and refuse any after it."""
        self._closed = True
        async with self._lock:
            pass
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _reload(self, trigger: str) -> ReloadReport:
        state = self.state
        if state.config_path is None:
            reason = "this proxy was not started from a config file: there is nothing to reload"
            return ReloadReport("failed", trigger, "", errors=[reason])
        try:
            data = await asyncio.to_thread(read_config_file, state.config_path)
        except ConfigError as exc:
            return ReloadReport("failed", trigger, "", errors=_error_lines(exc))
        digest = self.seen = config_hash(data)
        if digest == state.config_hash:
            return ReloadReport("unchanged", trigger, digest)
        try:
            try:
                new = load_config(state.config_path, data=data)
            except InvalidConfig as exc:  # every mistake in one answer, as check-config does
                learn_secrets(secret_values(exc.partial))
                raise ConfigErrors([*exc.errors, *await startup_errors(exc.partial)]) from None
            learn_secrets(secret_values(new))  # before any line could carry one of its secrets
            await check_startup(new)
            config = effective(state.config, new)
            assert state.vendors is not None  # the app is serving
            generation = build_generation(
                config,
                state.vendors,
                state.clock,
                state.metrics,
                state.redis,
                previous=state.generation,
                serving=lambda name: state.routes.get(name),
                direct_hooks=state.direct_hooks,
            )
        except ConfigError as exc:
            return ReloadReport("failed", trigger, digest, errors=_error_lines(exc))
        except ValueError as exc:  # a constructor's refusal that check_startup did not meet
            why = redact_text(f"the new routes cannot be built: {exc}")
            return ReloadReport("failed", trigger, digest, errors=[why])
        report = ReloadReport(
            "applied", trigger, digest, changes(state.config, new), generation.kept.reused
        )
        await generation.start()
        old = state.generation
        state.use(generation)
        state.config_hash = digest
        state.metrics.identify(__version__, digest)
        if old is not None:
            await old.release(generation)
        if self.on_applied is not None:
            self.on_applied(data)
        return report

    def _signature(self) -> tuple[Any, ...] | None:
        """What says the file changed: its resolved path (a swapped symlink changes it), inode,
        size and modification time; None when it cannot be read."""
        if self.state.config_path is None:
            return None
        try:
            real = os.path.realpath(self.state.config_path)
            st = os.stat(real)
        except OSError:
            return None
        return (real, st.st_ino, st.st_size, st.st_mtime_ns)

    async def poll(self) -> bool:
        """Whether the file changed and holds a config not read yet. A change is read once the
        file has held still for SETTLE_S (an editor may still be writing it)."""
        signature = self._signature()
        if signature is None or signature == self._settled:
            return False
        await asyncio.sleep(SETTLE_S)
        if self._signature() != signature:
            return False  # still changing: the next poll looks again
        self._settled = signature
        assert self.state.config_path is not None
        try:
            data = await asyncio.to_thread(read_config_file, self.state.config_path)
        except ConfigError:
            return False
        return config_hash(data) != self.seen

    async def watch(self) -> None:
        """Reload when the file changes, while server.watch_config is on; runs until cancelled."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if not self.state.config.server.watch_config:
                continue
            try:
                if await self.poll():
                    await self.reload("watch")
            except Exception:  # a bug must not end the watch; it is logged with its traceback
                log.exception("config_reload_crashed")


RELOADER = web.AppKey("reloader", Reloader)


async def reload_endpoint(request: web.Request) -> web.Response:
    """POST /admin/reload: reload now and say what changed, or why nothing did (422)."""
    state = request.app[STATE]

    async def handle(request: web.Request) -> web.Response:
        report = await request.app[RELOADER].reload("admin")
        status = 422 if report.result == "failed" else 200
        body = orjson.dumps(report.public())
        return web.Response(status=status, body=body, content_type="application/json")

    assert state.admin is not None  # built with the routes, before the admin listener opens
    return await state.admin.answer(request, handle)


__all__ = ["RELOADER", "RESTART_ONLY", "Changes", "ReloadReport", "Reloader", "config_hash"]

"""What the process can hold: the open-files limit and the share of it agents' connections get,
one warning line per interval however an overload shows, and giving freed heap back to the OS."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import ipaddress
import math
import resource
from collections.abc import Callable
from typing import Any

import structlog

from proxy.config import ServerConfig

log = structlog.get_logger("search_proxy")

# asyncio's own report of a failed accept() (no file descriptor left).
ACCEPT_FAILED = "socket.accept() out of system resource"
LOG_INTERVAL_S = 10.0  # events that can repeat thousands of times a second: one line per interval
FD_RESERVE = 64  # files besides agents' and upstream connections: listener, Redis, logs, DNS
# The listen backlog, and so how many connections asyncio may accept in one go before any of
# the refused ones is closed: their file descriptors count too.
LISTEN_BACKLOG = 1024


class OverloadLog:
    """At most one warning line per interval however an overload of connections shows: refused
    past max_connections, or accept() failing for want of file descriptors, which asyncio reports
    once per waiting connection and again at every retry (tens of thousands of lines a second).

    Each line counts what happened since the previous one; what a quiet interval held back is
    written when it ends. It is also the event loop's exception handler: failed accepts are
    counted here, everything else goes to asyncio's default handler.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        call_at: Callable[[float, Callable[[], None]], object],
        max_connections: int,
        interval: float = LOG_INTERVAL_S,
    ) -> None:
        self.clock = clock
        self.call_at = call_at  # loop.call_at
        self.max_connections = max_connections
        self.interval = interval
        self._next = -math.inf  # no line before this time
        self._flush_due = False
        self._refused = 0
        self._per_peer = 0  # of them, refused because their address had its share open
        self._failed = 0
        self._error: str | None = None

    def refused(self, *, per_peer: bool = False) -> None:
        """A connection was refused because max_connections were open (`per_peer`: because
        its address had max_connections_per_peer open)."""
        self._refused += 1
        self._per_peer += per_peer
        self._report()

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_FAILED:
            loop.default_exception_handler(context)
            return
        self._failed += 1
        self._error = str(context.get("exception"))
        self._report()

    def _report(self) -> None:
        if self.clock() >= self._next:
            self._write()
        elif not self._flush_due:
            self._flush_due = True
            self.call_at(self._next, self.flush)

    def flush(self) -> None:
        """Write what is held back now (at the end of a quiet interval, and at exit)."""
        self._flush_due = False
        if self._refused or self._failed:
            self._write()

    def _write(self) -> None:
        self._next = self.clock() + self.interval
        fields: dict[str, Any] = {}
        if self._failed:
            fields["error"] = self._error
            fields["hint"] = "out of file descriptors: raise ulimit -n or lower max_connections"
        if self._per_peer:
            fields["per_peer"] = self._per_peer
        log.warning(
            "connections_refused",
            refused=self._refused,
            accept_failed=self._failed,
            max_connections=self.max_connections,
            **fields,
        )
        self._refused = self._per_peer = self._failed = 0
        self._error = None


def open_files_limit(wanted: int) -> int:
    """Raise this process's soft limit on open files towards `wanted` (as far as the hard limit
    allows, as nginx's worker_rlimit_nofile does); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    if soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def peer_of(peername: Any) -> str | None:
    """Whose connection this is, for max_connections_per_peer: the IPv4 address, or the /64 of
    an IPv6 one (a single host is given a whole /64); None for a Unix socket."""
    if not isinstance(peername, tuple) or not peername:
        return None
    try:
        address = ipaddress.ip_address(str(peername[0]).partition("%")[0])
    except ValueError:
        return str(peername[0])
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def per_peer_limit(server: ServerConfig) -> int:
    """Connections one address may hold open: max_connections_per_peer, else half of
    max_connections, so that no single address can take every slot."""
    return server.max_connections_per_peer or max(1, server.max_connections // 2)


def connection_budget(server: ServerConfig) -> tuple[int, int]:
    """(max_connections, open-files limit): max_connections lowered if need be so that agents'
    connections, with a burst of refused ones, cannot use up the file descriptors (where every
    accept() fails). Under a very low limit, half of it still goes to agents."""
    reserve = server.upstream_connections + FD_RESERVE + LISTEN_BACKLOG
    limit = open_files_limit(server.max_connections + reserve)
    return min(server.max_connections, max(limit - reserve, limit // 2)), limit


def _glibc(name: str) -> Callable[..., int] | None:
    try:
        found: Callable[..., int] = getattr(ctypes.CDLL(None), name)  # glibc only
    except (OSError, AttributeError):
        return None
    return found


_MALLOC_TRIM = _glibc("malloc_trim")
_MALLOPT = _glibc("mallopt")
_M_MMAP_THRESHOLD = -3
# Above what a socket read asks for at once (asyncio's recv buffer is 256 KiB): were that
# mapped, every read of every connection would map and unmap pages (15% of a forwarded
# request under asyncio). A vendor's large answer or a big request body is still mapped.
MMAP_THRESHOLD = 512 * 1024


def map_large_allocations() -> None:
    """Have glibc give every allocation above MMAP_THRESHOLD (a vendor's large answer, a big
    request body) pages of its own, returned to the OS when freed. By default it raises that
    threshold after each large free, up to 32 MiB, and a burst of large bodies then stays in a
    heap it keeps: the process's memory did not come back after one (elsewhere a no-op). What
    stays below it is handed back by `trim_heap` once a burst has drained."""
    if _MALLOPT is not None:
        _MALLOPT(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc keeps them otherwise; elsewhere a no-op)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


RECLAIM_DELAY_S = 1.0  # a burst's objects are still referenced as it drains: look after it
RECLAIM_EVERY_S = 10.0  # a full collection at most this often, however busy the proxy


class Reclaimer:
    """Gives a burst's memory back to the OS once it has drained: a flood of connections gone
    (proxy/guard.py), or the bodies of the memory budget all written (proxy/budget.py).

    What a failed or cut exchange leaves sits in reference cycles (its task, its exception's
    traceback and frames) that only a full collection finds, and glibc keeps freed heap unless
    asked: so collect, then trim a moment later, once the buffers the collection freed are gone.
    One per process (`RECLAIMER`): the memory is the process's."""

    def __init__(self, delay: float = RECLAIM_DELAY_S) -> None:
        self.delay = delay  # after the ask, and again before the trim
        self._pending: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last = -RECLAIM_EVERY_S

    def soon(self, after: str, *, every: float = RECLAIM_EVERY_S, **fields: Any) -> None:
        """Reclaim `delay` seconds from now (or `every` seconds after the last), unless one is
        due already; `after` and `fields` say why, in its log line."""
        loop = asyncio.get_running_loop()
        if self._pending is not None and self._loop is loop:
            return
        self._loop = loop
        due = max(loop.time() + self.delay, self._last + every)
        self._pending = loop.call_at(due, self._collect, after, fields)

    def _collect(self, after: str, fields: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        started = self._last = loop.time()
        found = gc.collect()
        took_ms = round((loop.time() - started) * 1000, 1)
        log.info("memory_reclaimed", after=after, objects=found, took_ms=took_ms, **fields)
        self._pending = loop.call_later(self.delay, self._trim)

    def _trim(self) -> None:
        trim_heap()
        self._pending = None


RECLAIMER = Reclaimer()

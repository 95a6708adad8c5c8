"""Hostile agents against the proxy process: what they cost it, and what normal agents notice.

- held-connections: 1,000 idle connections, 1,000 slowloris connections (a header byte every
  2 s, never finishing the head) and 30 agents that ask for a 10 MB streamed answer and never
  read it, all held together for at least HOLD_S while a normal agent sends searches (2 at a
  time). Figures: proxy RSS at baseline (after warm-up), at its peak (VmHWM) and once the
  hostile agents have left; p50 / p99 / max of the normal searches meanwhile. Targets: peak
  <= 150 MB, after within 10 MB of baseline, p99 <= 50 ms.
- fd-limit: the proxy started under `prlimit --nofile=256` with max_connections 1000 (more
  than 256 files allow), then FLOOD connections opened and held. Figures: the max_connections
  the proxy settled on, how many connections were refused at once (503) and held, log lines per
  second during the flood (target <= 1; asyncio alone logged thousands a second at the fd
  limit), the proxy's CPU while the connections are held (no spinning), and whether a normal
  request is served once they leave.

Server limits are the defaults (header, body and send timeouts 60 s, keep-alive 75 s) except
max_connections, so nothing held times out during the scenario. Loopback only; the hostile
agents and the normal agent run in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.client import run_load
from bench.procs import Pinning, fake_vendor, proxy
from bench.report import Figure, Scenario, at_most, every, percentile
from testkit.procs import Child, StartError

IDLE = 1000
SLOWLORIS = 1000
SLOW_READERS = 30
STREAM_CHUNKS, STREAM_CHUNK_BYTES = 160, 65536  # 10 MiB per slow reader
HOLD_S = 8.0
SETTLE_S = 3.0  # after the hostile agents leave, before RSS is read again
NORMAL_SEARCHES, NORMAL_CONCURRENCY = 1000, 2
RSS_PEAK_MB, RSS_RETURN_MB, P99_MS = 150.0, 10.0, 50.0

FD_LIMIT = 256
FLOOD = 400
FLOOD_HOLD_S = 3.0
ROUTE_TIMEOUTS = {"connect": "1s", "per_try": "30s", "total": "60s"}


# ------------------------------------------------------------------------------- processes


@contextlib.contextmanager
def hostile_proxy(
    pinning: Pinning,
    vendor_url: str,
    server: dict[str, Any],
    *,
    wrapper: tuple[str, ...] = (),
    timeout: float = 15.0,
    routes: dict[str, Any] | None = None,
) -> Iterator[tuple[str, Child]]:
    """`python -m proxy` (log level warning) with these `server:` keys, one route /v to the
    fake vendor (or these `routes`); yields (url, child) once /healthz answers. Its output is
    in child.log_path."""
    routes = routes or {"v": {"prefix": "/v", "upstream": vendor_url, "timeouts": ROUTE_TIMEOUTS}}
    with proxy(pinning, routes, server=server, wrapper=wrapper, timeout=timeout) as started:
        yield started


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak so far) of a process, in MB."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) / 1024
    return found


def log_lines(child: Child) -> list[str]:
    return Path(child.log_path).read_text(errors="replace").splitlines()


# ------------------------------------------------------------------------------ the agents


class Hostile:
    """The hostile agents' connections, opened and held in this process's loop."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[asyncio.StreamWriter] = []
        self.slowloris: list[asyncio.StreamWriter] = []
        self.readers: list[asyncio.StreamWriter] = []
        self.failed: Counter[str] = Counter()

    async def _open(self, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, Any] | None:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (self.host, self.port)), 5)
            return await asyncio.open_connection(sock=sock)
        except (OSError, TimeoutError) as exc:
            sock.close()
            self.failed[type(exc).__name__] += 1
            return None

    async def _many(self, n: int, first_bytes: bytes, rcvbuf: int | None = None) -> list[Any]:
        opened: list[Any] = []
        for start in range(0, n, 100):  # batches under the listen backlog
            pairs = await asyncio.gather(*(self._open(rcvbuf) for _ in range(min(100, n - start))))
            for pair in pairs:
                if pair is not None:
                    if first_bytes:
                        pair[1].write(first_bytes)
                    opened.append(pair[1])
        return opened

    async def open_all(self, stream_path: str) -> None:
        self.idle = await self._many(IDLE, b"")
        self.slowloris = await self._many(SLOWLORIS, b"GET /v/search HTTP/1.1\r\nHost: x\r\n")
        request = f"GET {stream_path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        # A small receive buffer, and this process's StreamReader stops reading at 64 KiB.
        self.readers = await self._many(SLOW_READERS, request, rcvbuf=4096)

    async def drip(self, stop: asyncio.Event) -> None:
        """One more header byte on every slowloris connection every 2 s."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 2.0)
            for writer in self.slowloris:
                if not writer.is_closing():
                    writer.write(b"a")

    def close_all(self) -> None:
        for writer in (*self.idle, *self.slowloris, *self.readers):
            writer.transport.abort()

    def counts(self) -> str:
        alive = [
            sum(1 for w in group if not w.is_closing())
            for group in (self.idle, self.slowloris, self.readers)
        ]
        text = f"{alive[0]} idle, {alive[1]} slowloris, {alive[2]} slow readers open"
        return text + (f"; failed to open: {dict(self.failed)}" if self.failed else "")


def _search(i: int) -> dict[str, Any]:
    return {"query": f"hostile bench normal search {i}", "max_results": 3}


# ------------------------------------------------------------------------------- scenarios


async def _held_connections(url: str, child: Child) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    warm = await run_load(f"{url}/v/tavily/search", 200, 4, _search)
    baseline = memory_mb(child.pid)["VmRSS"]
    cpu0 = child.cpu_seconds()
    hostile = Hostile(host, int(port))
    t0 = time.perf_counter()
    await hostile.open_all(f"/v/stream?chunks={STREAM_CHUNKS}&size={STREAM_CHUNK_BYTES}")
    opened_s = time.perf_counter() - t0
    stop = asyncio.Event()
    drip = asyncio.create_task(hostile.drip(stop))
    held_from = time.perf_counter()
    normal = await run_load(f"{url}/v/tavily/search", NORMAL_SEARCHES, NORMAL_CONCURRENCY, _search)
    if (left := HOLD_S - (time.perf_counter() - held_from)) > 0:
        await asyncio.sleep(left)
    held = hostile.counts()
    during = memory_mb(child.pid)
    held_s = time.perf_counter() - held_from
    stop.set()
    await drip
    hostile.close_all()
    await asyncio.sleep(SETTLE_S)
    after_load = await run_load(f"{url}/v/tavily/search", 100, 4, _search)
    after = memory_mb(child.pid)["VmRSS"]
    return {
        "warm": warm,
        "baseline": baseline,
        "peak": during["VmHWM"],
        "held_rss": during["VmRSS"],
        "after": after,
        "normal": normal,
        "after_load": after_load,
        "held": held,
        "opened_s": opened_s,
        "held_s": held_s,
        "cpu": child.cpu_seconds() - cpu0,
    }


def held_connections(pinning: Pinning, vendor_url: str) -> list[Scenario]:
    # All from 127.0.0.1: the per-peer cap (half of max_connections) is not what is measured.
    server = {"max_connections": 4000, "max_connections_per_peer": 4000}
    with hostile_proxy(pinning, vendor_url, server) as (url, child):
        r = asyncio.run(_held_connections(url, child))
    normal = r["normal"]
    ms = [o.seconds * 1000 for o in normal.outcomes]
    s = Scenario("hostile/held-connections")
    s.figures = [
        Figure("RSS baseline", f"{r['baseline']:.0f} MB"),
        at_most("peak", r["peak"], RSS_PEAK_MB, "{:.0f} MB"),
        at_most("after they left: +", r["after"] - r["baseline"], RSS_RETURN_MB, "{:.1f} MB"),
        every("normal searches answered", normal.ok, normal.n),
        Figure("p50", f"{percentile(ms, 50):.1f} ms"),
        at_most("p99", percentile(ms, 99), P99_MS, "{:.1f} ms"),
    ]
    s.details = [
        f"held: {r['held']} (opened in {r['opened_s']:.1f} s, held {r['held_s']:.1f} s); "
        f"proxy RSS while held {r['held_rss']:.0f} MB, after {r['after']:.0f} MB; "
        f"proxy CPU {r['cpu']:.1f} s over the scenario",
        f"normal searches meanwhile ({NORMAL_CONCURRENCY} at a time): {normal.statuses()}, "
        f"max {max(ms):.1f} ms; after they left: {r['after_load'].statuses()}",
        "slow readers: each asked for "
        f"{STREAM_CHUNKS * STREAM_CHUNK_BYTES / 2**20:.0f} MiB streamed and read at most 64 KiB",
    ]
    slowest = sorted(normal.outcomes, key=lambda o: -o.seconds)[:3]
    s.details.append(
        "slowest normal searches (#index: ms; #0 goes out as the hostile agents' streams "
        "start): " + ", ".join(f"#{o.index}: {o.seconds * 1000:.0f}" for o in slowest)
    )
    if failure := normal.sample_failure():
        s.details.append(f"e.g. {failure}")
    return [s]


async def _flood(url: str, child: Child) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    hostile = Hostile(host, int(port))
    flood_from = datetime.now(UTC)
    cpu0 = child.cpu_seconds()
    t0 = time.perf_counter()
    pairs = await asyncio.gather(*(hostile._open() for _ in range(FLOOD)))
    opened_s = time.perf_counter() - t0

    async def refused(pair: tuple[asyncio.StreamReader, Any] | None) -> bool | None:
        if pair is None:
            return None
        with contextlib.suppress(TimeoutError, ConnectionError):
            data = await asyncio.wait_for(pair[0].read(4096), 1.0)
            return data.startswith(b"HTTP/1.1 503")
        return False

    verdicts = await asyncio.gather(*(refused(p) for p in pairs))
    cpu1 = child.cpu_seconds()
    await asyncio.sleep(FLOOD_HOLD_S)
    hold_cpu = child.cpu_seconds() - cpu1
    for pair in pairs:
        if pair is not None:
            pair[1].transport.abort()
    await asyncio.sleep(0.5)
    after = await run_load(f"{url}/v/tavily/search", 20, 2, _search)
    return {
        "refused": sum(1 for v in verdicts if v),
        "held": sum(1 for v in verdicts if v is False),
        "failed": dict(hostile.failed),
        "opened_s": opened_s,
        "flood_cpu": cpu1 - cpu0,
        "hold_cpu": hold_cpu,
        "after": after,
        "flood_from": flood_from,
    }


def fd_limit(pinning: Pinning, vendor_url: str) -> list[Scenario]:
    if shutil.which("prlimit") is None:
        return [Scenario("hostile/fd-limit", error="prlimit is not installed (util-linux)")]
    wrapper = ("prlimit", f"--nofile={FD_LIMIT}:{FD_LIMIT}", "--")
    limits = {"max_connections": 1000, "max_connections_per_peer": 1000}
    with hostile_proxy(pinning, vendor_url, limits, wrapper=wrapper) as (
        url,
        child,
    ):
        r = asyncio.run(_flood(url, child))
        child.proc.terminate()  # the proxy writes what its log held back as it exits
        child.proc.wait(10)
        lines = log_lines(child)
    events: list[dict[str, Any]] = []
    other = 0
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            other += 1
    lowered = next((e for e in events if e.get("event") == "max_connections_lowered"), {})
    during = [
        e
        for e in events
        if "timestamp" in e
        and datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")) >= r["flood_from"]
    ]
    per_second = Counter(e["timestamp"][:19] for e in during)
    worst = max(per_second.values(), default=0)
    kinds = Counter(str(e.get("event")) for e in during)
    s = Scenario("hostile/fd-limit")
    s.figures = [
        Figure("max_connections", str(lowered.get("max_connections", "not lowered"))),
        Figure("refused at once", f"{r['refused']}/{FLOOD}"),
        at_most("log lines/s", worst, 1, "{:.0f}"),
        Figure("CPU while held", f"{r['hold_cpu'] / FLOOD_HOLD_S:.1%}"),
        every("served after", r["after"].ok, r["after"].n),
    ]
    s.details = [
        f"proxy under prlimit --nofile={FD_LIMIT}, max_connections 1000 configured; {FLOOD} "
        f"connections opened in {r['opened_s']:.2f} s: {r['refused']} answered 503 and closed "
        f"at once, {r['held']} held; could not connect: {r['failed'] or 0}",
        f"log during the flood: {len(during)} lines {dict(kinds)} counting "
        f"{sum(e.get('refused', 0) for e in during)} refusals and "
        f"{sum(e.get('accept_failed', 0) for e in during)} failed accepts, plus {other} "
        f"non-JSON lines in the whole run; proxy CPU {r['flood_cpu']:.2f} s during the flood, "
        f"{r['hold_cpu']:.2f} s over the {FLOOD_HOLD_S:.0f} s hold",
    ]
    return [s]


SCENARIOS: tuple[Callable[[Pinning, str], list[Scenario]], ...] = (held_connections, fd_limit)


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    """One fake vendor for every scenario (some start upstreams of their own); a proxy each."""
    from bench import pressure  # round three's scenarios, which build on this module's parts

    with fake_vendor(pinning) as vendor_url:
        for scenario in (*SCENARIOS, *pressure.SCENARIOS):
            try:
                for s in scenario(pinning, vendor_url):
                    emit(s)
            except StartError as exc:
                emit(Scenario(f"hostile/{scenario.__name__}", error=f"StartError: {exc}"))

"""An aiohttp load client in the bench process: N requests at bounded concurrency, each one's
status and latency recorded."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.report import percentile

CLIENT_ERROR = 0  # the status recorded when no HTTP answer came back at all


def result_count(body: bytes) -> int:
    """How many results a Tavily-shaped answer holds (0 when it is not one)."""
    try:
        data = json.loads(body)
    except ValueError:
        return 0
    results = data.get("results") if isinstance(data, dict) else None
    return len(results) if isinstance(results, list) else 0


@dataclass
class Outcome:
    status: int  # 0: no answer (connection error or client timeout)
    seconds: float
    body: bytes = b""  # failed answers always; 200s only with keep_bodies
    headers: dict[str, str] = field(default_factory=dict)  # the keep_headers that came back
    index: int = -1  # i of body(i)


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def n(self) -> int:
        return len(self.outcomes)

    @property
    def ok(self) -> int:
        return sum(1 for o in self.outcomes if 200 <= o.status < 300)

    @property
    def success_ratio(self) -> float:
        return self.ok / self.n if self.n else 0.0

    def latency(self, p: float) -> float:
        return percentile([o.seconds for o in self.outcomes], p)

    def statuses(self) -> str:
        """`200 x 297, 503 x 3` (0 = no HTTP answer)."""
        counts = Counter(o.status for o in self.outcomes)
        return ", ".join(f"{s or 'no answer'} x {c}" for s, c in sorted(counts.items()))

    def sample_failure(self, limit: int = 300) -> str | None:
        """The body of one failed answer, shortened, to show why requests failed."""
        for o in self.outcomes:
            if not 200 <= o.status < 300:
                text = o.body.decode("utf-8", "replace").strip()
                return f"{o.status}: {text[:limit]}" if text else f"status {o.status}"
        return None


async def run_load(
    url: str,
    n: int,
    concurrency: int,
    body: Callable[[int], Any],
    *,
    request_timeout: float = 30.0,
    keep_headers: tuple[str, ...] = (),
    keep_bodies: bool = False,
) -> LoadResult:
    """POST `body(i)` as JSON to `url` for i in 0..n-1, `concurrency` at a time.

    The answer's `keep_headers` are recorded, and its body too when it failed or `keep_bodies`
    is set.
    """
    result = LoadResult()
    next_i = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    client_timeout = aiohttp.ClientTimeout(total=request_timeout)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            started = time.perf_counter()
            kept: dict[str, str] = {}
            try:
                async with session.post(url, json=body(i)) as resp:
                    data = await resp.read()
                    status = resp.status
                    kept = {h: resp.headers[h] for h in keep_headers if h in resp.headers}
            except (aiohttp.ClientError, TimeoutError) as exc:
                data, status = repr(exc).encode(), CLIENT_ERROR
            seconds = time.perf_counter() - started
            if status == 200 and not keep_bodies:
                data = b""
            result.outcomes.append(Outcome(status, seconds, data, kept, i))

    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        result.wall_seconds = time.perf_counter() - started
    return result

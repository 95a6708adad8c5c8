"""`make bench core`'s last parts: what each policy costs (bench/chain.py), then the same three
paths (no policies, every policy on a miss and on a hit) through one worker and through two
(`server.workers: 2`), in one sitting, in rounds: each ratio is two workers over one in the
same round, the median of rounds (bench/core.py says why).

Two workers need Redis, so both sides have it (the every-policy route's limiter and cache then
talk to it on every miss). This machine has 2 cores and the load has to come from somewhere:
wrk, the upstream and redis-server stay on the second CPU for both sides; one worker runs on the
first CPU, two workers may use both. The second worker therefore gets only what the load
generators leave of the second CPU, and the figures say how much that was; the throughput per
core the workers used tells what two cores of their own would give.

- throughput: `wrk -t1 -c32`, 1 KB JSON POSTs: two workers >= 1.7 x one worker on the miss path.
"""

from __future__ import annotations

import os
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import chain, core
from bench.core import CONNECTIONS, FULL, ROUTE, WARMUP_SECONDS, WrkRun
from bench.procs import Pinning, bench_upstream, proxy
from bench.report import Figure, Scenario, at_least, in_turn, median, per_round, spread
from testkit.procs import Child, StartError
from testkit.redisserver import RedisServer
from testkit.waiting import wait_until

WORKERS_TARGET = 1.7  # two workers over one, every policy on a miss
ROUNDS = 6
RUN_SECONDS = 2
PATHS = ("plain", "miss", "hit")
FLEETS = (1, 2)


@dataclass
class Tree:
    """A process and its children (a supervisor and its workers), for their CPU time."""

    pid: int

    def pids(self) -> list[int]:
        try:
            children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        except OSError:
            children = []
        return [self.pid, *map(int, children)]

    def cpu_seconds(self) -> float:
        total = 0.0
        for pid in self.pids():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total


def _workers_up(url: str, workers: int) -> bool:
    """Whether every worker listens (the supervisor's count in /metrics)."""
    if workers == 1:
        return True
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return False
    return f"search_proxy_workers {float(workers)}" in text


def _cpu(runs: list[WrkRun], name: str) -> float:
    return median([r.cpu.get(name, 0.0) for r in runs]) * 100


def run(pinning: Pinning, emit: Callable[[Scenario], None]) -> None:
    """`make bench core`: the one-process figures (bench/core.py), each policy's cost
    (bench/chain.py), then one worker against two."""
    core.run(pinning, emit)
    emit(chain.run(pinning))
    try:
        emit(_compare(pinning))
    except StartError as exc:
        emit(Scenario("core/workers-c32", error=str(exc)))


def _compare(pinning: Pinning) -> Scenario:
    thr: dict[tuple[int, str], list[WrkRun]] = {(n, p): [] for n in FLEETS for p in PATHS}
    redis = RedisServer()
    redis.start()
    try:
        assert redis.proc is not None
        if pinning.other_cpu is not None:
            os.sched_setaffinity(redis.proc.pid, {pinning.other_cpu})
        with (
            tempfile.TemporaryDirectory(prefix="bench-workers-") as tmpdir,
            bench_upstream(pinning) as (up_url, up_child),
        ):
            tmp = Path(tmpdir)
            routes = {
                ROUTE: {"prefix": f"/{ROUTE}", "upstream": up_url},
                **core.full_routes(up_url),
            }
            both = f"{pinning.proxy_cpu},{pinning.other_cpu}"
            fleets: dict[int, tuple[str, Child]] = {}
            with (
                proxy(pinning, routes, redis={"url": redis.url}) as one,
                proxy(
                    pinning, routes, redis={"url": redis.url}, server={"workers": 2}, cpus=both
                ) as two,
            ):
                fleets = {1: one, 2: two}
                for n, (url, _) in fleets.items():
                    wait_until(lambda url=url, n=n: _workers_up(url, n), 20.0)
                same = core._write_script(tmp)
                urls = {
                    "plain": f"/{ROUTE}/search",
                    "miss": f"/{FULL}/search",
                    "hit": f"/{FULL}/search",
                }

                def measure(n: int, path: str, seconds: int) -> WrkRun:
                    url, child = fleets[n]
                    script = core._write_script(tmp, unique=True) if path == "miss" else same
                    watch = {
                        "proxy": Tree(child.pid),
                        "upstream": up_child,
                        "redis": Tree(redis.proc.pid),
                    }
                    return core._wrk(pinning, script, url + urls[path], CONNECTIONS, seconds, watch)

                for n in FLEETS:
                    for path in PATHS:
                        core._check_answers(fleets[n][0] + urls[path])
                        measure(n, path, WARMUP_SECONDS)
                for r in range(ROUNDS):
                    for path in PATHS:
                        for n in in_turn(FLEETS, r):
                            thr[(n, path)].append(measure(n, path, RUN_SECONDS))
    finally:
        redis.stop()
    return _scenario(pinning, thr)


def _scenario(pinning: Pinning, thr: dict[tuple[int, str], list[WrkRun]]) -> Scenario:
    def rps(n: int, path: str) -> float:
        return median([r.rps for r in thr[(n, path)]])

    def per_core(n: int, path: str) -> float:
        return rps(n, path) / max(_cpu(thr[(n, path)], "proxy") / 100, 1e-9)

    def two_over_one(path: str) -> list[float]:
        """Two workers' req/s over one worker's, round by round."""
        return per_round(
            [r.rps for r in thr[(2, path)]], [r.rps for r in thr[(1, path)]], lambda v, a: v / a
        )

    s = Scenario("core/workers-c32")
    s.figures = [
        Figure("1 worker, miss", f"{rps(1, 'miss'):,.0f} req/s"),
        at_least("2 workers, miss", median(two_over_one("miss")), WORKERS_TARGET, "{:.2f}x"),
        Figure("no policies", f"{median(two_over_one('plain')):.2f}x"),
        Figure("hit", f"{median(two_over_one('hit')):.2f}x"),
        Figure(
            "per worker core, miss",
            f"{per_core(2, 'miss') / per_core(1, 'miss'):.2f}x of one worker's "
            f"(2 cores of their own: {2 * per_core(2, 'miss') / per_core(1, 'miss'):.2f}x)",
        ),
    ]
    where = "unpinned"
    if pinning.enabled:
        where = (
            f"1 worker on CPU {pinning.proxy_cpu}; 2 workers on CPUs {pinning.proxy_cpu} and "
            f"{pinning.other_cpu}; upstream, redis-server and wrk on CPU {pinning.other_cpu} for "
            "both"
        )
    s.details = [
        f"wrk -t1 -c{CONNECTIONS} -d{RUN_SECONDS}s, {ROUNDS} rounds of one run per side and "
        f"path; Redis configured on both sides (several workers need it); {where}",
        *(f"{path:<5} 2 over 1: {spread(two_over_one(path), '{:.2f}x')}" for path in PATHS),
        *(
            f"{n} worker{'s' if n > 1 else ' '} {path:<5} req/s: "
            f"{spread([r.rps for r in thr[(n, path)]], '{:,.0f}')}; p50/p99 "
            f"{median([r.p50_ms for r in thr[(n, path)]]):.2f}/"
            f"{median([r.p99_ms for r in thr[(n, path)]]):.2f} ms; CPU, % of one core: "
            f"workers {_cpu(thr[(n, path)], 'proxy'):.0f}%, upstream "
            f"{_cpu(thr[(n, path)], 'upstream'):.0f}%, redis {_cpu(thr[(n, path)], 'redis'):.0f}%, "
            f"wrk {_cpu(thr[(n, path)], 'wrk'):.0f}%"
            for path in PATHS
            for n in FLEETS
        ),
        "the second worker gets what upstream, redis-server and wrk leave of their CPU; "
        "'per worker core' is req/s per core the workers used, two over one",
        *(
            f"WARNING {n} worker(s) {path}: {sum(r.errors for r in runs)} of "
            f"{sum(r.requests for r in runs)} requests failed"
            for (n, path), runs in thr.items()
            if any(r.errors for r in runs)
        ),
    ]
    return s

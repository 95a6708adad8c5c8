"""/metrics for several workers: each worker writes a snapshot of its registry to the run
directory when a scrape asks, and the scrape adds them up, metric by metric (FLEET_RULES); a dead
worker's counters are kept in its slot's retired totals, so the fleet's never go backwards."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

# How series of the same labels combine across workers when not summed. Every worker reports
# its own view of what they share (a breaker's state and transitions, Redis's link, the config
# they reload): summing would count one event once per worker.
FLEET_RULES = {
    "search_proxy_breaker_state": "max",  # the most open any worker sees
    "search_proxy_breaker_transitions_total": "max",  # each worker applies every transition
    "search_proxy_breaker_open_seconds_total": "max",
    "search_proxy_redis_up": "min",  # 0 while any worker has lost Redis
    "search_proxy_redis_configured": "max",
    "search_proxy_redis_node": "max",
    "search_proxy_redis_transitions_total": "max",  # each worker has a link of its own
    "search_proxy_redis_failovers_total": "max",
    "search_proxy_redis_degraded_seconds_total": "max",
    "search_proxy_config_reloads_total": "max",  # every worker reloads each time
    "search_proxy_config_info": "max",  # two hashes while workers serve different files
    "search_proxy_build_info": "max",
    "process_start_time_seconds": "min",  # the fleet's oldest worker
    "process_max_fds": "max",  # a per-process limit
}
# The supervisor's own: only exported with several workers.
WORKERS_UP = "search_proxy_workers"
WORKER_RESTARTS = "search_proxy_worker_restarts"
FLEET_METRICS = {
    WORKERS_UP: ("gauge", "Worker processes serving now (server.workers above 1 only)."),
    WORKER_RESTARTS: (
        "counter",
        "Worker processes restarted by the supervisor after they died (server.workers above 1 "
        "only).",
    ),
}
_SUMMED_TYPES = ("counter", "histogram")  # what a dead worker's retired totals keep
LOCK = "metrics.lock"
SUPERVISOR = "supervisor.json"
RETIRED = "retired"

Family = dict[str, Any]  # name, type, help, samples: [[sample name, labels, value], ...]
_Key = tuple[str, tuple[tuple[str, str], ...]]


def exposed(family: Family) -> str:
    """The name a family is read by: a counter's with `_total`, as docs/metrics.md lists it."""
    name: str = family["name"]
    return f"{name}_total" if family["type"] == "counter" else name


def families(registry: CollectorRegistry) -> list[Family]:
    """A registry's metrics now, as plain data (what a snapshot holds)."""
    return [
        {
            "name": m.name,
            "type": m.type,
            "help": m.documentation,
            "samples": [[s.name, s.labels, s.value] for s in m.samples],
        }
        for m in registry.collect()
    ]


@dataclass
class _Sum:
    """One family's series added up, in the order first seen."""

    family: Family
    values: dict[_Key, float] = field(default_factory=dict)
    labels: dict[_Key, dict[str, str]] = field(default_factory=dict)

    def add(self, samples: Iterable[Sequence[Any]], how: str = "sum") -> None:
        for name, labels, value in samples:
            key = (name, tuple(sorted(labels.items())))
            if key not in self.values:
                self.values[key], self.labels[key] = value, labels
            elif how == "max":
                self.values[key] = max(self.values[key], value)
            elif how == "min":
                self.values[key] = min(self.values[key], value)
            else:
                self.values[key] += value

    def samples(self) -> list[list[Any]]:
        return [[key[0], self.labels[key], value] for key, value in self.values.items()]


def _added(
    snapshots: Iterable[Iterable[Family]], types: Sequence[str] | None = None
) -> dict[str, _Sum]:
    found: dict[str, _Sum] = {}
    for snapshot in snapshots:
        for family in snapshot:
            if types is not None and family["type"] not in types:
                continue
            total = found.setdefault(family["name"], _Sum(family))
            total.add(family["samples"])
    return found


def retire(retired: Iterable[Family], dead: Iterable[Family]) -> list[Family]:
    """A slot's retired totals once a worker of it died: its counters and histograms added to
    those of the slot's workers that died before (its gauges died with it)."""
    return [
        {**total.family, "samples": total.samples()}
        for total in _added((retired, dead), _SUMMED_TYPES).values()
    ]


@dataclass
class Slot:
    """What one worker slot has on file: the retired totals of its dead workers, and the last
    snapshot of each worker of it not retired yet (one, but for a moment after a death)."""

    retired: list[Family] = field(default_factory=list)
    live: list[list[Family]] = field(default_factory=list)


def merge(slots: Sequence[Slot]) -> list[Family]:
    """The fleet's metrics: each slot's own totals (its retired counters and histograms added to
    its live ones, its live gauges), then the slots combined by FLEET_RULES (sum otherwise)."""
    fleet: dict[str, _Sum] = {}
    for slot in slots:
        mine = _added(slot.live)
        for name, total in _added([slot.retired]).items():
            mine.setdefault(name, _Sum(total.family)).add(total.samples())
        for name, total in mine.items():
            combined = fleet.setdefault(name, _Sum(total.family))
            combined.add(total.samples(), FLEET_RULES.get(exposed(total.family), "sum"))
    return [{**total.family, "samples": total.samples()} for total in fleet.values()]


def supervisor_families(report: dict[str, Any]) -> list[Family]:
    """The supervisor's figures (its `supervisor.json`) as metrics."""
    found = []
    for name, value in (
        (WORKERS_UP, report.get("up", 0)),
        (WORKER_RESTARTS, report.get("restarts", 0)),
    ):
        kind, text = FLEET_METRICS[name]
        sample = f"{name}_total" if kind == "counter" else name
        found.append({"name": name, "type": kind, "help": text, "samples": [[sample, {}, value]]})
    return found


class _Fixed:
    """A collector handing out families already added up."""

    def __init__(self, found: Sequence[Family]) -> None:
        self.found = found

    def collect(self) -> Iterator[Metric]:
        for family in self.found:
            metric = Metric(family["name"], family["help"], family["type"])
            for name, labels, value in family["samples"]:
                metric.add_sample(name, labels, value)
            yield metric


def render(found: Sequence[Family]) -> bytes:
    """The Prometheus text exposition of `found`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(found))
    return generate_latest(registry)


# ---------------------------------------------------------------------------------------------
# The run directory: `metrics-<slot>-<pid>.json` (a worker's last snapshot),
# `metrics-<slot>-retired.json` (its dead workers' totals), and the lock between the two.


def _path(run_dir: Path, slot: int, who: int | str) -> Path:
    return run_dir / f"metrics-{slot}-{who}.json"


@contextlib.contextmanager
def _locked(run_dir: Path, how: int) -> Iterator[None]:
    """A scrape reads the files while no death is being retired, and the other way round: a
    worker's counters are counted once, from its own snapshot or from the retired totals."""
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write(path: Path, data: bytes) -> None:
    """Replace `path` whole: a reader sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def _read(path: Path) -> list[Family]:
    try:
        found: list[Family] = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return []
    return found


def write_snapshot(run_dir: Path, slot: int, found: list[Family]) -> None:
    """This worker's metrics now, for the next scrape to add up (and its retired totals, if it
    dies before the next one)."""
    _write(_path(run_dir, slot, os.getpid()), orjson.dumps(found))


def retire_worker(run_dir: Path, slot: int, pid: int) -> None:
    """Worker `pid` of `slot` is dead: fold its last snapshot into the slot's retired totals."""
    dead = _path(run_dir, slot, pid)
    with _locked(run_dir, fcntl.LOCK_EX):
        if not dead.exists():
            return
        retired = _path(run_dir, slot, RETIRED)
        _write(retired, orjson.dumps(retire(_read(retired), _read(dead))))
        dead.unlink()


def write_supervisor(run_dir: Path, report: dict[str, Any]) -> None:
    """The supervisor's figures, for the scrape to export."""
    _write(run_dir / SUPERVISOR, orjson.dumps(report))


def fleet_exposition(run_dir: Path, workers: int) -> bytes:
    """The fleet's /metrics from what the run directory holds now (blocking file reads: run it
    in a thread)."""
    slots = []
    with _locked(run_dir, fcntl.LOCK_SH):
        for slot in range(workers):
            found = Slot(retired=_read(_path(run_dir, slot, RETIRED)))
            for path in sorted(run_dir.glob(f"metrics-{slot}-*.json")):
                if path.name != _path(run_dir, slot, RETIRED).name:
                    found.live.append(_read(path))
            slots.append(found)
    try:
        report = orjson.loads((run_dir / SUPERVISOR).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        report = {}
    return render([*merge(slots), *supervisor_families(report)])

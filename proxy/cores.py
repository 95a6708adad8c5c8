"""How many worker processes serve: `server.workers`' parser, and what `auto` resolves to (the
CPUs this process may run on, lowered to a cgroup's CPU quota, as a Kubernetes limit sets)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from policies.core.settings import ConfigError, whole

AUTO = "auto"
# A bound, not a recommendation: every worker holds its own upstream pool and memory.
MAX_WORKERS = 256
CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_workers(value: Any, path: str) -> int | str:
    """A whole number of workers from 1 to MAX_WORKERS, or `auto`."""
    if value == AUTO:
        return AUTO
    try:
        return whole(value, path, 1, MAX_WORKERS)
    except ConfigError:
        raise ConfigError(
            path, f"expected a whole number from 1 to {MAX_WORKERS}, or auto, got {value!r}"
        ) from None


def quota_cpus(cpu_max: str) -> float | None:
    """The CPUs a cgroup v2 `cpu.max` (`QUOTA PERIOD`, or `max PERIOD`) allows; None: no
    limit, or a text that is not one."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def workers_for(cpus: int, quota: float | None) -> int:
    """`auto`: one worker per CPU this process may use, or per whole CPU of its quota (a worker
    on a fraction of a CPU is throttled), never fewer than one."""
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, min(cpus, MAX_WORKERS))


def cgroup_quota(proc_cgroup: str, root: Path = CGROUP_ROOT) -> float | None:
    """The smallest CPU quota on the way from this process's cgroup v2 group (`0::/path` in
    /proc/self/cgroup) up to the root: a limit set on a parent binds its children too."""
    line = next((ln for ln in proc_cgroup.splitlines() if ln.startswith("0::")), None)
    if line is None:
        return None
    group = root / line.removeprefix("0::").strip().lstrip("/")
    found: list[float] = []
    for directory in (group, *group.parents):
        if directory != root and root not in directory.parents:
            break
        try:
            quota = quota_cpus((directory / "cpu.max").read_text())
        except OSError:
            continue
        if quota is not None:
            found.append(quota)
    return min(found, default=None)


def resolve(setting: int | str) -> int:
    """The number of workers `setting` means on this machine, now."""
    if setting != AUTO:
        return int(setting)
    try:
        quota = cgroup_quota(Path("/proc/self/cgroup").read_text())
    except OSError:
        quota = None
    return workers_for(len(os.sched_getaffinity(0)), quota)

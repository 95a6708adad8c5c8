"""`python -m bench [GROUP ...]`: run scenario groups (all by default) and print their figures.

Groups: see GROUPS below. Each prints one line per scenario with each figure next to its
target and [met] / [NOT met: ...]; a summary follows. The exit code is 0 whether or not
targets are met (this is a benchmark); it is 2 only for a bad command line.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable

from bench import (
    ablation,
    burst,
    chaos,
    failover,
    fetch,
    hedge,
    hostile,
    mcp,
    mcproute,
    recovery,
    redisha,
    resilience,
    retries,
    search,
    workers,
)
from bench.procs import Pinning, detect_pinning
from bench.report import Scenario
from testkit.procs import stop_all

# A group runs its scenarios and hands each one, as soon as it is done, to the callback.
GROUPS: dict[str, Callable[[Pinning, Callable[[Scenario], None]], None]] = {
    "core": workers.run,  # bench/core.py's figures, each policy's cost, one worker against two
    "ablation": ablation.run,  # each policy's cost to a miss, by taking it out of the route
    "retries": retries.run,
    "resilience": resilience.run,
    "search": search.run,
    "burst": burst.run,
    "failover": failover.run,
    "hostile": hostile.run,
    "hedge": hedge.run,
    "recovery": recovery.run,
    "mcp": mcp.run,
    "mcproute": mcproute.run,
    "redis": redisha.run,
    "fetch": fetch.run,
    "chaos": chaos.run,
}


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(143)  # unwinds through every context manager, stopping the children


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "groups",
        nargs="*",
        metavar="GROUP",
        help=f"scenario groups to run (default: all): {', '.join(GROUPS)}",
    )
    args = parser.parse_args(argv)
    unknown = [g for g in args.groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown group(s) {', '.join(unknown)}; known: {', '.join(GROUPS)}")
    groups = args.groups or list(GROUPS)
    signal.signal(signal.SIGTERM, _on_sigterm)

    if shutil.which("wrk") is None and "core" in groups:
        print("bench: wrk is not installed (apt-get install wrk); skipping core", flush=True)
        groups = [g for g in groups if g != "core"]
    pinning = detect_pinning()
    load1, load5, _ = os.getloadavg()
    print(
        f"search-proxy bench: python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average {load1:.2f} (1 min) {load5:.2f} (5 min)",
        flush=True,
    )
    print(f"pinning: {pinning.describe()}", flush=True)
    started = time.monotonic()
    results: list[Scenario] = []
    try:
        for name in groups:
            print(f"\n== {name} ==", flush=True)
            t0 = time.monotonic()

            def emit(scenario: Scenario) -> None:
                scenario.print()
                results.append(scenario)

            try:
                GROUPS[name](pinning, emit)
            except Exception as exc:  # one broken group must not hide the others
                traceback.print_exc(file=sys.stdout)
                emit(Scenario(f"{name}/*", error=f"{type(exc).__name__}: {exc}"))
            finally:
                stop_all()
            print(f"({name}: {time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        stop_all()

    print("\n== summary ==")
    for s in results:
        print(f"{s.verdict():<10} {s.name}")
    with_targets = [s for s in results if s.met is not None]
    met = sum(1 for s in with_targets if s.met)
    print(
        f"{met} of {len(with_targets)} scenarios with targets met; "
        f"total {time.monotonic() - started:.0f} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

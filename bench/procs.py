"""Child processes of the benchmark: the proxy, the fake vendor and the bench upstream.

Every process started here is pinned (when the machine allows it) and is a `testkit.procs.Child`:
registered, and stopped by `stop()` or, whatever happens, by `stop_all()` at exit. Nothing is
killed by name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from bench.report import Scenario
from testkit.fakevendor import FakeVendorProcess
from testkit.procs import Child, StartError, free_port


@dataclass(frozen=True)
class Pinning:
    """Which CPU the proxy gets and which one everything else (upstream, load generator) gets."""

    proxy_cpu: int | None
    other_cpu: int | None
    reason: str = ""

    @property
    def enabled(self) -> bool:
        return self.proxy_cpu is not None

    def prefix(self, cpu: int | None) -> list[str]:
        """`taskset -c N` to put in front of a command, or nothing when pinning is off."""
        if not self.enabled or cpu is None:
            return []
        return ["taskset", "-c", str(cpu)]

    def describe(self) -> str:
        if not self.enabled:
            return f"not pinned ({self.reason})"
        return (
            f"taskset: proxy on CPU {self.proxy_cpu}; upstream/fake vendor and load generator "
            f"on CPU {self.other_cpu}"
        )


@contextlib.contextmanager
def client_pinned(pinning: Pinning) -> Iterator[None]:
    """This process (the load client, in-process fake vendors) on the non-proxy CPU while a
    group runs, so it never competes with the proxy for its CPU."""
    if not pinning.enabled or pinning.other_cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {pinning.other_cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def detect_pinning() -> Pinning:
    """Pin the proxy to the first CPU we may use and the rest to the second, if there are two."""
    cpus = sorted(os.sched_getaffinity(0))
    if shutil.which("taskset") is None:
        return Pinning(None, None, "taskset is not installed")
    if len(cpus) < 2:
        return Pinning(None, None, f"only CPU(s) {cpus} available")
    return Pinning(cpus[0], cpus[1])


def run_scenarios(
    group: str,
    scenarios: tuple[Callable[[Pinning], Scenario], ...],
    pinning: Pinning,
    emit: Callable[[Scenario], None],
) -> None:
    """Each scenario in turn, this process on the non-proxy CPU; one that cannot start its
    processes is reported as an error and the next one runs."""
    with client_pinned(pinning):
        for scenario in scenarios:
            try:
                emit(scenario(pinning))
            except StartError as exc:
                emit(Scenario(f"{group}/{scenario.__name__}", error=f"{exc}"))


@contextlib.contextmanager
def fake_vendor(
    pinning: Pinning, *args: str, port: int = 0, timeout: float = 20.0
) -> Iterator[str]:
    """`python -m proxy.testing.fakevendor --port PORT ARGS` on the non-proxy CPU; yields its URL.

    A given `port` lets a vendor be stopped and started again, in another mode, at the URL a
    running proxy already has (the fake has no runtime control for its modes).
    """
    vendor = FakeVendorProcess(*args, port=port, wrapper=pinning.prefix(pinning.other_cpu))
    try:
        yield vendor.start(timeout).url
    finally:
        vendor.stop()


@contextlib.contextmanager
def bench_upstream(pinning: Pinning, timeout: float = 20.0) -> Iterator[tuple[str, Child]]:
    """`python -m bench.upstream` (the fastest upstream we have) on the non-proxy CPU."""
    argv = [*pinning.prefix(pinning.other_cpu), sys.executable, "-m", "bench.upstream"]
    child = Child("upstream", [*argv, "--port", "0"], pipe_stdout=True)
    try:
        port = child.read_port(timeout)
        yield f"http://127.0.0.1:{port}", child
    finally:
        child.stop()


def proxy_config(
    routes: dict[str, Any],
    *,
    port: int,
    log_level: str = "warning",
    redis: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    **sections: Any,
) -> dict:
    """A whole proxy config around `routes` (and `redis`, `server` settings, and other top-level
    `sections`, when given); request logs are off unless log_level is info."""
    config = {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace": "1s", **(server or {})},
        "log": {"level": log_level, "format": "json"},
        "routes": routes,
        **sections,
    }
    if redis is not None:
        config["redis"] = redis
    return config


@contextlib.contextmanager
def proxy(
    pinning: Pinning,
    routes: dict[str, Any],
    *,
    log_level: str = "warning",
    timeout: float = 15.0,
    redis: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    cpus: str | None = None,
    wrapper: tuple[str, ...] = (),
    **sections: Any,
) -> Iterator[tuple[str, Child]]:
    """`python -m proxy` on the proxy CPU (or on `cpus`, a taskset list: `0,1`; run under
    `wrapper`, a command such as prlimit, when given), ready once
    /healthz answers; yields (url, child). `sections` are top-level config sections besides the
    routes (`mcp_server`, ...); `server` adds settings to its own (`workers` ...).

    At log level warning the proxy prints no "listening" line, so the port is chosen here.
    Raises testkit.procs.StartError with the proxy's own output when it exits or does not answer.
    """
    port = free_port()
    fd, config_path = tempfile.mkstemp(prefix="bench-proxy-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        config = proxy_config(
            routes, port=port, log_level=log_level, redis=redis, server=server, **sections
        )
        yaml.safe_dump(config, f)
    try:
        with proxy_from_file(
            pinning, config_path, port=port, timeout=timeout, cpus=cpus, wrapper=wrapper
        ) as started:
            yield started
    finally:
        with contextlib.suppress(OSError):
            os.unlink(config_path)


@contextlib.contextmanager
def proxy_from_file(
    pinning: Pinning,
    config_path: str,
    *,
    port: int | None = None,
    timeout: float = 15.0,
    cpus: str | None = None,
    wrapper: tuple[str, ...] = (),
) -> Iterator[tuple[str, Child]]:
    """`python -m proxy --config FILE` on the proxy CPU (or `cpus`; under `wrapper`), on a free
    port (the file's own is overridden), ready once /healthz answers; yields (url, child)."""
    port = port or free_port()
    where = pinning.prefix(pinning.proxy_cpu)
    if cpus is not None and pinning.enabled:
        where = ["taskset", "-c", cpus]
    argv = [*wrapper, *where, sys.executable, "-m", "proxy"]
    # Admin endpoints on a free port: proxies running side by side must not share one.
    argv += ["--config", config_path, "--port", str(port), "--admin-port", "0"]
    child = Child("proxy", argv)
    url = f"http://127.0.0.1:{port}"
    try:
        child.wait_http(url + "/healthz", timeout)
        yield url, child
    finally:
        child.stop()


@contextlib.contextmanager
def bare_forwarder(
    pinning: Pinning, upstream: str, timeout: float = 20.0
) -> Iterator[tuple[str, Child]]:
    """`python -m bench.forwarder` (the least a Python forwarder does) on the proxy CPU."""
    argv = [*pinning.prefix(pinning.proxy_cpu), sys.executable, "-m", "bench.forwarder"]
    child = Child("forwarder", [*argv, "--port", "0", "--upstream", upstream], pipe_stdout=True)
    try:
        port = child.read_port(timeout)
        yield f"http://127.0.0.1:{port}", child
    finally:
        child.stop()


def rss_mb(child: Child) -> float:
    """The resident memory of a running child, in MB (VmRSS); nan once it is gone."""
    try:
        status = open(f"/proc/{child.pid}/status").read()
    except OSError:
        return float("nan")
    kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return kb / 1024


def get_json(url: str, timeout: float = 5.0) -> Any:
    """GET a JSON document (fake vendor stats)."""
    import json

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def get_text(url: str, timeout: float = 5.0) -> str:
    """GET a text document (the proxy's /metrics)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def metric_sum(exposition: str, name: str, **labels: str) -> float | None:
    """Sum of the samples of `name` whose labels include `labels`; None if there is none."""
    total = None
    for line in exposition.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total = (total or 0.0) + float(value)
    return total

"""Child processes of the benchmark: the proxy, the fake vendor and the bench upstream.

Every process started here is pinned (when the machine allows it), registered, and stopped by
`stop()` or, whatever happens, by `stop_all()` at exit. Nothing is killed by name.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
_RUNNING: list[Child] = []


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


def detect_pinning() -> Pinning:
    """Pin the proxy to the first CPU we may use and the rest to the second, if there are two."""
    cpus = sorted(os.sched_getaffinity(0))
    if shutil.which("taskset") is None:
        return Pinning(None, None, "taskset is not installed")
    if len(cpus) < 2:
        return Pinning(None, None, f"only CPU(s) {cpus} available")
    return Pinning(cpus[0], cpus[1])


def free_port() -> int:
    """A loopback port free right now (another process could take it before we bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """A started process whose output goes to a temporary log file."""

    def __init__(self, name: str, argv: list[str], *, stdout_pipe: bool = False) -> None:
        self.name = name
        self.argv = argv
        fd, self.log_path = tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")
        self._log = os.fdopen(fd, "wb")
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else self._log,
            stderr=self._log,
        )
        _RUNNING.append(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output_tail(self, lines: int = 15) -> str:
        """The last lines the process wrote (stderr, and stdout unless piped)."""
        self._log.flush()
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def cpu_seconds(self) -> float:
        """User + system CPU time the process has used so far (0.0 once it is gone)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return 0.0
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)
        if self in _RUNNING:
            _RUNNING.remove(self)


def stop_all() -> None:
    """Stop every child still running (at exit, or after an error)."""
    for child in list(reversed(_RUNNING)):
        child.stop()


atexit.register(stop_all)


class StartError(RuntimeError):
    """A child did not come up; the message carries the end of its output."""


def _read_port(child: Child, timeout: float) -> int:
    """The port a child prints as its first stdout line (fake vendor, bench upstream)."""
    assert child.proc.stdout is not None
    deadline = time.monotonic() + timeout
    os.set_blocking(child.proc.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        chunk = child.proc.stdout.read()
        if chunk:
            buf += chunk
            if b"\n" in buf:
                line = buf.split(b"\n", 1)[0].strip()
                if line.isdigit():
                    return int(line)
                break
        if not child.alive():
            break
        time.sleep(0.02)
    out = child.output_tail()
    child.stop()
    raise StartError(f"{child.name} did not start: {buf[:200]!r}\n{out}")


@contextlib.contextmanager
def fake_vendor(
    pinning: Pinning, *args: str, port: int = 0, timeout: float = 20.0
) -> Iterator[str]:
    """`python -m tests.fakevendor --port PORT ARGS` on the non-proxy CPU; yields its URL.

    A given `port` lets a vendor be stopped and started again, in another mode, at the URL a
    running proxy already has (the fake has no runtime control for its modes).
    """
    argv = [*pinning.prefix(pinning.other_cpu), sys.executable, "-m", "tests.fakevendor"]
    child = Child("fakevendor", [*argv, "--port", str(port), *args], stdout_pipe=True)
    try:
        port = _read_port(child, timeout)
        yield f"http://127.0.0.1:{port}"
    finally:
        child.stop()


@contextlib.contextmanager
def bench_upstream(pinning: Pinning, timeout: float = 20.0) -> Iterator[tuple[str, Child]]:
    """`python -m bench.upstream` (the fastest upstream we have) on the non-proxy CPU."""
    argv = [*pinning.prefix(pinning.other_cpu), sys.executable, "-m", "bench.upstream"]
    child = Child("upstream", [*argv, "--port", "0"], stdout_pipe=True)
    try:
        port = _read_port(child, timeout)
        yield f"http://127.0.0.1:{port}", child
    finally:
        child.stop()


def proxy_config(routes: dict[str, Any], *, port: int, log_level: str = "warning") -> dict:
    """A whole proxy config around `routes`; request logs are off unless log_level is info."""
    return {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace": "1s"},
        "log": {"level": log_level, "format": "json"},
        "routes": routes,
    }


@contextlib.contextmanager
def proxy(
    pinning: Pinning,
    routes: dict[str, Any],
    *,
    log_level: str = "warning",
    timeout: float = 15.0,
) -> Iterator[tuple[str, Child]]:
    """`python -m proxy` on the proxy CPU, ready once /healthz answers; yields (url, child).

    At log level warning the proxy prints no "listening" line, so the port is chosen here.
    Raises StartError with the proxy's own output when it exits or does not answer.
    """
    port = free_port()
    fd, config_path = tempfile.mkstemp(prefix="bench-proxy-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(proxy_config(routes, port=port, log_level=log_level), f)
    argv = [*pinning.prefix(pinning.proxy_cpu), sys.executable, "-m", "proxy"]
    child = Child("proxy", [*argv, "--config", config_path, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if not child.alive():
                raise StartError(
                    f"proxy exited with code {child.proc.returncode}: {child.output_tail()}"
                )
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise StartError(
                    f"proxy did not answer /healthz in {timeout}s: {child.output_tail()}"
                )
            time.sleep(0.05)
        yield url, child
    finally:
        child.stop()
        with contextlib.suppress(OSError):
            os.unlink(config_path)


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

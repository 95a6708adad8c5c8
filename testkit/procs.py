"""Child processes for tests and benchmarks: start one, learn its port or wait until it answers,
stop it cleanly.

Every child is registered and stopped by `stop()`, or whatever happens by `stop_all()` at exit.
Nothing is killed by name.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import socket
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from testkit.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
_RUNNING: list[Child] = []


# Ports handed out below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by
# default): a port from bind(0) is one every outgoing connection may take before the server we
# hand it to binds it, which happened with a test's twelve Redis cluster ports.
_PORTS = range(20000, 32000)
_handed_out: set[int] = set()
_random = random.Random()


def free_port() -> int:
    """A loopback port free right now, never handed out before by this process (another
    process could still take it before we bind it)."""
    for _ in range(200):
        port = _random.choice(_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # the range is crowded: let the kernel choose
        s.bind(("127.0.0.1", 0))
        found: int = s.getsockname()[1]
        return found


class StartError(RuntimeError):
    """A child did not come up; the message carries the end of its output."""


class Child:
    """A process started from the repository root. Its stderr, and its stdout unless piped, go
    to a temporary log file (`output_tail()`); with `merge_stderr` stderr joins the stdout pipe.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        pipe_stdout: bool = False,
        merge_stderr: bool = False,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        fd, self.log_path = tempfile.mkstemp(prefix=f"testkit-{name}-", suffix=".log")
        self._log = os.fdopen(fd, "wb")
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipe_stdout else self._log,
            stderr=subprocess.STDOUT if merge_stderr else self._log,
        )
        _RUNNING.append(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output_tail(self, lines: int = 15) -> str:
        """The last lines the process wrote to its log file."""
        if self._log.closed:
            return ""
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

    def read_port(self, within: float = 20.0) -> int:
        """The port the child prints as its first stdout line (needs `pipe_stdout`). If it
        prints something else, exits or stays silent, it is stopped and StartError raised."""
        out = self.proc.stdout
        assert out is not None, "read_port needs pipe_stdout=True"
        os.set_blocking(out.fileno(), False)
        buf = bytearray()

        def line_or_exit() -> bool:
            chunk = out.read()
            if chunk:
                buf.extend(chunk)
            return b"\n" in buf or not self.alive()

        with contextlib.suppress(TimeoutError):
            wait_until(line_or_exit, within)
        line = bytes(buf).split(b"\n", 1)[0].strip()
        if b"\n" in buf and line.isdigit():
            return int(line)
        tail = self.output_tail()
        self.stop()
        raise StartError(f"{self.name} did not start: {bytes(buf[:200])!r}\n{tail}")

    def wait_http(self, url: str, within: float) -> None:
        """Return once GET `url` answers 200. If the child exits first or `within` s pass, it is
        stopped and StartError raised with its output."""

        def answers() -> bool:
            if not self.alive():
                raise StartError(
                    f"{self.name} exited with code {self.proc.returncode}: {self.output_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    status: int = resp.status
                    return status == 200
            except (urllib.error.URLError, OSError):
                return False

        try:
            wait_until(answers, within, interval=0.05)
        except TimeoutError:
            tail = self.output_tail()
            self.stop()
            raise StartError(f"{self.name} did not answer {url} in {within}s: {tail}") from None
        except StartError:
            self.stop()
            raise

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace` s; returns the exit code. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._release()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL now, as a crash would end it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._release()

    def _release(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if not self._log.closed:
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
